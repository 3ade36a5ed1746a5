"""The shape the project keeps (STYLE.md, "small files with one job"): no file in src/ over 500 lines, and no
function over 80 lines outside `codefleet.bench` (benchmarks are long scripts by nature). A function is measured
from its first decorator or `def` to its last line; a function nested in it counts as part of it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
BENCH = SRC / "codefleet" / "bench"
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _python_files() -> list[Path]:
    return sorted(SRC.rglob("*.py"))


def function_lengths(source: str) -> list[tuple[str, int, int]]:
    """(name, first line, lines) of every function not nested in another function, methods included."""
    out, stack = [], [ast.parse(source)]
    while stack:
        for child in ast.iter_child_nodes(stack.pop()):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                out.append((child.name, first, child.end_lineno - first + 1))
            else:
                stack.append(child)
    return sorted(out, key=lambda f: f[1])


def test_a_function_is_measured_from_its_decorator_to_its_last_line_with_what_it_nests():
    body = "".join(f"        x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    source = (
        f"class A:\n    @staticmethod\n    def long():\n{body}\n\n"
        "def short():\n    def inner():\n        return 1\n\n    return inner()\n"
    )
    assert function_lengths(source) == [("long", 2, MAX_FUNCTION_LINES + 2), ("short", MAX_FUNCTION_LINES + 6, 5)]


def test_no_file_in_src_is_over_500_lines():
    files = _python_files()
    assert len(files) > 100  # the walk found the package
    too_long = [
        f"{p.relative_to(SRC)}: {n} lines"
        for p in files
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_FILE_LINES
    ]
    assert not too_long, "split these files by job:\n  " + "\n  ".join(too_long)


def test_no_function_outside_bench_is_over_80_lines():
    too_long = [
        f"{p.relative_to(SRC)}:{first} {name}: {n} lines"
        for p in _python_files()
        if not p.is_relative_to(BENCH)
        for name, first, n in function_lengths(p.read_text(encoding="utf-8"))
        if n > MAX_FUNCTION_LINES
    ]
    assert not too_long, "split these functions into well-named steps:\n  " + "\n  ".join(too_long)
