"""Family `config`: a configuration change asked for in prose.

"Please change the defaults of the HTTP client: the client should retry 5
times by default and the request timeout should be 30 s." The package keeps
its defaults in one place (see config_shapes.py: constants, JSON, dataclass
or INI — one shape per template); 1-3 of them must change (the difficulty
says how many) and the rest must stay. Hidden tests probe each setting
through the code that uses it: the changed ones are fail_to_pass, the
unchanged ones pass_to_pass.
"""

from __future__ import annotations

import random

from codefleet.tasks.families.base import SIZES, Case, Draft, TestFile, project_files
from codefleet.tasks.families.config_shapes import SHAPES, prose_value
from codefleet.tasks.families.layout import distractors

NAME = "config"
TEMPLATES = {"http_client": "train", "worker_pool": "train", "cache": "train", "mailer": "test"}

_OPENERS = (
    "Please change the defaults of {topic} (they live in `{where}`): {changes}.",
    "We need new defaults for {topic}: {changes}. Leave the other settings as they are.",
    "Ops asked for a configuration change in {topic}: {changes}. The defaults are in `{where}`.",
)
_VAGUE_OPENERS = (
    "Change the defaults of {topic}: {changes}. Nothing else should change.",
    "New requirements for {topic}: {changes}.",
)


def _join(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def draft(template: str, rng: random.Random, difficulty: int) -> Draft:
    shape, test_imports = SHAPES[template]
    size = SIZES[difficulty]
    package = rng.choice(shape.packages)
    changed = rng.sample(list(shape.settings), min(difficulty, len(shape.settings)))
    changed_keys = {s.key for s in changed}
    old = {s.key: s.default for s in shape.settings}
    new = {s.key: (rng.choice(s.choices) if s.key in changed_keys else s.default) for s in shape.settings}

    def files(values: dict) -> dict[str, str]:
        out = project_files(package, shape.topic.removeprefix("the ") + " with its defaults in one place")
        out[f"{package}/__init__.py"] = f'"""{shape.topic.removeprefix("the ").capitalize()}."""\n'
        out.update({f"{package}/{name}": text for name, text in shape.render(package, values).items()})
        return out

    extra_files, extra_tests = distractors(None, package, size, rng)
    before, after = files(old) | extra_files, files(new) | extra_files
    visible = [
        TestFile(
            "tests/test_defaults_consistent.py",
            f"Consistency of {package}'s defaults.",
            custom=shape.visible_tests,
            custom_imports=test_imports.format(package=package),
            custom_status={name: True for name in _test_names(shape.visible_tests)},
        ),
        *extra_tests,
    ]
    hidden = [
        TestFile(
            "tests/test_defaults.py",
            f"The defaults of {package}.",
            [
                Case(f"{package}.{s.probe[0]}", s.probe[1], s.probe[2], f"test_{s.key.lower()}", s.probe[3])
                for s in shape.settings
            ],
        )
    ]
    phrases = [s.phrase.format(value=prose_value(new[s.key])) for s in shape.settings if s.key in changed_keys]
    text = rng.choice(_VAGUE_OPENERS if size.vague else _OPENERS).format(
        topic=shape.topic, where=f"{package}/{shape.where}", changes=_join(phrases)
    )
    return Draft(NAME, template, text, before=before, after=after, visible=visible, hidden=hidden)


def _test_names(source: str) -> list[str]:
    return [line[4 : line.index("(")] for line in source.splitlines() if line.startswith("def test_")]
