"""The types of the domain library (`domains.py`, `more_domains.py` and the modules they gather): a function and
a domain of them."""

from __future__ import annotations

import ast
import textwrap
from dataclasses import dataclass


@dataclass(frozen=True)
class Func:
    name: str
    source: str  # the whole `def`, docstring included, no indentation
    cases: tuple[tuple, ...]  # argument tuples
    aliases: tuple[str, ...]  # natural new names for the rename family


@dataclass(frozen=True)
class Domain:
    name: str  # the template name
    packages: tuple[str, ...]  # package name choices (never a stdlib module name)
    module: str  # module holding the functions
    topic: str  # for prose: "stock-keeping helpers"
    imports: tuple[str, ...]
    funcs: tuple[Func, ...]

    def func(self, name: str) -> Func:
        return next(f for f in self.funcs if f.name == name)


def make_func(source: str, cases: list[tuple], aliases: tuple[str, ...]) -> Func:
    source = textwrap.dedent(source).strip() + "\n"
    name = ast.parse(source).body[0].name
    return Func(name, source, tuple(cases), aliases)
