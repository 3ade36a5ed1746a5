"""Training domains of quantities measured and summed up: recipes, weather and workouts (more_domains.py
says what the more domains are for; the rules for a domain are in domains.py)."""

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
