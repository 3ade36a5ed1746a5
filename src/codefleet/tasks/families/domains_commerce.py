"""Domains of money and goods: stock keeping, bank accounts and shipping rates (the rules for a domain
are in domains.py)."""

from __future__ import annotations

from codefleet.tasks.families.domain_types import Domain
from codefleet.tasks.families.domain_types import make_func as _func

INVENTORY = Domain(
    "inventory",
    ("stockroom", "warehouse_tools"),
    "stock",
    "stock-keeping helpers",
    (),
    (
        _func(
            '''
        def restock_amount(on_hand, target, pack_size):
            """Units to order so that stock reaches at least `target`, in whole packs.

            Returns 0 when `on_hand` is already at or above `target`; otherwise the
            shortfall (`target - on_hand`) rounded up to a multiple of `pack_size`.
            """
            if on_hand >= target:
                return 0
            shortfall = target - on_hand
            packs = (shortfall + pack_size - 1) // pack_size
            return packs * pack_size
    ''',
            [(3, 10, 4), (10, 10, 5), (0, 12, 6), (11, 10, 3), (7, 20, 5), (9, 10, 1)],
            ("units_to_order", "reorder_quantity"),
        ),
        _func(
            '''
        def stock_value(items):
            """Total value of `items`, a list of (quantity, unit_price) pairs, rounded to 2 decimals."""
            total = 0.0
            for quantity, unit_price in items:
                total += quantity * unit_price
            return round(total, 2)
    ''',
            [([(2, 1.5), (3, 2.25)],), ([],), ([(10, 0.1)],), ([(1, 4.0), (0, 9.99)],), ([(4, 2.5), (1, 0.75)],)],
            ("inventory_value", "total_stock_value"),
        ),
        _func(
            '''
        def low_stock(levels, threshold):
            """Names whose quantity in `levels` (a dict name -> quantity) is below `threshold`, sorted."""
            return sorted(name for name, quantity in levels.items() if quantity < threshold)
    ''',
            [
                ({"bolts": 3, "nuts": 10, "gears": 5}, 5),
                ({"bolts": 3, "nuts": 10, "gears": 5}, 6),
                ({}, 1),
                ({"axles": 0}, 0),
                ({"pins": 7, "cams": 2}, 8),
            ],
            ("items_below", "short_items"),
        ),
        _func(
            '''
        def split_into_boxes(quantity, box_size):
            """Box loads for `quantity` units: as many full boxes of `box_size` as fit, then one box with the rest."""
            full, rest = divmod(quantity, box_size)
            boxes = [box_size] * full
            if rest > 0:
                boxes.append(rest)
            return boxes
    ''',
            [(10, 4), (8, 4), (3, 5), (0, 3), (13, 6)],
            ("pack_boxes", "box_loads"),
        ),
        _func(
            '''
        def days_of_cover(quantity, daily_use):
            """Whole days the stock lasts at `daily_use` units a day; -1 when `daily_use` is 0 or less."""
            if daily_use <= 0:
                return -1
            return quantity // daily_use
    ''',
            [(10, 3), (9, 3), (2, 5), (5, 0), (30, 1)],
            ("stock_days", "days_remaining"),
        ),
        _func(
            '''
        def reorder_list(levels, minimums):
            """Names whose quantity in `levels` is at or below their minimum in `minimums`, sorted.

            Names without an entry in `minimums` are never reordered.
            """
            return sorted(name for name, qty in levels.items() if name in minimums and qty <= minimums[name])
    ''',
            [({"a": 1, "b": 5, "c": 2}, {"a": 1, "b": 4}), ({"x": 0}, {}), ({"x": 3, "y": 9}, {"x": 2, "y": 10})],
            ("items_to_reorder", "reorder_names"),
        ),
    ),
)

BANK = Domain(
    "bank",
    ("ledgerly", "bank_accounts"),
    "accounts",
    "bank account helpers",
    (),
    (
        _func(
            '''
        def apply_interest(balance_cents, rate_percent, years):
            """Balance after `years` of yearly compound interest at `rate_percent`.

            The balance is rounded to whole cents (Python's round) after each year.
            """
            balance = balance_cents
            for _ in range(years):
                balance = round(balance * (100 + rate_percent) / 100)
            return balance
    ''',
            [(10000, 5, 1), (10000, 5, 2), (999, 10, 0), (100000, 3, 3), (250, 4, 1)],
            ("compound", "grow_balance"),
        ),
        _func(
            '''
        def can_withdraw(balance_cents, amount_cents, overdraft_cents=0):
            """True if `amount_cents` (which must be positive) can be withdrawn.

            A withdrawal is allowed when the balance afterwards is at least `-overdraft_cents`.
            """
            if amount_cents <= 0:
                return False
            return balance_cents - amount_cents >= -overdraft_cents
    ''',
            [(100, 50), (100, 100), (100, 101), (100, 150, 50), (100, 151, 50), (100, 0)],
            ("withdrawal_allowed", "may_withdraw"),
        ),
        _func(
            '''
        def monthly_fee(balance_cents):
            """Monthly fee in cents: 500 below 100000, 200 below 500000, 0 from 500000 up."""
            if balance_cents < 100000:
                return 500
            if balance_cents < 500000:
                return 200
            return 0
    ''',
            [(0,), (99999,), (100000,), (499999,), (500000,), (750000,)],
            ("account_fee", "fee_for_balance"),
        ),
        _func(
            '''
        def transfer(balances, source, target, amount_cents):
            """A new dict of balances with `amount_cents` moved from `source` to `target`.

            Missing accounts count as 0. If `source` has less than `amount_cents`, an
            unchanged copy is returned. `balances` itself is never modified.
            """
            result = dict(balances)
            if result.get(source, 0) < amount_cents:
                return result
            result[source] = result.get(source, 0) - amount_cents
            result[target] = result.get(target, 0) + amount_cents
            return result
    ''',
            [
                ({"a": 100, "b": 5}, "a", "b", 40),
                ({"a": 10}, "a", "b", 11),
                ({"a": 10}, "a", "c", 10),
                ({"x": 3, "y": 4}, "y", "x", 4),
            ],
            ("move_funds", "transfer_funds"),
        ),
        _func(
            '''
        def statement_total(transactions):
            """Net of `transactions`, a list of (kind, cents) pairs: deposits add, withdrawals subtract.

            Kinds other than 'deposit' and 'withdrawal' are ignored.
            """
            total = 0
            for kind, cents in transactions:
                if kind == "deposit":
                    total += cents
                elif kind == "withdrawal":
                    total -= cents
            return total
    ''',
            [
                ([("deposit", 500), ("withdrawal", 200)],),
                ([],),
                ([("fee", 30), ("deposit", 10)],),
                ([("withdrawal", 5), ("withdrawal", 6)],),
            ],
            ("net_total", "statement_net"),
        ),
    ),
)

SHIPPING = Domain(
    "shipping",
    ("parcelpost", "freight_calc"),
    "rates",
    "shipping rate helpers",
    ("math",),
    (
        _func(
            '''
        def parcel_cost(weight_kg, base_cents=500, per_kg_cents=120):
            """Cost in cents: `base_cents` plus `per_kg_cents` for every started kilogram after the first."""
            extra_kg = max(0, math.ceil(weight_kg) - 1)
            return base_cents + extra_kg * per_kg_cents
    ''',
            [(0.5,), (1,), (1.2,), (3,), (10, 400, 100)],
            ("shipping_cost", "postage"),
        ),
        _func(
            '''
        def volumetric_weight(length_cm, width_cm, height_cm, divisor=5000):
            """Volumetric weight in kg: length x width x height / `divisor`, rounded to 2 decimals."""
            return round(length_cm * width_cm * height_cm / divisor, 2)
    ''',
            [(50, 40, 30), (10, 10, 10), (100, 50, 50, 4000), (20, 20, 20)],
            ("dim_weight", "volume_weight"),
        ),
        _func(
            '''
        def billable_weight(actual_kg, volumetric_kg):
            """The larger of the actual and the volumetric weight."""
            if actual_kg > volumetric_kg:
                return actual_kg
            return volumetric_kg
    ''',
            [(2.0, 1.5), (1.0, 3.2), (2.0, 2.0), (0.1, 0.0)],
            ("chargeable_weight", "weight_to_bill"),
        ),
        _func(
            '''
        def delivery_days(distance_km, express=False):
            """Days to deliver: 1 per started 500 km, at least 1; express halves that, rounding up."""
            days = max(1, math.ceil(distance_km / 500))
            if express:
                days = math.ceil(days / 2)
            return days
    ''',
            [(100,), (500,), (501,), (1800, True), (2600,), (2600, True)],
            ("transit_days", "days_in_transit"),
        ),
        _func(
            '''
        def zone_for(country, zones):
            """The first zone (in name order) of `zones` (dict zone -> list of countries) listing `country`.

            'rest' when no zone lists it.
            """
            for zone, countries in sorted(zones.items()):
                if country in countries:
                    return zone
            return "rest"
    ''',
            [("FR", {"eu": ["FR", "DE"], "na": ["US"]}), ("JP", {"eu": ["FR"]}), ("US", {"b": ["US"], "a": ["US"]})],
            ("shipping_zone", "zone_of"),
        ),
    ),
)
