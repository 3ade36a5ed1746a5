"""The domain library: small pure functions the procedural families build repositories from.

A *domain* (inventory, geometry, text, ...) is a module's worth of functions
with exact docstrings (the stub family asks for an implementation from the
docstring alone), argument tuples to test them with (expected values are
computed by running the correct code, never written by hand), and a couple
of natural new names for each function (the rename family). Functions are
pure and loop only over bounded ranges (no `while`), so a mutated copy can
always be executed at generation time.

Each domain is one *template* of the bugfix, stub and rename families; which
split it belongs to is decided in those families, not here. The seven here
came first; `more_domains.py` adds training templates (more code to learn
from, the held-out ones unchanged). `domain_types.py` has the two types.
"""

from __future__ import annotations

from codefleet.tasks.families.domain_types import Domain, Func  # noqa: F401 (Func: re-exported)
from codefleet.tasks.families.domain_types import make_func as _func
from codefleet.tasks.families.more_domains import MORE_DOMAINS

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

GEOMETRY = Domain(
    "geometry",
    ("geomkit", "plane_shapes"),
    "shapes",
    "2-D geometry helpers",
    ("math",),
    (
        _func(
            '''
        def rectangle_area(width, height):
            """Area of a `width` x `height` rectangle; 0 if either side is negative."""
            if width < 0 or height < 0:
                return 0
            return width * height
    ''',
            [(3, 4), (0, 5), (-1, 3), (2.5, 2), (7, 1)],
            ("rect_area", "area_of_rectangle"),
        ),
        _func(
            '''
        def manhattan_distance(p, q):
            """|x1 - x2| + |y1 - y2| for the points p = (x1, y1) and q = (x2, y2)."""
            return abs(p[0] - q[0]) + abs(p[1] - q[1])
    ''',
            [((0, 0), (3, 4)), ((1, 1), (1, 1)), ((-2, 3), (2, -3)), ((5, 0), (2, 1))],
            ("taxicab_distance", "grid_distance"),
        ),
        _func(
            '''
        def perimeter(points):
            """Perimeter of the closed polygon through `points` (x, y), rounded to 3 decimals.

            Fewer than 2 points have perimeter 0.0.
            """
            if len(points) < 2:
                return 0.0
            total = 0.0
            for i in range(len(points)):
                x1, y1 = points[i]
                x2, y2 = points[(i + 1) % len(points)]
                total += math.hypot(x2 - x1, y2 - y1)
            return round(total, 3)
    ''',
            [([(0, 0), (3, 0), (3, 4)],), ([(0, 0)],), ([(0, 0), (1, 0), (1, 1), (0, 1)],), ([(0, 0), (2, 0)],)],
            ("polygon_perimeter", "outline_length"),
        ),
        _func(
            '''
        def bounding_box(points):
            """(min_x, min_y, max_x, max_y) of `points`, a non-empty list of (x, y) pairs."""
            xs = [x for x, _ in points]
            ys = [y for _, y in points]
            return (min(xs), min(ys), max(xs), max(ys))
    ''',
            [([(1, 2), (3, -1), (0, 5)],), ([(4, 4)],), ([(-3, 0), (2, 2)],)],
            ("bounds_of", "extent"),
        ),
        _func(
            '''
        def contains(box, point):
            """True if `point` (x, y) lies in `box` (min_x, min_y, max_x, max_y), edges included."""
            x, y = point
            return box[0] <= x <= box[2] and box[1] <= y <= box[3]
    ''',
            [
                ((0, 0, 2, 2), (1, 1)),
                ((0, 0, 2, 2), (2, 2)),
                ((0, 0, 2, 2), (3, 1)),
                ((0, 0, 2, 2), (0, -1)),
                ((0, 0, 2, 2), (0, 0)),
            ],
            ("box_contains", "point_in_box"),
        ),
        _func(
            '''
        def triangle_kind(a, b, c):
            """Kind of triangle with sides a, b, c.

            'invalid' unless every side is shorter than the sum of the other two;
            otherwise 'equilateral' (all equal), 'isosceles' (two equal) or 'scalene'.
            """
            if a + b <= c or a + c <= b or b + c <= a:
                return "invalid"
            if a == b == c:
                return "equilateral"
            if a == b or b == c or a == c:
                return "isosceles"
            return "scalene"
    ''',
            [(3, 3, 3), (3, 3, 5), (3, 4, 5), (1, 2, 3), (5, 3, 3), (2, 5, 2)],
            ("classify_triangle", "triangle_type"),
        ),
    ),
)

TEXT = Domain(
    "text",
    ("textkit", "wordsmith"),
    "textutil",
    "text utilities",
    ("re",),
    (
        _func(
            '''
        def truncate(text, width):
            """`text` if it has at most `width` characters, else its first `width - 3` characters and '...'."""
            if len(text) <= width:
                return text
            return text[:width - 3] + "..."
    ''',
            [("hello", 10), ("hello world", 8), ("abcdef", 6), ("abcdefg", 6), ("", 4)],
            ("shorten", "clip_text"),
        ),
        _func(
            '''
        def slugify(text):
            """The lower-case words of `text` joined by '-'.

            Words are runs of letters a-z and digits 0-9; every other character separates words.
            """
            words = re.split(r"[^a-z0-9]+", text.lower())
            return "-".join(word for word in words if word)
    ''',
            [("Hello, World!",), ("  Many   spaces ",), ("A1 b2",), ("",), ("Don't stop",)],
            ("make_slug", "to_slug"),
        ),
        _func(
            '''
        def count_vowels(text):
            """Number of vowels (a, e, i, o, u, in either case) in `text`."""
            return sum(1 for ch in text.lower() if ch in "aeiou")
    ''',
            [("hello",), ("AEIOU",), ("rhythm",), ("",), ("Queueing",)],
            ("vowel_count", "num_vowels"),
        ),
        _func(
            '''
        def wrap(text, width):
            """Greedy word wrap of `text` into lines of at most `width` characters.

            Words are separated by single spaces; a word longer than `width` gets a line of its own.
            """
            lines = []
            current = ""
            for word in text.split():
                if current and len(current) + 1 + len(word) > width:
                    lines.append(current)
                    current = word
                else:
                    current = word if not current else current + " " + word
            if current:
                lines.append(current)
            return lines
    ''',
            [("the quick brown fox", 10), ("a bb ccc", 4), ("", 5), ("longword x", 3), ("one two three", 7)],
            ("wrap_words", "fill_lines"),
        ),
        _func(
            '''
        def initials(name):
            """Upper-case first letter of each word of `name`, each followed by '.': 'ada lovelace' -> 'A.L.'."""
            return "".join(word[0].upper() + "." for word in name.split())
    ''',
            [("ada king lovelace",), ("grace",), ("",), ("alan  mathison turing",)],
            ("name_initials", "monogram"),
        ),
        _func(
            '''
        def is_palindrome(text):
            """True if the letters and digits of `text`, lower-cased, read the same both ways."""
            chars = [ch for ch in text.lower() if ch.isalnum()]
            return chars == chars[::-1]
    ''',
            [("Racecar",), ("A man, a plan, a canal: Panama",), ("abc",), ("",), ("ab",)],
            ("reads_same_backwards", "palindromic"),
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

GRADES = Domain(
    "grades",
    ("gradebook", "school_scores"),
    "grading",
    "grading helpers",
    (),
    (
        _func(
            '''
        def letter_grade(score):
            """'A' for 90 and above, 'B' for 80 to 89, 'C' for 70 to 79, 'D' for 60 to 69, else 'F'."""
            if score >= 90:
                return "A"
            if score >= 80:
                return "B"
            if score >= 70:
                return "C"
            if score >= 60:
                return "D"
            return "F"
    ''',
            [(95,), (90,), (89,), (80,), (75,), (60,), (59,), (0,)],
            ("grade_for", "to_letter"),
        ),
        _func(
            '''
        def mean(values):
            """Arithmetic mean of `values` rounded to 2 decimals; 0.0 for an empty list."""
            if not values:
                return 0.0
            return round(sum(values) / len(values), 2)
    ''',
            [([1, 2, 3, 4],), ([],), ([5],), ([2, 3],), ([1, 1, 2],)],
            ("average", "mean_score"),
        ),
        _func(
            '''
        def median(values):
            """Median of a non-empty list of numbers; the mean of the two middle values for an even count."""
            ordered = sorted(values)
            middle = len(ordered) // 2
            if len(ordered) % 2 == 1:
                return ordered[middle]
            return (ordered[middle - 1] + ordered[middle]) / 2
    ''',
            [([3, 1, 2],), ([4, 1, 3, 2],), ([5],), ([1, 2],), ([7, 7, 1, 9, 3],)],
            ("middle_value", "median_score"),
        ),
        _func(
            '''
        def top_scores(scores, n):
            """Names of the `n` best entries of `scores` (dict name -> score), best first, ties by name."""
            ranked = sorted(scores.items(), key=lambda item: (-item[1], item[0]))
            return [name for name, _ in ranked[:n]]
    ''',
            [({"ann": 90, "bob": 72, "cy": 90}, 2), ({"ann": 1}, 3), ({"a": 5, "b": 6, "c": 7}, 1)],
            ("best_students", "leaders"),
        ),
        _func(
            '''
        def passed_count(scores, pass_mark=50):
            """How many of `scores` are at or above `pass_mark`."""
            return sum(1 for score in scores if score >= pass_mark)
    ''',
            [([10, 50, 70],), ([],), ([49, 51], 51), ([80, 90, 100], 90)],
            ("count_passes", "number_passed"),
        ),
        _func(
            '''
        def curve(scores, target_max=100):
            """`scores` scaled so the best becomes `target_max`, each rounded to a whole number.

            If the best score is 0, every score stays 0.
            """
            best = max(scores)
            if best == 0:
                return [0 for _ in scores]
            return [round(score * target_max / best) for score in scores]
    ''',
            [([40, 80],), ([0, 0],), ([30, 60, 90], 60), ([1, 3],)],
            ("scale_scores", "curve_scores"),
        ),
    ),
)

SCHEDULE = Domain(
    "schedule",
    ("timeslots", "shift_planner"),
    "clock",
    "time and scheduling helpers",
    (),
    (
        _func(
            '''
        def to_minutes(hhmm):
            """Minutes since midnight of a 'HH:MM' string."""
            hours, minutes = hhmm.split(":")
            return int(hours) * 60 + int(minutes)
    ''',
            [("00:00",), ("01:30",), ("23:59",), ("12:05",)],
            ("minutes_since_midnight", "parse_hhmm"),
        ),
        _func(
            '''
        def add_minutes(hhmm, minutes):
            """The 'HH:MM' time `minutes` after `hhmm`, wrapping around midnight."""
            hours, mins = hhmm.split(":")
            total = (int(hours) * 60 + int(mins) + minutes) % (24 * 60)
            return f"{total // 60:02d}:{total % 60:02d}"
    ''',
            [("10:00", 30), ("23:45", 30), ("00:00", 1440), ("09:59", 1), ("06:10", 125)],
            ("shift_time", "later_by"),
        ),
        _func(
            '''
        def overlaps(start_a, end_a, start_b, end_b):
            """True if the half-open intervals [start_a, end_a) and [start_b, end_b) share any time."""
            return start_a < end_b and start_b < end_a
    ''',
            [(0, 10, 5, 15), (0, 10, 10, 20), (5, 6, 0, 10), (0, 5, 6, 9), (3, 8, 0, 3)],
            ("intervals_overlap", "clashes"),
        ),
        _func(
            '''
        def format_duration(seconds):
            """'H:MM:SS' for a whole number of seconds (hours are not padded)."""
            hours, rest = divmod(seconds, 3600)
            minutes, secs = divmod(rest, 60)
            return f"{hours}:{minutes:02d}:{secs:02d}"
    ''',
            [(0,), (59,), (3600,), (3725,), (86399,)],
            ("duration_text", "hms"),
        ),
        _func(
            '''
        def business_days(start_weekday, days):
            """Working days (Monday=0 to Friday=4) among `days` consecutive days from weekday `start_weekday`."""
            return sum(1 for offset in range(days) if (start_weekday + offset) % 7 < 5)
    ''',
            [(0, 7), (5, 2), (4, 3), (0, 0), (6, 8)],
            ("working_days", "weekdays_in"),
        ),
        _func(
            '''
        def free_slots(busy, day_start, day_end):
            """Gaps (start, end) between the sorted, non-overlapping `busy` intervals within the day.

            Empty gaps are left out.
            """
            gaps = []
            cursor = day_start
            for start, end in busy:
                if start > cursor:
                    gaps.append((cursor, start))
                cursor = max(cursor, end)
            if cursor < day_end:
                gaps.append((cursor, day_end))
            return gaps
    ''',
            [([(9, 10), (12, 13)], 8, 17), ([], 8, 17), ([(8, 17)], 8, 17), ([(8, 9), (9, 12)], 8, 12)],
            ("open_slots", "gaps_between"),
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

DOMAINS: dict[str, Domain] = {
    d.name: d for d in (INVENTORY, GEOMETRY, TEXT, BANK, GRADES, SCHEDULE, SHIPPING, *MORE_DOMAINS)
}


def module_source(domain: Domain, funcs: list[Func], doc: str | None = None) -> str:
    """A module with `funcs` in the order given, the domain's imports on top."""
    head = f'"""{doc or domain.topic.capitalize()}."""\n'
    if domain.imports:
        head += "\n" + "".join(f"import {name}\n" for name in domain.imports)
    return head + "\n\n" + "\n\n".join(f.source for f in funcs)
