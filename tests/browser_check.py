"""Drive an analysis directory (report.html + rollouts/) in a real headless Chromium, as a researcher would.

`check_report_in_browser(out_dir, shots_dir)` works on any directory write_report produced: it sorts the first
table with rows by a numeric column, filters by the first category present, opens the first transcript that has a
tool call, expands a collapsed <details>, and saves a screenshot at each stage, each checked not blank. The browser
is Debian's /usr/bin/chromium driven by Playwright (scripts/setup_browser.sh installs both; nothing is
downloaded at run time). Any script error, dialog (an injected alert()) or blocked load (the pages' CSP) fails
the check.
"""

from __future__ import annotations

import os
import pathlib

CHROMIUM = "/usr/bin/chromium"


def browser_missing() -> str | None:
    """Why the browser check cannot run here, or None."""
    if not os.access(CHROMIUM, os.X_OK):
        return f"{CHROMIUM} is missing: run scripts/setup_browser.sh (Debian's chromium package)"
    try:
        import playwright.sync_api  # noqa: F401  (optional: the `browser` extra)
    except ImportError:
        return "playwright is not installed in this environment: run scripts/setup_browser.sh"
    return None


def assert_not_blank(png_path: str, min_colours: int = 8) -> None:
    """The screenshot shows something: several distinct colours and nonzero variance."""
    from PIL import Image, ImageStat  # Pillow: installed with matplotlib

    with Image.open(png_path) as image:
        rgb = image.convert("RGB")
        colours = rgb.getcolors(maxcolors=1 << 20) or []
        spread = max(ImageStat.Stat(rgb).stddev)
    assert len(colours) >= min_colours and spread > 5.0, (
        f"{png_path} looks blank: {len(colours)} colours, channel stddev {spread:.1f}"
    )


def _numbers(page, table_id: str, column: int) -> list[float | None]:
    values = page.eval_on_selector_all(
        f"#{table_id} tbody tr", f"rows => rows.map(r => r.cells[{column}].getAttribute('data-v'))"
    )
    return [float(v) if v not in (None, "") else None for v in values]


def _check_sorted(values: list[float | None], ascending: bool) -> None:
    known = [v for v in values if v is not None]
    assert values[: len(known)] == known, f"empty cells are not last: {values}"
    assert known == sorted(known, reverse=not ascending), f"not sorted {'up' if ascending else 'down'}: {values}"


def _sort(page, table_id: str) -> dict:
    """Click the first numeric header whose column holds two different numbers; check both directions."""
    headers = page.eval_on_selector_all(f"#{table_id} thead th", "hs => hs.map(h => h.getAttribute('data-type'))")
    for column, kind in enumerate(headers):
        before = _numbers(page, table_id, column)
        if kind != "num" or len({v for v in before if v is not None}) < 2:
            continue
        header = page.locator(f"#{table_id} thead th").nth(column)
        header.click()
        up = _numbers(page, table_id, column)
        _check_sorted(up, ascending=True)
        assert header.get_attribute("aria-sort") == "ascending"
        header.click()
        down = _numbers(page, table_id, column)
        _check_sorted(down, ascending=False)
        return {"column": header.inner_text().strip(), "before": before, "ascending": up, "descending": down}
    raise AssertionError(f"table {table_id} has no numeric column with two different values to sort by")


def _filter(page, table_id: str) -> dict:
    """Filter by the first category present; only its rows stay visible and the count says so."""
    categories = page.eval_on_selector_all(f"#{table_id} tbody tr", "rows => rows.map(r => r.dataset.category)")
    category = next((c for c in categories if c), None)
    assert category, f"no row of table {table_id} has a category to filter by"
    page.select_option("#f-category", value=category)
    expected = sum(c == category for c in categories)
    visible = page.eval_on_selector_all(
        f"#{table_id} tbody tr:not([hidden])", "rows => rows.map(r => r.dataset.category)"
    )
    assert visible == [category] * expected, f"filter {category!r} shows {visible}"
    assert page.locator(f"#{table_id} tbody tr:visible").count() == expected
    count = page.locator(f'.count[data-for="{table_id}"]').inner_text()
    assert count == f"{expected} of {len(categories)} rows shown", count
    return {"category": category, "shown": expected, "of": len(categories), "count_text": count}


def _open_transcript(page, report_url: str, table_id: str, need_tool_call: bool) -> str:
    """Open the rollout links of `table_id` in order until a transcript with a tool call (the first transcript
    when `need_tool_call` is false); returns its URL."""
    hrefs = page.eval_on_selector_all(f"#{table_id} a.rollout", "links => links.map(a => a.getAttribute('href'))")
    assert hrefs, f"no rollout in table {table_id} links to a transcript"
    for index in range(min(len(hrefs), 10)):
        if index:
            page.goto(report_url)
        page.locator(f"#{table_id} a.rollout").nth(index).click()
        page.wait_for_load_state("load")
        assert page.url.endswith(hrefs[index]), (page.url, hrefs[index])
        task = page.locator("h2:text-is('Task') + pre")
        assert task.count() == 1 and task.inner_text().strip(), "the transcript page shows no task"
        if page.locator(".call .tool").count() or not need_tool_call:
            return page.url
    raise AssertionError(f"none of the first {min(len(hrefs), 10)} transcripts of {table_id} shows a tool call")


def check_report_in_browser(out_dir: str, shots_dir: str, need_tool_call: bool = True) -> dict:
    """Check report.html and a transcript page in headless Chromium (see the module docstring); returns what it
    saw: the sorted column, the filter, the transcript opened and the screenshots."""
    from playwright.sync_api import sync_playwright  # optional: the `browser` extra

    os.makedirs(shots_dir, exist_ok=True)
    report_url = pathlib.Path(out_dir, "report.html").resolve().as_uri()
    shots = {name: os.path.join(shots_dir, f"{name}.png") for name in ("report", "filtered", "transcript")}
    problems: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda e: problems.append(f"script error: {e}"))
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
            page.on("dialog", lambda d: (problems.append(f"a script opened a dialog: {d.message}"), d.dismiss()))
            page.goto(report_url)
            page.screenshot(path=shots["report"], full_page=False)
            table_id = next(
                (
                    t
                    for t in ("rollouts", "worst_failures", "suspicious_wins")
                    if page.locator(f"#{t} tbody tr").count()
                ),
                None,
            )
            assert table_id, f"{report_url} has no table with rows to sort, filter and open"
            page.locator(f"#{table_id}").scroll_into_view_if_needed()
            sorted_ = _sort(page, table_id)
            filtered = _filter(page, table_id)
            page.locator("#filters").scroll_into_view_if_needed()
            page.screenshot(path=shots["filtered"])
            page.click("#f-reset")
            rows = page.locator(f"#{table_id} tbody tr:visible").count()
            assert page.locator(f'.count[data-for="{table_id}"]').inner_text() == f"{rows} of {rows} rows shown"
            transcript_url = _open_transcript(page, report_url, table_id, need_tool_call)
            details = page.locator("details").first
            details.locator("summary").click()
            assert details.evaluate("d => d.open"), "a <details> did not open on click"
            details.scroll_into_view_if_needed()
            page.screenshot(path=shots["transcript"])
        finally:
            browser.close()
    assert not problems, f"the browser reported: {problems}"
    for path in shots.values():
        assert_not_blank(path)
    return {
        "table": table_id,
        "sorted": sorted_,
        "filtered": filtered,
        "transcript": transcript_url,
        "screenshots": shots,
    }
