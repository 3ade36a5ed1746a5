"""Family `stub`: implement a function from its docstring.

The function's body is `raise NotImplementedError`; its docstring (exact
about edge cases, see domains.py) and one visible test say what it should
do. The hidden tests call it on every case of the domain; the module's other
functions keep passing.
"""

from __future__ import annotations

import ast
import random

from codefleet.tasks.families.base import SIZES, Case, Draft, TestFile
from codefleet.tasks.families.domains import DOMAINS, MORE_DOMAINS, module_source
from codefleet.tasks.families.layout import case_name, distractors, module_cases, package_files, pick_funcs, run_module

NAME = "stub"
TEMPLATES = {
    "inventory": "train",
    "geometry": "train",
    "grades": "train",
    "schedule": "train",
    "shipping": "train",
    "text": "test",
    "bank": "test",
    **{d.name: "train" for d in MORE_DOMAINS},
}

_ASKS = (
    "`{func}` in `{path}` is only a stub: it raises NotImplementedError. Implement it as its docstring describes. "
    "For example `{call}` should return `{want}`.",
    "Please implement `{func}` ({path}). The docstring says what it must do; right now it just raises "
    "NotImplementedError, so `{test}` fails.",
    "We never finished `{func}` in `{path}`. Write the body so that it follows its docstring exactly "
    "(edge cases included), e.g. `{call}` == `{want}`.",
)
_VAGUE_ASKS = (
    "One of our {topic} was never written and raises NotImplementedError: `{func}`. Implement it following its "
    "docstring; `{command}` should pass.",
    "Implement the missing `{func}` function of the {topic}, exactly as its docstring specifies.",
)


def stub_out(source: str, func: str) -> str:
    """`source` with the body of `func` (after its docstring) replaced by `raise NotImplementedError`."""
    tree = ast.parse(source)
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func)
    lines = source.split("\n")
    doc_end = node.body[0].end_lineno  # body[0] is the docstring
    indent = " " * node.body[0].col_offset
    return "\n".join(lines[:doc_end] + [f"{indent}raise NotImplementedError"] + lines[node.end_lineno :])


def draft(template: str, rng: random.Random, difficulty: int) -> Draft:
    domain, size = DOMAINS[template], SIZES[difficulty]
    package = rng.choice(domain.packages)
    module, path = f"{package}.{domain.module}", f"{package}/{domain.module}.py"
    target = rng.choice(domain.funcs)
    funcs = pick_funcs(domain, target, size.funcs, rng)
    correct = module_source(domain, funcs)
    stubbed = stub_out(correct, target.name)

    example = rng.randrange(len(target.cases))
    visible_cases = []
    for f in funcs:
        indices = [example] if f.name == target.name else [0, 1]
        visible_cases += [Case(module, f.name, f.cases[i], case_name(f.name, i)) for i in indices]
    test_path = f"tests/test_{domain.module}.py"
    visible = [TestFile(test_path, f"Tests of {module}.", visible_cases)]
    extra_files, extra_tests = distractors(domain.name, package, size, rng)
    visible += extra_tests
    hidden = [
        TestFile(
            f"tests/test_{domain.module}_spec.py",
            f"Specification tests of {module}.",
            module_cases(module, funcs, None, prefix="test_spec"),
        )
    ]

    ((_, want),) = run_module(correct, target.name, [target.cases[example]])
    call = f"{target.name}({', '.join(repr(a) for a in target.cases[example])})"
    fields = dict(
        func=target.name,
        path=path,
        call=call,
        want=repr(want),
        topic=domain.topic,
        test=f"{test_path}::{case_name(target.name, example)}",
        command="python3 -m pytest -q tests",
    )
    text = rng.choice(_VAGUE_ASKS if size.vague else _ASKS).format(**fields)
    return Draft(
        NAME,
        template,
        text,
        before=package_files(package, domain, stubbed, extra_files),
        after=package_files(package, domain, correct, extra_files),
        visible=visible,
        hidden=hidden,
    )
