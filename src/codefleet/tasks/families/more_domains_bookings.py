"""Training domains of things lent, parked and booked: library loans, a parking garage and event tickets
(more_domains.py says what the more domains are for; the rules for a domain are in domains.py)."""

from __future__ import annotations

from codefleet.tasks.families.domain_types import Domain, make_func

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
