"""The domain library: small pure functions the procedural families build repositories from.

A *domain* (inventory, geometry, text, ...) is a module's worth of functions
with exact docstrings (the stub family asks for an implementation from the
docstring alone), argument tuples to test them with (expected values are
computed by running the correct code, never written by hand), and a couple
of natural new names for each function (the rename family). Functions are
pure and loop only over bounded ranges (no `while`), so a mutated copy can
always be executed at generation time.

Each domain is one *template* of the bugfix, stub and rename families; which
split it belongs to is decided in those families, not here. The seven of
`DOMAINS` that came first live in `domains_commerce.py` (inventory, bank,
shipping) and `domains_utilities.py` (geometry, text, grades, schedule);
`more_domains.py` adds training templates (more code to learn from, the
held-out ones unchanged). `domain_types.py` has the two types.
"""

from __future__ import annotations

from codefleet.tasks.families.domain_types import Domain, Func  # noqa: F401 (Func: re-exported)
from codefleet.tasks.families.domains_commerce import BANK, INVENTORY, SHIPPING
from codefleet.tasks.families.domains_utilities import GEOMETRY, GRADES, SCHEDULE, TEXT
from codefleet.tasks.families.more_domains import MORE_DOMAINS

DOMAINS: dict[str, Domain] = {
    d.name: d for d in (INVENTORY, GEOMETRY, TEXT, BANK, GRADES, SCHEDULE, SHIPPING, *MORE_DOMAINS)
}


def module_source(domain: Domain, funcs: list[Func], doc: str | None = None) -> str:
    """A module with `funcs` in the order given, the domain's imports on top."""
    head = f'"""{doc or domain.topic.capitalize()}."""\n'
    if domain.imports:
        head += "\n" + "".join(f"import {name}\n" for name in domain.imports)
    return head + "\n\n" + "\n\n".join(f.source for f in funcs)
