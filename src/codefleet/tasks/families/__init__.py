"""Bundled procedural task families, deterministic by seed.

- `bugfix`: fix a bug injected by a mutation; a failing test shows it
  (5 domains for train, 2 held-out domains for test)
- `stub`: implement a function from its docstring (5 / 2 domains)
- `rename`: rename a function and every use across files (5 / 2 domains)
- `config`: change defaults asked for in prose (constants, JSON, dataclass / INI)
- `multifile`: read several files — a bug behind another module, or a figure
  summed over many modules (checkout, warehouse / payroll, power)

A *template* (a domain or code shape) belongs to exactly one split, so the
test split holds out code the train split never shows, not just new seeds.
Each family module has `NAME`, `TEMPLATES` ({template: split}) and
`draft(template, rng, difficulty) -> Draft`; `base.finish` turns a draft
into files and hidden checks, and `codefleet.tasks.generate` into tasks.
"""

from __future__ import annotations

from types import ModuleType

from codefleet.tasks.families import bugfix, config, multifile, rename, stub
from codefleet.tasks.families.more_domains import MORE_DOMAINS

FAMILIES: dict[str, ModuleType] = {m.NAME: m for m in (bugfix, stub, rename, config, multifile)}
SPLITS = ("train", "test")
MORE_TEMPLATES = frozenset(d.name for d in MORE_DOMAINS)  # the six training domains of more_domains.py


def templates(family: str, split: str = "all", more_domains: bool = True) -> list[str]:
    """Templates of `family` in `split` ("train", "test" or "all"), sorted; without those of more_domains.py
    (`MORE_TEMPLATES`) when `more_domains` is False."""
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; choose from {', '.join(FAMILIES)}")
    if split not in (*SPLITS, "all"):
        raise ValueError(f"unknown split {split!r}; choose train, test or all")
    return sorted(
        t
        for t, s in FAMILIES[family].TEMPLATES.items()
        if (split == "all" or s == split) and (more_domains or t not in MORE_TEMPLATES)
    )


__all__ = ["FAMILIES", "MORE_TEMPLATES", "SPLITS", "templates"]
