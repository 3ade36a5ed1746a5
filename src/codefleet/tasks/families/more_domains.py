"""More training templates for the bugfix, stub and rename families: recipes, weather, library, parking,
fitness and tickets (the rules are in domains.py). The held-out templates stay those of domains.py."""

from __future__ import annotations

from codefleet.tasks.families.domain_types import Domain, make_func

RECIPES = Domain(
    "recipes",
    ("recipe_box", "cookery"),
    "kitchen",
    "kitchen helpers",
    ("math",),
    (
        make_func(
            '''
        def scale_servings(quantity, servings_from, servings_to):
            """`quantity` of an ingredient (meant for `servings_from` servings) scaled to `servings_to` servings.

            The result is rounded to 2 decimals; it is 0.0 when `servings_from` is 0 or less.
            """
            if servings_from <= 0:
                return 0.0
            return round(quantity * servings_to / servings_from, 2)
    ''',
            [(200, 4, 6), (3, 2, 5), (100, 0, 4), (7, 1, 3), (1, 3, 1), (250, 4, 4)],
            ("rescale_recipe", "adjust_portions"),
        ),
        make_func(
            '''
        def volume_in_ml(amount, unit):
            """Millilitres in `amount` of `unit`: 'tsp' is 5 ml, 'tbsp' 15 ml, 'cup' 240 ml and 'ml' 1 ml.

            The result is rounded to 1 decimal; any other unit gives -1.0.
            """
            sizes = {"tsp": 5, "tbsp": 15, "cup": 240, "ml": 1}
            if unit not in sizes:
                return -1.0
            return round(amount * sizes[unit], 1)
    ''',
            [(2, "tsp"), (1.5, "tbsp"), (0.333, "cup"), (3, "ml"), (1, "pinch")],
            ("to_millilitres", "millilitres_of"),
        ),
        make_func(
            '''
        def roast_minutes(weight_kg, doneness):
            """Roasting time in minutes: 20 minutes plus a time per kilogram of `weight_kg`.

            The time per kilogram is 30 minutes for 'rare', 50 for 'well' and 40 for any other
            doneness ('medium'); the per-kilogram part is rounded up to a whole minute (math.ceil).
            """
            per_kg = 40
            if doneness == "rare":
                per_kg = 30
            elif doneness == "well":
                per_kg = 50
            return 20 + math.ceil(weight_kg * per_kg)
    ''',
            [(1.5, "medium"), (1.5, "rare"), (2, "well"), (0.75, "rare"), (1.25, "bleu")],
            ("roasting_time", "joint_cooking_minutes"),
        ),
        make_func(
            '''
        def oven_setting(celsius):
            """Gas mark for an oven at `celsius` degrees.

            0 below 140; otherwise one mark per full 10 degrees above 130, that is
            (celsius - 130) // 10 (140 to 149 is mark 1), but never more than 9.
            """
            if celsius < 140:
                return 0
            mark = (celsius - 130) // 10
            if mark > 9:
                mark = 9
            return mark
    ''',
            [(120,), (139,), (140,), (155,), (220,), (250,)],
            ("gas_mark", "gas_mark_for_oven"),
        ),
        make_func(
            '''
        def merge_ingredients(first, second):
            """One shopping list from two dicts ingredient -> quantity; shared ingredients' quantities are added.

            Returns a new dict; ingredients whose total is 0 or less are left out.
            """
            totals = {}
            for name, quantity in list(first.items()) + list(second.items()):
                totals[name] = totals.get(name, 0) + quantity
            return {name: quantity for name, quantity in totals.items() if quantity > 0}
    ''',
            [
                ({"flour": 200, "eggs": 2}, {"eggs": 1, "milk": 300}),
                ({}, {"salt": 5}),
                ({"sugar": 50}, {"sugar": -50}),
                ({"oil": 10}, {}),
                ({"butter": 30, "flour": 100}, {"flour": 150, "yeast": 0}),
            ],
            ("combine_ingredients", "joint_shopping_list"),
        ),
        make_func(
            '''
        def step_start_times(durations, start):
            """Start minute of each recipe step, the steps done one after another from minute `start`.

            `durations` lists each step's length in minutes. Steps of 0 minutes or less are
            skipped: they get no start time and take no time.
            """
            times = []
            clock = start
            for minutes in durations:
                if minutes <= 0:
                    continue
                times.append(clock)
                clock += minutes
            return times
    ''',
            [([10, 5, 20], 0), ([15, 0, 5], 30), ([], 12), ([1, 2, 3], 100), ([-4, 6, 1], 5)],
            ("step_schedule", "recipe_timeline"),
        ),
    ),
)

WEATHER = Domain(
    "weather",
    ("weather_stats", "meteo_tools"),
    "forecast",
    "weather statistics helpers",
    (),
    (
        make_func(
            '''
        def fahrenheit_to_celsius(fahrenheit):
            """Degrees Celsius for `fahrenheit`: (fahrenheit - 32) * 5 / 9, rounded to 1 decimal."""
            return round((fahrenheit - 32) * 5 / 9, 1)
    ''',
            [(32,), (212,), (98.6,), (-40,), (0,), (50,)],
            ("convert_to_celsius", "celsius_from_fahrenheit"),
        ),
        make_func(
            '''
        def temperature_band(celsius):
            """'freezing' below 0, 'cold' from 0 to below 10, 'mild' from 10 to below 20,
            'warm' from 20 to below 30 and 'hot' from 30 up.
            """
            if celsius < 0:
                return "freezing"
            if celsius < 10:
                return "cold"
            if celsius < 20:
                return "mild"
            if celsius < 30:
                return "warm"
            return "hot"
    ''',
            [(-0.5,), (0,), (10,), (19.9,), (20,), (30,)],
            ("classify_temperature", "temperature_category"),
        ),
        make_func(
            '''
        def daily_means(readings):
            """Mean of each day's readings, rounded to 1 decimal, in order.

            `readings` is a list with one list of temperature readings per day; a day
            without readings gets None.
            """
            means = []
            for day in readings:
                if len(day) == 0:
                    means.append(None)
                else:
                    means.append(round(sum(day) / len(day), 1))
            return means
    ''',
            [([[10, 12, 14], [3, 4]],), ([[]],), ([],), ([[1, 2, 2], [-3]],), ([[7], [], [2, 9]],)],
            ("mean_per_day", "average_by_day"),
        ),
        make_func(
            '''
        def longest_dry_spell(rainfall_mm, threshold=0.2):
            """Length of the longest run of consecutive days in `rainfall_mm` with less than `threshold` mm of rain.

            0 when there is no such day.
            """
            best = 0
            run = 0
            for mm in rainfall_mm:
                if mm < threshold:
                    run += 1
                    if run > best:
                        best = run
                else:
                    run = 0
            return best
    ''',
            [([0, 0, 5, 0, 0, 0, 1.2],), ([0.2, 0.1, 0, 3],), ([],), ([4, 6, 1],), ([0.5, 0.4, 2, 0.4], 1.0)],
            ("max_dry_days", "dry_streak_length"),
        ),
        make_func(
            '''
        def weekly_rainfall(daily_mm):
            """Rain totals of each week of 7 days in `daily_mm` (day 0 starts the first week), rounded to 1 decimal.

            A last, shorter week is totalled too; no days give an empty list.
            """
            totals = []
            for start in range(0, len(daily_mm), 7):
                totals.append(round(sum(daily_mm[start:start + 7]), 1))
            return totals
    ''',
            [
                ([1.2, 0, 0, 2.31, 0, 0, 1, 3, 0.5, 0.04],),
                ([0.5] * 7,),
                ([],),
                ([2, 0, 0, 0, 0, 0, 0, 4.44, 1, 0, 0, 0, 0, 0, 7],),
                ([0.06, 0.06, 0.06],),
            ],
            ("rain_per_week", "weekly_rain_totals"),
        ),
        make_func(
            '''
        def heating_degree_days(mean_temps, base=18):
            """Sum of how far each day's mean temperature in `mean_temps` is below `base`, rounded to 1 decimal.

            Days at or above `base` add nothing.
            """
            total = 0.0
            for temp in mean_temps:
                if temp < base:
                    total += base - temp
            return round(total, 1)
    ''',
            [([10, 15.5, 20, 18],), ([],), ([12.3, 19], 20), ([25, 30],), ([17.25, -2.04],)],
            ("degree_days_below", "heating_demand"),
        ),
    ),
)

LIBRARY = Domain(
    "library",
    ("lending_desk", "libloans"),
    "loans",
    "library loan helpers",
    (),
    (
        make_func(
            '''
        def loan_due_day(borrow_day, loan_days=21, renewals=0):
            """Day number on which a loan is due: `loan_days` after `borrow_day`, plus 14 days per renewal.

            At most 2 renewals count; any further renewals add nothing.
            """
            if renewals > 2:
                renewals = 2
            return borrow_day + loan_days + 14 * renewals
    ''',
            [(10,), (10, 21, 1), (100, 14, 2), (5, 21, 3), (0, 7, 0), (30, 28, 5)],
            ("due_day_for_loan", "return_by_day"),
        ),
        make_func(
            '''
        def overdue_fine(days_late, daily_cents=25, cap_cents=1000):
            """Fine in cents for a book returned `days_late` days late.

            0 when it is at most 2 days late (the grace period); otherwise `daily_cents` for every
            day late, the first two included, but never more than `cap_cents`.
            """
            if days_late <= 2:
                return 0
            fine = days_late * daily_cents
            if fine > cap_cents:
                return cap_cents
            return fine
    ''',
            [(0,), (2,), (3,), (10,), (41,), (7, 50, 300)],
            ("book_late_fee", "late_return_fine"),
        ),
        make_func(
            '''
        def copies_available(total_copies, on_loan, reserved=0):
            """Copies that can be lent now: `total_copies` minus those `on_loan` and those `reserved`.

            Never below 0.
            """
            free = total_copies - on_loan - reserved
            if free < 0:
                return 0
            return free
    ''',
            [(5, 2), (5, 2, 1), (3, 3), (2, 3), (4, 1, 5), (10, 0, 3)],
            ("lendable_copies", "copies_on_shelf"),
        ),
        make_func(
            '''
        def hold_position(queue, patron):
            """1-based place of `patron` in the hold `queue` (a list of patron names, first in line first).

            A patron listed more than once counts at their first place; 0 when not listed.
            """
            for index in range(len(queue)):
                if queue[index] == patron:
                    return index + 1
            return 0
    ''',
            [
                (["ann", "bo", "cy"], "bo"),
                (["ann"], "ann"),
                ([], "ann"),
                (["x", "y", "x"], "x"),
                (["a", "b", "c", "d"], "d"),
                (["a", "b"], "z"),
            ],
            ("place_in_hold_queue", "reservation_rank"),
        ),
        make_func(
            '''
        def can_borrow(books_out, limit, fines_cents, suspended=False):
            """True if a patron may borrow one more book.

            That needs all three: the patron is not `suspended`, has fewer than `limit` books out
            (`books_out`), and owes less than 500 cents in fines (`fines_cents`).
            """
            return not suspended and books_out < limit and fines_cents < 500
    ''',
            [(2, 5, 0), (5, 5, 0), (4, 5, 499), (1, 5, 500), (0, 3, 0, True), (3, 2, 0)],
            ("may_borrow_more", "borrowing_allowed"),
        ),
        make_func(
            '''
        def overdue_report(loans, today):
            """(title, days_overdue) for each (title, due_day) of `loans` whose `due_day` is before `today`.

            `days_overdue` is `today - due_day`. Most overdue first; equally overdue loans by title.
            """
            late = []
            for title, due_day in loans:
                if due_day < today:
                    late.append((due_day, title))
            return [(title, today - due_day) for due_day, title in sorted(late)]
    ''',
            [
                ([("Emma", 10), ("Dune", 4), ("Ulysses", 12)], 11),
                ([], 5),
                ([("B", 3), ("A", 3)], 8),
                ([("Kim", 9)], 9),
                ([("X", 1), ("Y", 20), ("W", 14)], 15),
            ],
            ("late_loans", "overdue_titles"),
        ),
    ),
)

PARKING = Domain(
    "parking",
    ("parkwise", "garage_meter"),
    "garage",
    "parking garage helpers",
    (),
    (
        make_func(
            '''
        def parking_fee(minutes, hourly_cents=300, daily_max_cents=2000):
            """Fee in cents for a stay of `minutes`.

            Stays of up to 15 minutes are free. Longer stays pay `hourly_cents` for every started
            hour of the whole stay, but never more than `daily_max_cents`.
            """
            if minutes <= 15:
                return 0
            hours = (minutes + 59) // 60
            return min(hours * hourly_cents, daily_max_cents)
    ''',
            [(15,), (16,), (60,), (61,), (600,), (130, 250, 1000)],
            ("parking_charge", "fee_for_stay"),
        ),
        make_func(
            '''
        def stay_minutes(arrival, departure):
            """Minutes parked between `arrival` and `departure`, both 'HH:MM' strings.

            A `departure` earlier than `arrival` is on the next day; equal times give 0.
            """
            hours, mins = arrival.split(":")
            start = int(hours) * 60 + int(mins)
            hours, mins = departure.split(":")
            end = int(hours) * 60 + int(mins)
            if end < start:
                end += 24 * 60
            return end - start
    ''',
            [("08:00", "09:30"), ("22:15", "01:05"), ("10:00", "10:00"), ("23:59", "00:00"), ("00:00", "23:59")],
            ("parked_minutes", "stay_length"),
        ),
        make_func(
            '''
        def occupancy_percent(occupied, capacity):
            """Percent of the `capacity` spaces that are `occupied`, rounded to 1 decimal.

            `occupied` counts at most `capacity` (so the result is at most 100.0); a `capacity` of 0
            or less gives 0.0.
            """
            if capacity <= 0:
                return 0.0
            return round(min(occupied, capacity) * 100 / capacity, 1)
    ''',
            [(45, 120), (1, 3), (50, 50), (60, 50), (10, 0), (1, 1)],
            ("percent_full", "occupancy_rate"),
        ),
        make_func(
            '''
        def first_free_level(levels, needed=1):
            """Index of the first level with at least `needed` free spaces, or -1 if no level has.

            `levels` lists (capacity, occupied) pairs, ground level (index 0) first; a level has
            capacity - occupied free spaces.
            """
            for index in range(len(levels)):
                capacity, occupied = levels[index]
                if capacity - occupied >= needed:
                    return index
            return -1
    ''',
            [
                ([(50, 50), (40, 38), (60, 10)],),
                ([(50, 50), (40, 38), (60, 10)], 3),
                ([(10, 10)],),
                ([(5, 3), (5, 0)], 2),
                ([],),
            ],
            ("level_with_space", "free_level"),
        ),
        make_func(
            '''
        def validated_fee(fee_cents, stamps):
            """`fee_cents` less 150 cents for each shop validation stamp, never below 0.

            At most 3 stamps count; further stamps take nothing off.
            """
            used = min(stamps, 3)
            return max(0, fee_cents - used * 150)
    ''',
            [(900, 1), (900, 3), (900, 5), (200, 2), (300, 2), (0, 0)],
            ("stamped_fee", "fee_after_stamps"),
        ),
        make_func(
            '''
        def peak_occupancy(events, start=0):
            """Most cars inside at any moment, starting from `start` cars and applying `events` in order.

            `events` is a list of strings: 'in' adds a car, 'out' removes one (but never below 0
            cars), anything else is ignored. The starting count itself can be the peak.
            """
            cars = start
            peak = start
            for event in events:
                if event == "in":
                    cars += 1
                elif event == "out" and cars > 0:
                    cars -= 1
                if cars > peak:
                    peak = cars
            return peak
    ''',
            [
                (["in", "in", "out", "in", "in"],),
                (["out", "in"],),
                ([], 4),
                (["out", "out", "in", "in"], 1),
                (["in", "x", "in", "out"],),
            ],
            ("max_cars_inside", "busiest_count"),
        ),
    ),
)

FITNESS = Domain(
    "fitness",
    ("fitlog", "workout_stats"),
    "workouts",
    "workout helpers",
    (),
    (
        make_func(
            '''
        def pace_per_km(seconds, km):
            """Pace for covering `km` kilometres in `seconds`, as 'M:SS' per kilometre.

            The seconds per kilometre are rounded to a whole number (Python's round) first; minutes
            are not padded, seconds always have 2 digits. '-' when `km` is 0 or less.
            """
            if km <= 0:
                return "-"
            per_km = round(seconds / km)
            return f"{per_km // 60}:{per_km % 60:02d}"
    ''',
            [(1500, 5), (1530, 5.0), (3600, 0), (1000, 3), (59, 1)],
            ("km_pace", "running_pace"),
        ),
        make_func(
            '''
        def heart_rate_zone(bpm, age):
            """Training zone 0 to 5 for a heart rate of `bpm` at `age`.

            The percent of the maximum heart rate (220 - age) is the whole number
            bpm * 100 // (220 - age). Zone 0 is below 50 percent, zone 1 is 50 to 59, zone 2 is 60
            to 69, zone 3 is 70 to 79, zone 4 is 80 to 89 and zone 5 is 90 or more.
            """
            percent = bpm * 100 // (220 - age)
            return min(5, max(0, percent // 10 - 4))
    ''',
            [(100, 20), (99, 20), (180, 20), (150, 20), (126, 40), (210, 20)],
            ("hr_zone", "training_zone"),
        ),
        make_func(
            '''
        def calories_burned(minutes, weight_kg, met):
            """Kilocalories burned in `minutes` of an activity of `met` by someone of `weight_kg`.

            The rate is met * 3.5 * weight_kg / 200 kcal per minute; the total is rounded to a whole
            number (Python's round).
            """
            return round(met * 3.5 * weight_kg / 200 * minutes)
    ''',
            [(30, 70, 8.0), (60, 80, 3.5), (0, 70, 8), (45, 55.5, 6.0), (10, 100, 10)],
            ("energy_used", "kcal_burned"),
        ),
        make_func(
            '''
        def workout_streak(minutes_per_day, min_minutes=20):
            """Longest run of consecutive days in `minutes_per_day` with at least `min_minutes` of exercise.

            0 when no day qualifies.
            """
            best = 0
            current = 0
            for minutes in minutes_per_day:
                if minutes >= min_minutes:
                    current += 1
                    if current > best:
                        best = current
                else:
                    current = 0
            return best
    ''',
            [([30, 25, 0, 40, 20, 45],), ([],), ([10, 19],), ([20],), ([60, 60, 5, 60], 30)],
            ("longest_streak", "active_streak"),
        ),
        make_func(
            '''
        def safe_mileage_increase(last_week_km, planned_km):
            """True if `planned_km` is at most 10 percent more than `last_week_km` (the 10 percent rule).

            Any plan no longer than last week is safe. After a week of 0 km (or less), plans of up
            to 5 km are safe.
            """
            if last_week_km <= 0:
                return planned_km <= 5
            return planned_km * 10 <= last_week_km * 11
    ''',
            [(20, 22), (20, 23), (20, 10), (0, 5), (0, 6), (1, 3)],
            ("within_ten_percent", "mileage_ok"),
        ),
        make_func(
            '''
        def one_rep_max(weight_kg, reps):
            """Estimated one-rep max (Epley formula): weight_kg * (1 + reps / 30), rounded to 1 decimal.

            A single rep gives `weight_kg` itself as a float, rounded to 1 decimal; 0 reps or fewer
            give 0.0.
            """
            if reps <= 0:
                return 0.0
            if reps == 1:
                return round(float(weight_kg), 1)
            return round(weight_kg * (1 + reps / 30), 1)
    ''',
            [(100, 5), (100, 1), (80, 0), (60, 10), (100, 2), (72.5, 3)],
            ("max_lift", "estimated_max"),
        ),
    ),
)

TICKETS = Domain(
    "tickets",
    ("ticketdesk", "event_tickets"),
    "box_office",
    "event ticketing helpers",
    ("re",),
    (
        make_func(
            '''
        def seat_price(row, base_cents):
            """Price in cents of a seat in `row` (row 1 is nearest the stage).

            Rows 1 to 5 cost 150 percent of `base_cents`, rows 6 to 15 cost `base_cents`, and rows
            from 16 on cost 80 percent of it; percentages are rounded down to whole cents.
            """
            if row <= 5:
                return base_cents * 150 // 100
            if row <= 15:
                return base_cents
            return base_cents * 80 // 100
    ''',
            [(1, 1999), (5, 2000), (6, 2000), (15, 2000), (16, 2000), (20, 999)],
            ("price_for_row", "row_price"),
        ),
        make_func(
            '''
        def group_total(count, price_cents, fee_cents=150):
            """Total in cents for `count` tickets at `price_cents` each plus `fee_cents` per ticket.

            Groups of 10 tickets or more get 10 percent off the ticket prices (not the fees),
            rounded down to whole cents. A `count` of 0 or less costs 0.
            """
            if count <= 0:
                return 0
            tickets = count * price_cents
            if count >= 10:
                tickets = tickets * 90 // 100
            return tickets + count * fee_cents
    ''',
            [(2, 2500), (10, 2500), (9, 2500), (-1, 2500), (12, 1999, 0), (1, 1000, 100)],
            ("order_total", "booking_total"),
        ),
        make_func(
            '''
        def is_sold_out(sold, capacity, held=0, hold_open=True):
            """True if no ticket is left for sale.

            That is when `sold` reaches `capacity`, or when `hold_open` is True and `sold` plus
            `held` (reserved but unpaid tickets) reaches `capacity`.
            """
            return sold >= capacity or (hold_open and sold + held >= capacity)
    ''',
            [(100, 100, 0, False), (99, 100), (95, 100, 5), (95, 100, 4), (95, 100, 5, False), (100, 100)],
            ("sold_out", "no_seats_left"),
        ),
        make_func(
            '''
        def ticket_refund(price_cents, days_before):
            """Refund in cents for a ticket of `price_cents` returned `days_before` the event.

            The whole price at 30 days or more, half of it (rounded down) from 7 to 29 days, and
            nothing under 7 days.
            """
            if days_before >= 30:
                return price_cents
            if days_before >= 7:
                return price_cents // 2
            return 0
    ''',
            [(4001, 30), (4001, 29), (4001, 7), (4001, 6), (4001, 45), (4001, 0)],
            ("refund_amount", "refund_for_return"),
        ),
        make_func(
            '''
        def first_row_with_seats(rows, party):
            """Number (from 1) of the first row with `party` adjacent free seats, or 0 if no row has.

            Each row is a string of seats, '.' for a free seat and 'X' for a taken one.
            """
            for number in range(1, len(rows) + 1):
                if "." * party in rows[number - 1]:
                    return number
            return 0
    ''',
            [
                (["XX..X", "X...X", "....."], 3),
                (["XX..X", "X...X"], 4),
                ([".X"], 1),
                ([], 2),
                (["XXXX", "X..X", "XX.."], 2),
            ],
            ("row_for_party", "find_row"),
        ),
        make_func(
            '''
        def parse_seat(code):
            """(row, seat) of a seat code such as 'C12': row 'A' is 1, 'B' is 2 and so on.

            The letter may be lower case and surrounding spaces are ignored. None unless the code
            is one letter followed by 1 to 3 digits giving a seat number of at least 1.
            """
            match = re.fullmatch(r"([A-Za-z])([0-9]{1,3})", code.strip())
            if match is None:
                return None
            seat = int(match.group(2))
            if seat < 1:
                return None
            return (ord(match.group(1).upper()) - ord("A") + 1, seat)
    ''',
            [("C12",), ("a1",), (" b7 ",), ("A0",), ("AB12",), ("Z1000",)],
            ("seat_from_code", "decode_seat"),
        ),
    ),
)

MORE_DOMAINS: tuple[Domain, ...] = (RECIPES, WEATHER, LIBRARY, PARKING, FITNESS, TICKETS)
