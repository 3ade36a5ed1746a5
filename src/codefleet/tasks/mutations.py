"""Mutations of Python functions for mined tasks (`tasks.mine`): one small, real bug per mutant.

    for name, mutations in file_mutations(source_bytes, "pkg/stats.py", "pkg.stats").items():
        mutant_source = mutations[0].apply(source_bytes)

Each mutation is ONE edit at the exact source span of an `ast` node (its line and column offsets), so the rest
of the file stays byte-identical and the reference patch is a one-line diff. The kinds (KINDS) are documented
in docs/tasks.md, "Mined tasks". A mutant that does not parse or leaves the AST unchanged is not offered.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

KINDS = (
    "comparison",
    "arithmetic",
    "off_by_one",
    "negated_condition",
    "dropped_statement",
    "default_argument",
    "swapped_arguments",
)
_COMPARE_SWAPS = {ast.Lt: "<=", ast.LtE: "<", ast.Gt: ">=", ast.GtE: ">", ast.Eq: "!=", ast.NotEq: "=="}
_COMPARE_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!="}
_ARITH_SWAPS = {ast.Add: "-", ast.Sub: "+", ast.Mult: "//", ast.FloorDiv: "*", ast.Div: "*"}
_ARITH_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Div: "/"}
_ATOMS = (ast.Name, ast.Attribute, ast.Call, ast.Subscript, ast.Constant, ast.Compare)


@dataclass(frozen=True)
class Mutation:
    """One edit of a file's UTF-8 bytes: replace [start, end) with `text`."""

    kind: str
    path: str  # relative to the source root
    function: str  # module.qualname
    start: int
    end: int
    text: str

    def apply(self, source: bytes) -> str:
        return (source[: self.start] + self.text.encode() + source[self.end :]).decode("utf-8")


class _Spans:
    """Byte offsets of ast positions (col_offset counts UTF-8 bytes)."""

    def __init__(self, source: bytes):
        self.source = source
        self.line_starts = [0]
        for line in source.splitlines(keepends=True):
            self.line_starts.append(self.line_starts[-1] + len(line))

    def start(self, node: ast.AST) -> int:
        return self.line_starts[node.lineno - 1] + node.col_offset

    def end(self, node: ast.AST) -> int:
        return self.line_starts[node.end_lineno - 1] + node.end_col_offset

    def text(self, node: ast.AST) -> str:
        return self.source[self.start(node) : self.end(node)].decode("utf-8")

    def operator(self, left: ast.AST, right: ast.AST, symbol: str) -> tuple[int, int] | None:
        """The span of `symbol` between two operands, if the gap holds nothing else (no comments, no parens)."""
        gap = self.source[self.end(left) : self.start(right)].decode("utf-8")
        if gap.strip() != symbol:
            return None
        at = self.end(left) + gap.index(symbol)
        return at, at + len(symbol)


def _paren(node: ast.AST, text: str) -> str:
    return text if isinstance(node, _ATOMS) else f"({text})"


def _int_const(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) is int


def _body_nodes(function: ast.AST):
    """Nodes of a function's body, not descending into nested functions or classes (mined on their own)."""
    stack = list(reversed(function.body))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _whole_lines(spans: _Spans, stmt: ast.stmt) -> tuple[int, int] | None:
    """The byte span of the full lines a statement occupies, if it shares them with nothing else."""
    first, last = spans.line_starts[stmt.lineno - 1], spans.line_starts[stmt.end_lineno]
    before = spans.source[first : spans.start(stmt)]
    after = spans.source[spans.end(stmt) : last].strip()
    if before.strip() or (after and not after.startswith(b"#")):
        return None
    return first, last


def _droppable(spans: _Spans, body: object) -> list[tuple[int, int]]:
    """Line spans of the statements of a block of two or more that may go: not a return, a docstring, a
    definition or a declaration."""
    if not isinstance(body, list) or len(body) < 2 or not isinstance(body[0], ast.stmt):
        return []
    spans_found = []
    for stmt in body:
        docstring = isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant)
        if docstring or isinstance(
            stmt, (ast.Return, ast.Pass, ast.Global, ast.Nonlocal, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ):
            continue
        span = _whole_lines(spans, stmt)
        if span:
            spans_found.append(span)
    return spans_found


def _function_mutations(spans: _Spans, function: ast.FunctionDef, path: str, name: str) -> list[Mutation]:
    found: list[Mutation] = []

    def add(kind: str, start: int, end: int, text: str) -> None:
        found.append(Mutation(kind, path, name, start, end, text))

    for default in function.args.defaults + [d for d in function.args.kw_defaults if d is not None]:
        if isinstance(default, ast.Constant) and type(default.value) in (int, float, bool):
            value = default.value
            new = repr(not value) if isinstance(value, bool) else repr(value + 1)
            add("default_argument", spans.start(default), spans.end(default), new)
    for node in _body_nodes(function):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for i, op in enumerate(node.ops):
                if type(op) in _COMPARE_SWAPS:
                    span = spans.operator(operands[i], operands[i + 1], _COMPARE_TEXT[type(op)])
                    if span:
                        add("comparison", *span, _COMPARE_SWAPS[type(op)])
        elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in _ARITH_SWAPS:
            left, right = (node.left, node.right) if isinstance(node, ast.BinOp) else (node.target, node.value)
            if any(
                isinstance(s, (ast.JoinedStr, ast.List, ast.Tuple))
                or (isinstance(s, ast.Constant) and isinstance(s.value, (str, bytes)))
                for s in (left, right)
            ):
                continue  # "a" + "b" -> "a" - "b" is a crash, not a bug anyone writes
            symbol = _ARITH_TEXT[type(node.op)] + ("=" if isinstance(node, ast.AugAssign) else "")
            span = spans.operator(left, right, symbol)
            if span:
                add("arithmetic", *span, symbol.replace(_ARITH_TEXT[type(node.op)], _ARITH_SWAPS[type(node.op)]))
        elif _int_const(node) and node.value >= 0:
            add(
                "off_by_one",
                spans.start(node),
                spans.end(node),
                str(node.value + 1 if node.value < 2 else node.value - 1),
            )
        elif isinstance(node, (ast.If, ast.While, ast.IfExp)):
            test = node.test
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                new = _paren(test.operand, spans.text(test.operand))
            else:
                new = "not " + _paren(test, spans.text(test))
            add("negated_condition", spans.start(test), spans.end(test), new)
        if isinstance(node, ast.Call):
            if isinstance(node.func, ast.Name) and node.func.id == "range" and node.args and not node.keywords:
                stop = node.args[0] if len(node.args) == 1 else node.args[1]
                if not _int_const(stop):
                    add("off_by_one", spans.start(stop), spans.end(stop), f"{_paren(stop, spans.text(stop))} - 1")
            args = node.args
            for a, b in zip(args, args[1:]):
                if isinstance(a, ast.Starred) or isinstance(b, ast.Starred) or spans.text(a) == spans.text(b):
                    continue
                gap = spans.source[spans.end(a) : spans.start(b)].decode("utf-8")
                add("swapped_arguments", spans.start(a), spans.end(b), spans.text(b) + gap + spans.text(a))
        for body_name in ("body", "orelse", "finalbody"):
            for start, end in _droppable(spans, getattr(node, body_name, None)):
                add("dropped_statement", start, end, "")
    for start, end in _droppable(spans, function.body):
        add("dropped_statement", start, end, "")
    return found


def _functions(tree: ast.Module, prefix: str = ""):
    """(qualname, node) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node
            yield from _functions(node, f"{prefix}{node.name}.<locals>.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")


def file_mutations(source: bytes, path: str, module: str) -> dict[str, list[Mutation]]:
    """Every valid, AST-changing single-edit mutant of a file, per function (`module.qualname`)."""
    tree = ast.parse(source)
    original = ast.dump(tree)
    spans = _Spans(source)
    per_function: dict[str, list[Mutation]] = {}
    for qualname, node in _functions(tree):
        name = f"{module}.{qualname}"
        kept, seen = [], set()
        for mutation in _function_mutations(spans, node, path, name):
            if (mutation.start, mutation.end, mutation.text) in seen:
                continue
            seen.add((mutation.start, mutation.end, mutation.text))
            try:
                changed = ast.dump(ast.parse(mutation.apply(source))) != original
            except (SyntaxError, ValueError):  # e.g. a dropped statement that leaves an empty block
                continue
            if changed:
                kept.append(mutation)
        per_function[name] = kept
    return per_function
