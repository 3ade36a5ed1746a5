"""More training templates for the bugfix, stub and rename families (see domains.py for the rules)."""

from __future__ import annotations

from codefleet.tasks.families.domain_types import Domain

MORE_DOMAINS: tuple[Domain, ...] = ()
