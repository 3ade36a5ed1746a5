"""More training templates for the bugfix, stub and rename families: recipes, weather, library, parking,
fitness and tickets (the rules are in domains.py). The held-out templates stay those of domains.py.

The six live in `more_domains_measures.py` (recipes, weather, fitness) and `more_domains_bookings.py`
(library, parking, tickets); `MORE_DOMAINS` keeps the order they were added in."""

from __future__ import annotations

from codefleet.tasks.families.domain_types import Domain
from codefleet.tasks.families.more_domains_bookings import LIBRARY, PARKING, TICKETS
from codefleet.tasks.families.more_domains_measures import FITNESS, RECIPES, WEATHER

MORE_DOMAINS: tuple[Domain, ...] = (RECIPES, WEATHER, LIBRARY, PARKING, FITNESS, TICKETS)
