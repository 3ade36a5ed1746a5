"""Multi-file shape A: the symptom is in one module, the cause in another.

A top-level function (`checkout.total_cents`, `payslip.net_pay`) composes
helpers that live in four other modules. A mutation goes into one of the
helpers; the bug report and the failing visible test only show the
top-level result, so the agent has to read the helpers (several files at
once pays off) to find which one contradicts its docstring.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass

from codefleet.tasks.families.base import Case, TestFile, importable, outcome

_CHECKOUT = {
    "catalog.py": '''"""Prices of everything we sell."""

PRICES_CENTS = {"apple": 50, "pear": 65, "melon": 300, "bread": 220, "cheese": 480}


def price_of(item):
    """Unit price of `item` in cents."""
    return PRICES_CENTS[item]
''',
    "cart.py": '''"""Cart arithmetic."""

from {package}.catalog import price_of


def subtotal_cents(lines):
    """Sum of unit price x quantity over the cart's (item, quantity) lines."""
    return sum(price_of(item) * quantity for item, quantity in lines)
''',
    "discounts.py": '''"""Discount codes."""


def discount_cents(subtotal_cents, code):
    """Discount for `code` on a subtotal.

    SAVE10 takes 10 percent off (rounded down). HALFOFF takes half off
    (rounded down), but only for subtotals of 2000 cents or more. Any other
    code gives no discount.
    """
    if code == "SAVE10":
        return subtotal_cents * 10 // 100
    if code == "HALFOFF" and subtotal_cents >= 2000:
        return subtotal_cents // 2
    return 0
''',
    "tax.py": '''"""Sales tax by region."""

TAX_PERCENT = {"north": 8, "south": 5, "east": 0}
DEFAULT_TAX_PERCENT = 10


def tax_cents(amount_cents, region):
    """Tax on `amount_cents`: the region's percentage (DEFAULT_TAX_PERCENT for other regions), rounded down."""
    return amount_cents * TAX_PERCENT.get(region, DEFAULT_TAX_PERCENT) // 100
''',
    "shipping.py": '''"""Shipping charges."""

FREE_SHIPPING_FROM_CENTS = 5000
FLAT_SHIPPING_CENTS = 499


def shipping_cents(amount_cents):
    """Free from FREE_SHIPPING_FROM_CENTS up; FLAT_SHIPPING_CENTS below that."""
    if amount_cents >= FREE_SHIPPING_FROM_CENTS:
        return 0
    return FLAT_SHIPPING_CENTS
''',
    "checkout.py": '''"""What a customer pays."""

from {package}.cart import subtotal_cents
from {package}.discounts import discount_cents
from {package}.shipping import shipping_cents
from {package}.tax import tax_cents


def total_cents(lines, region, code=""):
    """Subtotal minus the discount, plus tax on that amount, plus shipping for it."""
    subtotal = subtotal_cents(lines)
    discounted = subtotal - discount_cents(subtotal, code)
    return discounted + tax_cents(discounted, region) + shipping_cents(discounted)
''',
}

_PAYROLL = {
    "rates.py": '''"""Hourly rates by pay grade."""

HOURLY_RATE_CENTS = {"junior": 1800, "senior": 2600, "lead": 3400}


def hourly_rate(grade):
    """Hourly rate in cents of a pay grade."""
    return HOURLY_RATE_CENTS[grade]
''',
    "hours.py": '''"""Working time rules."""

STANDARD_WEEK_H = 40


def split_hours(hours):
    """(regular, overtime): hours up to STANDARD_WEEK_H are regular, the rest are overtime."""
    regular = min(hours, STANDARD_WEEK_H)
    overtime = max(0, hours - STANDARD_WEEK_H)
    return regular, overtime
''',
    "overtime.py": '''"""Overtime pay."""

OVERTIME_PERCENT = 150


def overtime_pay(hours, rate_cents):
    """Pay for overtime hours: OVERTIME_PERCENT percent of the hourly rate per hour, rounded down."""
    return hours * rate_cents * OVERTIME_PERCENT // 100
''',
    "deductions.py": '''"""Income tax on weekly pay."""


def income_tax(gross_cents):
    """20 percent of the part of `gross_cents` between 50000 and 150000, plus 40 percent of the part above.

    Each part is rounded down separately.
    """
    tax = 0
    if gross_cents > 50000:
        tax += (min(gross_cents, 150000) - 50000) * 20 // 100
    if gross_cents > 150000:
        tax += (gross_cents - 150000) * 40 // 100
    return tax
''',
    "payslip.py": '''"""Weekly pay slips."""

from {package}.deductions import income_tax
from {package}.hours import split_hours
from {package}.overtime import overtime_pay
from {package}.rates import hourly_rate


def net_pay(grade, hours):
    """Net weekly pay in cents: regular hours at the grade's rate plus overtime pay, minus income tax."""
    rate = hourly_rate(grade)
    regular, overtime = split_hours(hours)
    gross = regular * rate + overtime_pay(overtime, rate)
    return gross - income_tax(gross)
''',
}


@dataclass(frozen=True)
class Layered:
    name: str
    packages: tuple[str, ...]
    topic: str
    modules: dict[str, str]
    top: tuple[str, str]  # (module, function) with the symptom
    buggy: tuple[tuple[str, str], ...]  # (module, function) that may get the bug
    component_cases: dict[tuple[str, str], tuple[tuple, ...]]

    def top_cases(self, rng: random.Random) -> list[tuple]:
        if self.name == "checkout":
            items = ["apple", "pear", "melon", "bread", "cheese"]
            fixed = [
                ([("apple", 40)], "north", "HALFOFF"),
                ([("apple", 100)], "east", ""),
                ([("melon", 1)], "west", "SAVE10"),
                ([("cheese", 2), ("pear", 3)], "south", "BOGUS"),
            ]
            drawn = [
                (
                    [(item, rng.randint(1, 6)) for item in sorted(rng.sample(items, rng.randint(1, 3)))],
                    rng.choice(["north", "south", "east", "west"]),
                    rng.choice(["", "SAVE10", "HALFOFF"]),
                )
                for _ in range(6)
            ]
            return fixed + drawn
        grades = ["junior", "senior", "lead"]
        fixed = [("junior", 40), ("senior", 41), ("lead", 0), ("lead", 60)]
        return fixed + [(rng.choice(grades), rng.choice([12, 25, 38, 39, 44, 47, 52, 55])) for _ in range(6)]


CHECKOUT = Layered(
    "checkout",
    ("shopfront", "till"),
    "checkout",
    _CHECKOUT,
    ("checkout", "total_cents"),
    (("cart", "subtotal_cents"), ("discounts", "discount_cents"), ("tax", "tax_cents"), ("shipping", "shipping_cents")),
    {
        ("discounts", "discount_cents"): (
            (1999, "HALFOFF"),
            (2000, "HALFOFF"),
            (1000, "SAVE10"),
            (999, "SAVE10"),
            (500, "OTHER"),
        ),
        ("tax", "tax_cents"): ((1000, "north"), (999, "south"), (1000, "east"), (1000, "nowhere")),
        ("shipping", "shipping_cents"): ((4999,), (5000,), (0,)),
        ("cart", "subtotal_cents"): (([("apple", 2), ("bread", 1)],), ([],)),
        ("catalog", "price_of"): (("melon",), ("pear",)),
    },
)
PAYROLL = Layered(
    "payroll",
    ("payday", "wage_calc"),
    "payroll",
    _PAYROLL,
    ("payslip", "net_pay"),
    (("hours", "split_hours"), ("overtime", "overtime_pay"), ("deductions", "income_tax")),
    {
        ("hours", "split_hours"): ((40,), (41,), (0,), (55,)),
        ("overtime", "overtime_pay"): ((2, 1000), (0, 2600), (5, 1801)),
        ("deductions", "income_tax"): ((50000,), (50001,), (150000,), (200000,), (10000,)),
        ("rates", "hourly_rate"): (("junior",), ("lead",)),
    },
)
SHAPES = {"checkout": CHECKOUT, "payroll": PAYROLL}


def package_modules(shape: Layered, package: str) -> dict[str, str]:
    return {f"{package}/{name}": text.replace("{package}", package) for name, text in shape.modules.items()}


def top_outcomes(files: dict[str, str], module: str, func: str, cases: list[tuple]) -> list[tuple[str, object]]:
    with importable(files):
        fn = getattr(importlib.import_module(module), func)
        return [outcome(fn, args) for args in cases]


def test_files(
    shape: Layered, package: str, top_cases: list[tuple], symptom: int, passing: int
) -> tuple[TestFile, TestFile, TestFile]:
    """(visible top-level tests, hidden top-level tests, hidden component tests)."""
    module, func = f"{package}.{shape.top[0]}", shape.top[1]
    visible = TestFile(
        f"tests/test_{shape.top[0]}.py",
        f"Tests of {module}.",
        [Case(module, func, top_cases[i], f"test_{func}_{i}") for i in sorted({symptom, passing})],
    )
    hidden_top = TestFile(
        f"tests/test_{shape.top[0]}_more.py",
        f"More tests of {module}.",
        [Case(module, func, args, f"test_{func}_case_{i}") for i, args in enumerate(top_cases)],
    )
    components = []
    for (mod, fn), cases in shape.component_cases.items():
        components += [Case(f"{package}.{mod}", fn, args, f"test_{fn}_{i}") for i, args in enumerate(cases)]
    return visible, hidden_top, TestFile("tests/test_components.py", f"Tests of {package}'s helpers.", components)
