"""Domains of general-purpose helpers: 2-D geometry, text, grading and scheduling (the rules for a domain
are in domains.py)."""

from __future__ import annotations

from codefleet.tasks.families.domain_types import Domain
from codefleet.tasks.families.domain_types import make_func as _func

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
