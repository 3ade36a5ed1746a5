"""Injected bugs: small source mutations of one function, formatting kept.

A mutation is found on the AST (an operator, a comparison, an `and`/`or`, an
integer constant) but applied as a replacement of the exact characters in
the source, so the rest of the file stays byte-identical and the reference
patch is a one-line diff a human would write. Kinds:

- `operator`: `+` <-> `-`, `*` -> `+`, `//` <-> `/`, `%` -> `//`, and `+=` <-> `-=`
- `comparison`: `<` <-> `<=`, `>` <-> `>=`, `==` <-> `!=`, `in` <-> `not in`
- `boolean`: `and` <-> `or`
- `constant`: an integer n becomes n + 1 or n - 1 (off by one)

Whether a mutation is *visible* (some test case changes) is decided by the
caller, which runs both versions.
"""

from __future__ import annotations

import ast
import itertools
import random
from dataclasses import dataclass

_BINOPS = {
    ast.Add: ("+", "-"),
    ast.Sub: ("-", "+"),
    ast.Mult: ("*", "+"),
    ast.FloorDiv: ("//", "/"),
    ast.Div: ("/", "//"),
    ast.Mod: ("%", "//"),
}
_CMPOPS = {
    ast.Lt: ("<", "<="),
    ast.LtE: ("<=", "<"),
    ast.Gt: (">", ">="),
    ast.GtE: (">=", ">"),
    ast.Eq: ("==", "!="),
    ast.NotEq: ("!=", "=="),
    ast.In: ("in", "not in"),
    ast.NotIn: ("not in", "in"),
}
_BOOLOPS = {ast.And: ("and", "or"), ast.Or: ("or", "and")}


@dataclass(frozen=True)
class Mutation:
    func: str
    kind: str  # "operator" | "comparison" | "boolean" | "constant"
    start: int  # character offsets in the module source
    end: int
    old: str
    new: str

    def apply(self, source: str) -> str:
        assert source[self.start : self.end] == self.old, "mutation does not match the source"
        return source[: self.start] + self.new + source[self.end :]


def _offsets(source: str) -> list[int]:
    starts = [0]
    for line in source.split("\n"):
        starts.append(starts[-1] + len(line) + 1)
    return starts


def _find_token(source: str, start: int, end: int, token: str) -> int | None:
    """Offset of `token` in source[start:end], which must hold only it, spaces and parentheses."""
    gap = source[start:end]
    stripped = gap.replace("(", " ").replace(")", " ").split()
    if " ".join(stripped) != token:
        return None
    return start + gap.index(token.split()[0])


def mutations(source: str, func_name: str) -> list[Mutation]:
    """Every mutation of the body of `func_name` (docstring excluded), in source order."""
    if not source.isascii():
        raise ValueError("mutations() needs ASCII source (AST offsets are in bytes)")
    tree = ast.parse(source)
    func = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == func_name)
    line_start = _offsets(source)

    def pos(line: int, col: int) -> int:
        return line_start[line - 1] + col

    body = (
        func.body[1:]
        if (func.body and isinstance(func.body[0], ast.Expr) and isinstance(func.body[0].value, ast.Constant))
        else func.body
    )
    inside_fstring: set[int] = set()
    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.JoinedStr):
                inside_fstring.update(id(n) for n in ast.walk(node) if isinstance(n, ast.Constant))
    found: list[Mutation] = []

    def between(left: ast.AST, right: ast.AST, symbols: tuple[str, str], kind: str) -> None:
        a, b = pos(left.end_lineno, left.end_col_offset), pos(right.lineno, right.col_offset)
        at = _find_token(source, a, b, symbols[0])
        if at is not None:
            found.append(Mutation(func_name, kind, at, at + len(symbols[0]), symbols[0], symbols[1]))

    for stmt in body:
        for node in ast.walk(stmt):
            if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
                between(node.left, node.right, _BINOPS[type(node.op)], "operator")
            elif isinstance(node, ast.AugAssign) and type(node.op) in (ast.Add, ast.Sub):
                old = "+=" if isinstance(node.op, ast.Add) else "-="
                between(node.target, node.value, (old, "-=" if old == "+=" else "+="), "operator")
            elif isinstance(node, ast.Compare):
                operands = [node.left, *node.comparators]
                for op, (left, right) in zip(node.ops, itertools.pairwise(operands), strict=True):
                    if type(op) in _CMPOPS:
                        between(left, right, _CMPOPS[type(op)], "comparison")
            elif isinstance(node, ast.BoolOp) and type(node.op) in _BOOLOPS:
                for left, right in itertools.pairwise(node.values):
                    between(left, right, _BOOLOPS[type(node.op)], "boolean")
            elif isinstance(node, ast.Constant) and type(node.value) is int and id(node) not in inside_fstring:
                a, b = pos(node.lineno, node.col_offset), pos(node.end_lineno, node.end_col_offset)
                text = source[a:b]
                if text.isdigit():
                    found.append(Mutation(func_name, "constant", a, b, text, str(node.value + 1)))
                    if node.value > 1:
                        found.append(Mutation(func_name, "constant", a, b, text, str(node.value - 1)))
    return sorted(found, key=lambda m: (m.start, m.new))


def shuffled_mutations(source: str, func_name: str, rng: random.Random) -> list[Mutation]:
    found = mutations(source, func_name)
    rng.shuffle(found)
    return found
