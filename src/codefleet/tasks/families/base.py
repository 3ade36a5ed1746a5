"""What every procedural family shares: test cases, running them, rendering
test files, and turning a family's draft into hidden checks.

A family builds the repository *before* (what the agent gets) and *after*
(the solution) as `{path: text}` dicts, plus visible and hidden test files
made of `Case`s. Expected values are never written by hand: `finish` imports
the *after* package for real (from a temporary directory) and calls the
functions; then it runs the same cases against the *before* package to sort
every test into fail_to_pass and pass_to_pass. A test file that imports a
name the before-package lacks fails as a whole, as it does under pytest.
`tasks check` later proves the same thing inside a sandbox.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import os
import sys
import tempfile
from dataclasses import dataclass, field

CHECK_COMMAND = "python3 -m pytest -q -p no:cacheprovider {tests}"
TEST_COMMAND = "python3 -m pytest -q tests"
DIFFICULTIES = (1, 2, 3)


@dataclass(frozen=True)
class Size:
    """What the difficulty knob changes."""

    funcs: int  # functions in the module the task is about
    distractors: int  # unrelated modules (with their own passing tests)
    parts: int  # modules a multi-file or rename task spreads over
    vague: bool  # the instruction names the symptom only, not the file


SIZES = {
    1: Size(funcs=3, distractors=0, parts=2, vague=False),
    2: Size(funcs=4, distractors=1, parts=3, vague=False),
    3: Size(funcs=6, distractors=3, parts=5, vague=True),
}


@dataclass(frozen=True)
class Case:
    """One test: `module.func(*args)[select...]` must equal what the solution returns."""

    module: str  # dotted, e.g. "stockroom.stock"
    func: str
    args: tuple
    name: str  # test function name
    select: tuple = ()  # keys/indices into the result, e.g. ("timeout_s",)

    def text(self) -> str:
        return f"{self.func}({', '.join(repr(a) for a in self.args)})" + "".join(f"[{k!r}]" for k in self.select)


@dataclass
class TestFile:
    path: str  # e.g. "tests/test_stock.py"
    doc: str
    cases: list[Case] = field(default_factory=list)
    custom: str = ""  # hand-written tests appended verbatim
    custom_imports: str = ""  # their imports, placed with the others
    custom_status: dict[str, bool] = field(default_factory=dict)  # custom test name -> passes before the fix

    def ids(self) -> list[str]:
        return [f"{self.path}::{c.name}" for c in self.cases] + [f"{self.path}::{n}" for n in self.custom_status]


@dataclass
class Draft:
    """A family's raw task; `finish` makes expected values and checks from it."""

    family: str
    template: str
    instruction: str
    before: dict[str, str]  # package + data files the agent gets (tests added by finish)
    after: dict[str, str]  # the same after the fix
    visible: list[TestFile]  # test files in the repo (as they should read after the fix)
    hidden: list[TestFile]  # test files written only at check time
    visible_before: list[TestFile] | None = None  # when the fix changes visible tests too (rename)


@dataclass
class Finished:
    files_before: dict[str, str]
    files_after: dict[str, str]
    check_files: dict[str, str]
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    expected: dict[tuple[str, str], object]  # (test path, case name) -> value


# -- running cases --------------------------------------------------------------------


@contextlib.contextmanager
def importable(files: dict[str, str]):
    """The files written to a temporary directory that is first on sys.path;
    the packages imported from it are forgotten afterwards."""
    before = set(sys.modules)
    with tempfile.TemporaryDirectory(prefix="codefleet-gen-") as root:
        for path, text in files.items():
            full = os.path.join(root, path)
            os.makedirs(os.path.dirname(full), exist_ok=True)
            with open(full, "w", encoding="utf-8") as f:
                f.write(text)
        sys.path.insert(0, root)
        dont_write = sys.dont_write_bytecode
        sys.dont_write_bytecode = True
        importlib.invalidate_caches()
        try:
            yield root
        finally:
            sys.dont_write_bytecode = dont_write
            sys.path.remove(root)
            for name in set(sys.modules) - before:
                module = sys.modules.get(name)
                places = [getattr(module, "__file__", None) or "", *(getattr(module, "__path__", None) or [])]
                if any(str(place).startswith(root) for place in places):
                    del sys.modules[name]


def outcome(fn, args: tuple, select: tuple = ()) -> tuple[str, object]:
    try:
        value = fn(*copy.deepcopy(args))
        for key in select:
            value = value[key]
        return ("ok", value)
    except Exception as e:  # a mutated function may raise anything
        return ("raise", type(e).__name__)


def run_cases(files: dict[str, str], test_files: list[TestFile]) -> dict[tuple[str, str], tuple[str, object]]:
    """{(test path, case name): ("ok", value) | ("raise", exception name)} for every case."""
    results: dict[tuple[str, str], tuple[str, object]] = {}
    with importable(files):
        for tf in test_files:
            fns = {}
            try:
                for case in tf.cases:
                    fns[(case.module, case.func)] = getattr(importlib.import_module(case.module), case.func)
            except Exception as e:  # the whole file fails to import under pytest
                for case in tf.cases:
                    results[(tf.path, case.name)] = ("raise", type(e).__name__)
                continue
            for case in tf.cases:
                results[(tf.path, case.name)] = outcome(fns[(case.module, case.func)], case.args, case.select)
    return results


# -- rendering ------------------------------------------------------------------------


def render_test_file(tf: TestFile, expected: dict[tuple[str, str], object]) -> str:
    """The test file: imports, one test function per case, then the custom tests.
    A function name imported from two modules is called through its module."""
    modules_of: dict[str, set[str]] = {}
    for case in tf.cases:
        modules_of.setdefault(case.func, set()).add(case.module)
    by_name: dict[str, list[str]] = {}  # module -> names imported from it
    by_module: set[str] = set()  # modules imported whole (from parent import leaf)
    for case in tf.cases:
        if len(modules_of[case.func]) > 1:
            by_module.add(case.module)
        elif case.func not in by_name.setdefault(case.module, []):
            by_name[case.module].append(case.func)
    import_lines = [tf.custom_imports.strip("\n")] if tf.custom_imports else []
    import_lines += [f"from {m} import {', '.join(names)}" for m, names in sorted(by_name.items()) if names]
    import_lines += [f"from {m.rpartition('.')[0]} import {m.rpartition('.')[2]}" for m in sorted(by_module)]
    blocks = []
    for case in tf.cases:
        value = expected[(tf.path, case.name)]
        op = "is" if isinstance(value, bool) or value is None else "=="
        call = case.text() if case.module not in by_module else f"{case.module.rpartition('.')[2]}.{case.text()}"
        blocks.append(f"def {case.name}():\n    assert {call} {op} {value!r}\n")
    if tf.custom:
        blocks.append(tf.custom.strip("\n") + "\n")
    head = f'"""{tf.doc}"""\n\n' + "\n".join(import_lines) + "\n"
    return head + "".join("\n\n" + block for block in blocks)


def project_files(package: str, description: str) -> dict[str, str]:
    """pyproject.toml (pytest finds the package from the repo root) and README.md."""
    pyproject = (
        f'[project]\nname = "{package.replace("_", "-")}"\nversion = "0.1.0"\nrequires-python = ">=3.8"\n\n'
        '[tool.pytest.ini_options]\ntestpaths = ["tests"]\npythonpath = ["."]\n'
    )
    readme = f"# {package}\n\n{description[:1].upper() + description[1:]}.\n\nRun the tests with `{TEST_COMMAND}`.\n"
    return {"pyproject.toml": pyproject, "README.md": readme}


# -- finishing --------------------------------------------------------------------------


class DraftError(RuntimeError):
    """A family produced an inconsistent draft (a bug in the family, not in the seed)."""


def finish(draft: Draft) -> Finished:
    """Expected values from the solution, then fail_to_pass / pass_to_pass from the broken repo."""
    visible_before = draft.visible_before if draft.visible_before is not None else draft.visible
    checked = draft.visible + draft.hidden
    solution = run_cases(draft.after, checked)
    expected: dict[tuple[str, str], object] = {}
    for key, (status, value) in solution.items():
        if status != "ok":
            raise DraftError(f"{draft.family}/{draft.template}: the solution raises {value} in {key}")
        expected[key] = value
    broken = run_cases(draft.before, checked)
    fail_to_pass, pass_to_pass = [], []
    for tf in checked:
        for case in tf.cases:
            key = (tf.path, case.name)
            ok = broken[key] == ("ok", expected[key])
            (pass_to_pass if ok else fail_to_pass).append(f"{tf.path}::{case.name}")
        for name, passes_before in tf.custom_status.items():
            (pass_to_pass if passes_before else fail_to_pass).append(f"{tf.path}::{name}")
    if not fail_to_pass:
        raise DraftError(f"{draft.family}/{draft.template}: no test fails before the fix")
    files_before = dict(draft.before)
    missing = [(tf.path, c.name) for tf in visible_before for c in tf.cases if (tf.path, c.name) not in expected]
    if missing:
        raise DraftError(
            f"{draft.family}/{draft.template}: visible tests before the fix need expected values "
            f"of tests checked after it, by the same name: {missing[:3]}"
        )
    files_before.update({tf.path: render_test_file(tf, expected) for tf in visible_before})
    files_after = dict(draft.after)
    files_after.update({tf.path: render_test_file(tf, expected) for tf in draft.visible})
    check_files = {tf.path: render_test_file(tf, expected) for tf in checked}
    return Finished(files_before, files_after, check_files, fail_to_pass, pass_to_pass, expected)
