"""Building blocks of the domain-based repositories (bugfix, stub, rename).

A repository is one package: the module the task is about (a subset of a
domain's functions; the difficulty says how many), optional distractor
modules taken from other domains with their own passing tests, and a
tests/ folder. `run_module` executes a single module's source in memory —
fast enough to try many mutations — while `base.finish` later imports the
whole package for real.
"""

from __future__ import annotations

import random

from codefleet.tasks.families.base import Case, Size, TestFile, outcome, project_files
from codefleet.tasks.families.domains import DOMAINS, Domain, Func, module_source


def pick_funcs(domain: Domain, target: Func, n: int, rng: random.Random) -> list[Func]:
    """`n` functions of the domain including `target`, in the domain's order."""
    others = [f for f in domain.funcs if f.name != target.name]
    chosen = {target.name} | {f.name for f in rng.sample(others, min(max(n - 1, 0), len(others)))}
    return [f for f in domain.funcs if f.name in chosen]


def run_module(source: str, func: str, args_list: list[tuple]) -> list[tuple[str, object]]:
    """Outcomes of `func(*args)` for each args, the module executed in memory."""
    namespace: dict = {"__name__": "codefleet_generated"}
    try:
        exec(compile(source, "<generated>", "exec"), namespace)
    except Exception as e:
        return [("raise", type(e).__name__)] * len(args_list)
    return [outcome(namespace[func], args) for args in args_list]


def describe(result: tuple[str, object]) -> str:
    status, value = result
    return f"raises {value}" if status == "raise" else f"returns `{value!r}`"


def case_name(func: str, index: int, prefix: str = "test") -> str:
    return f"{prefix}_{func}_{index}"


def module_cases(module: str, funcs: list[Func], per_func: int | None, prefix: str = "test") -> list[Case]:
    """Cases for `funcs`: the first `per_func` argument tuples of each (all if None)."""
    cases = []
    for f in funcs:
        for i, args in enumerate(f.cases[:per_func] if per_func else f.cases):
            cases.append(Case(module, f.name, args, case_name(f.name, i, prefix)))
    return cases


def distractors(
    exclude: str | None, package: str, size: Size, rng: random.Random
) -> tuple[dict[str, str], list[TestFile]]:
    """`size.distractors` modules from domains other than `exclude`, 3 functions each, with visible tests."""
    others = sorted(name for name in DOMAINS if name != exclude)
    files: dict[str, str] = {}
    tests: list[TestFile] = []
    for name in rng.sample(others, min(size.distractors, len(others))):
        other = DOMAINS[name]
        funcs = [f for f in other.funcs if f.name in {g.name for g in rng.sample(list(other.funcs), 3)}]
        files[f"{package}/{other.module}.py"] = module_source(other, funcs)
        tests.append(
            TestFile(
                f"tests/test_{other.module}.py",
                f"Tests of {package}.{other.module}.",
                module_cases(f"{package}.{other.module}", funcs, 2),
            )
        )
    return files, tests


def package_files(
    package: str, domain: Domain, module_text: str, extra: dict[str, str] | None = None
) -> dict[str, str]:
    """pyproject, README, the package's __init__ and the main module."""
    files = project_files(package, domain.topic)
    files[f"{package}/__init__.py"] = f'"""{domain.topic.capitalize()}."""\n'
    files[f"{package}/{domain.module}.py"] = module_text
    files.update(extra or {})
    return files
