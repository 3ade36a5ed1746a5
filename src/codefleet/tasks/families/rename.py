"""Family `rename`: rename a function and every use of it across files.

The function is defined in the domain module, re-exported by the package's
`__init__` (`__all__` included) and used by 2-5 small modules (a batch
runner, a request handler, a memo cache, ...; some import the name, some the
module). The visible tests use the old name. The hidden checks import the
new name, check the old one is gone from the module, that no `.py` file of
the package or tests still mentions it as a word, and that the callers
behave as before. Only names with an underscore that appear nowhere else as
a word are renamed, so the rename is a clean word-for-word replacement
(which is exactly how the reference solution is made).
"""

from __future__ import annotations

import random
import re

from codefleet.tasks.families.base import SIZES, Case, Draft, DraftError, TestFile
from codefleet.tasks.families.domains import DOMAINS, MORE_DOMAINS, Func, module_source
from codefleet.tasks.families.layout import distractors, module_cases, package_files, pick_funcs

NAME = "rename"
TEMPLATES = {
    "inventory": "train",
    "text": "train",
    "bank": "train",
    "grades": "train",
    "shipping": "train",
    "geometry": "test",
    "schedule": "test",
    **{d.name: "train" for d in MORE_DOMAINS},
}

# kind -> (module docstring, source with {ref} for the function reference, function name, args from cases)
_USERS = {
    "batch": (
        "Run the helper over many inputs at once.",
        'def run_batch(rows):\n    """One result per argument tuple in `rows`."""\n'
        "    return [{ref}(*row) for row in rows]\n",
        "run_batch",
        lambda cs: (list(cs[:2]),),
    ),
    "api": (
        "A tiny request handler around the helper.",
        "def handle(request):\n    \"\"\"Answer {'args': [...]} with {'ok': True, 'result': ...}.\"\"\"\n"
        '    return {"ok": True, "result": {ref}(*request["args"])}\n',
        "handle",
        lambda cs: ({"args": list(cs[0])},),
    ),
    "pipeline": (
        "First step of the processing pipeline.",
        "def first_result(rows):\n"
        '    """The result for the first argument tuple of `rows`; None if empty."""\n'
        "    if not rows:\n        return None\n    return {ref}(*rows[0])\n",
        "first_result",
        lambda cs: (list(cs[1:3]),),
    ),
    "compare": (
        "Compare the helper's results for two inputs.",
        "def same_result(first_args, second_args):\n"
        '    """True if both argument tuples give the same result."""\n'
        "    return {ref}(*first_args) == {ref}(*second_args)\n",
        "same_result",
        lambda cs: (cs[0], cs[1]),
    ),
    "memo": (
        "Memoised access to the helper.",
        '_CACHE = {}\n\n\ndef cached(*args):\n    """The helper\'s result for `args`, computed once per distinct '
        'arguments."""\n    key = repr(args)\n    if key not in _CACHE:\n        _CACHE[key] = {ref}(*args)\n'
        "    return _CACHE[key]\n",
        "cached",
        lambda cs: cs[0],
    ),
}

_HIDDEN_IMPORTS = "import pathlib\nimport re\n\nimport {module} as target_module"
_HIDDEN_TESTS = """
ROOT = pathlib.Path(__file__).resolve().parents[1]
OLD = "{old}"
NEW = "{new}"


def test_new_name_is_defined():
    assert callable(getattr(target_module, NEW, None)), "{module}." + NEW + " is missing"


def test_old_name_is_gone():
    assert not hasattr(target_module, OLD), "{module} still defines " + OLD


def test_no_reference_to_old_name_left():
    pattern = re.compile(r"\\b" + OLD + r"\\b")
    here = pathlib.Path(__file__).resolve()
    left = [str(path.relative_to(ROOT)) for folder in ("{package}", "tests")
            for path in sorted((ROOT / folder).rglob("*.py"))
            if path.resolve() != here and pattern.search(path.read_text(encoding="utf-8"))]
    assert not left, OLD + " is still mentioned in " + ", ".join(left)
"""

_ASKS = (
    "Rename `{old}` in `{path}` to `{new}`. Update every use: imports, calls, `__all__`, docstrings and the "
    "tests. Don't keep an alias under the old name.",
    "`{old}` is a poor name; please call it `{new}` instead, across the whole package and its tests. "
    "The old name should disappear completely (no backwards-compatible alias).",
    "Refactor: the function `{old}` ({path}) becomes `{new}`. Every module that uses it, the package's "
    "exports and the tests must follow; nothing should mention `{old}` afterwards.",
)
_VAGUE_ASKS = (
    "Please rename the function `{old}` to `{new}` everywhere in the repository, without a compatibility alias.",
)


def _word(name: str) -> re.Pattern:
    return re.compile(rf"\b{re.escape(name)}\b")


def _renameable(func: Func, funcs: tuple[Func, ...]) -> bool:
    """A name with an underscore that no other function's text mentions."""
    return "_" in func.name and not any(_word(func.name).search(f.source) for f in funcs if f.name != func.name)


def draft(template: str, rng: random.Random, difficulty: int) -> Draft:
    domain, size = DOMAINS[template], SIZES[difficulty]
    candidates = [f for f in domain.funcs if _renameable(f, domain.funcs)]
    if not candidates:
        raise DraftError(f"rename/{template}: no function can be renamed cleanly")
    target = rng.choice(candidates)
    new = rng.choice(target.aliases)
    package = rng.choice(domain.packages)
    module, path = f"{package}.{domain.module}", f"{package}/{domain.module}.py"
    funcs = pick_funcs(domain, target, size.funcs, rng)
    old = target.name

    init = f'"""{domain.topic.capitalize()}."""\n\nfrom {module} import {old}\n\n__all__ = ["{old}"]\n'
    extra_files, extra_tests = distractors(domain.name, package, size, rng)
    users = sorted(rng.sample(sorted(_USERS), min(size.parts, len(_USERS))))
    user_tests = []
    for kind in users:
        doc, body, fn, make_args = _USERS[kind]
        if rng.random() < 0.5:
            head, ref = f"from {module} import {old}", old
        else:
            head, ref = f"from {package} import {domain.module}", f"{domain.module}.{old}"
        extra_files[f"{package}/{kind}.py"] = f'"""{doc}"""\n\n{head}\n\n\n' + body.replace("{ref}", ref)
        user_tests.append(
            TestFile(
                f"tests/test_{kind}.py",
                f"Tests of {package}.{kind}.",
                [Case(f"{package}.{kind}", fn, make_args(target.cases), f"test_{fn}")],
            )
        )
    before = package_files(package, domain, module_source(domain, funcs), extra_files)
    before[f"{package}/__init__.py"] = init
    after = {p: _word(old).sub(new, text) if p.startswith(package + "/") else text for p, text in before.items()}

    core_before = TestFile(f"tests/test_{domain.module}.py", f"Tests of {module}.", module_cases(module, funcs, 2))
    core_after = TestFile(
        core_before.path,
        core_before.doc,
        [Case(c.module, new if c.func == old else c.func, c.args, c.name) for c in core_before.cases],
    )
    hidden = TestFile(
        "tests/test_renamed.py",
        f"The rename of {old} to {new}.",
        [Case(module, new, args, f"test_renamed_{i}") for i, args in enumerate(target.cases)],
        custom=_HIDDEN_TESTS.format(old=old, new=new, module=module, package=package),
        custom_imports=_HIDDEN_IMPORTS.format(module=module),
        custom_status={
            "test_new_name_is_defined": False,
            "test_old_name_is_gone": False,
            "test_no_reference_to_old_name_left": False,
        },
    )
    text = rng.choice(_VAGUE_ASKS if size.vague else _ASKS).format(old=old, new=new, path=path)
    return Draft(
        NAME,
        template,
        text,
        before=before,
        after=after,
        visible=[core_after, *user_tests, *extra_tests],
        hidden=[hidden],
        visible_before=[core_before, *user_tests, *extra_tests],
    )
