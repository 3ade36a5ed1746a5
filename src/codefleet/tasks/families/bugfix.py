"""Family `bugfix`: fix a bug injected into one function by a mutation.

The repository is a domain module with one mutated function (an operator,
comparison, boolean or off-by-one change; see mutate.py) and its tests; one
visible test fails and shows the symptom. Only mutations that change the
result of at least one test case are used. The instruction reads like a bug
report: the call, what it returns, what it should return. At difficulty 3
it names neither the file nor the failing test.
"""

from __future__ import annotations

import random

from codefleet.tasks.families.base import SIZES, Case, Draft, DraftError, TestFile
from codefleet.tasks.families.domains import DOMAINS, MORE_DOMAINS, Func, module_source
from codefleet.tasks.families.layout import (
    case_name,
    describe,
    distractors,
    module_cases,
    package_files,
    pick_funcs,
    run_module,
)
from codefleet.tasks.families.mutate import Mutation, shuffled_mutations

NAME = "bugfix"
TEMPLATES = {
    "inventory": "train",
    "geometry": "train",
    "text": "train",
    "bank": "train",
    "grades": "train",
    "schedule": "test",
    "shipping": "test",
    **{d.name: "train" for d in MORE_DOMAINS},
}

_REPORTS = (
    "`{func}` in `{path}` gives a wrong result: `{call}` {got}, but it should return `{want}`. "
    "The test `{test}` shows the problem. Please fix the bug in the code; the tests are right.",
    "Bug report: calling `{call}` {got}. The expected result is `{want}` (see the failing test `{test}`). "
    "The function lives in `{path}`. Fix it without changing the tests.",
    "There is a bug in `{path}`: `{call}` should be `{want}` but {got_plain}. `{test}` fails because of it. "
    "Please find and fix it.",
)
_VAGUE_REPORTS = (
    "Our {topic} give wrong answers: `{call}` {got} instead of `{want}`. Find the bug and fix it; "
    "`{command}` should pass afterwards.",
    "Something is off in the {topic}: `{call}` should return `{want}`, yet it {got_plain}. Please track the "
    "bug down and fix it.",
)


def _find_bug(module_text: str, target: Func, rng: random.Random) -> tuple[Mutation, str, list[int]] | None:
    """A mutation of `target` that changes at least one of its cases: (mutation, broken text, changed case indices)."""
    right = run_module(module_text, target.name, list(target.cases))
    for mutation in shuffled_mutations(module_text, target.name, rng):
        broken = mutation.apply(module_text)
        wrong = run_module(broken, target.name, list(target.cases))
        changed = [i for i, (a, b) in enumerate(zip(right, wrong)) if a != b]
        if changed:
            return mutation, broken, changed
    return None


def draft(template: str, rng: random.Random, difficulty: int) -> Draft:
    domain, size = DOMAINS[template], SIZES[difficulty]
    package = rng.choice(domain.packages)
    module = f"{package}.{domain.module}"
    path = f"{package}/{domain.module}.py"
    targets = list(domain.funcs)
    rng.shuffle(targets)
    for target in targets:
        funcs = pick_funcs(domain, target, size.funcs, rng)
        correct = module_source(domain, funcs)
        found = _find_bug(correct, target, rng)
        if found:
            break
    else:
        raise DraftError(f"bugfix/{template}: no mutation changes a test result")
    mutation, broken, changed = found
    symptom = changed[0]
    right = run_module(correct, target.name, [target.cases[symptom]])[0]
    wrong = run_module(broken, target.name, [target.cases[symptom]])[0]

    visible_cases = []
    for f in funcs:  # two cases per function; for the buggy one the symptom and a case that still passes
        passing = next((i for i in range(len(f.cases)) if i not in changed), symptom)
        indices = [0, 1] if f.name != target.name else sorted({symptom, passing})
        visible_cases += [Case(module, f.name, f.cases[i], case_name(f.name, i)) for i in indices]
    test_path = f"tests/test_{domain.module}.py"
    visible = [TestFile(test_path, f"Tests of {module}.", visible_cases)]
    extra_files, extra_tests = distractors(domain.name, package, size, rng)
    visible += extra_tests
    hidden = [
        TestFile(
            f"tests/test_{domain.module}_behaviour.py",
            f"More tests of {module}.",
            module_cases(module, funcs, None, prefix="test_case"),
        )
    ]

    call = f"{target.name}({', '.join(repr(a) for a in target.cases[symptom])})"
    fields = dict(
        func=target.name,
        path=path,
        call=call,
        want=repr(right[1]),
        got=describe(wrong),
        got_plain=describe(wrong).replace("`", ""),
        test=f"{test_path}::{case_name(target.name, symptom)}",
        topic=domain.topic,
        command="python3 -m pytest -q tests",
    )
    text = rng.choice(_VAGUE_REPORTS if size.vague else _REPORTS).format(**fields)
    return Draft(
        NAME,
        template,
        text,
        before=package_files(package, domain, broken, extra_files),
        after=package_files(package, domain, correct, extra_files),
        visible=visible,
        hidden=hidden,
    )
