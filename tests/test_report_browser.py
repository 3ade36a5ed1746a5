"""report.html and a transcript page in a real headless Chromium (Debian's, driven by Playwright): sort, filter by
category, finding, step and reward ranges, open a transcript, expand a long output; screenshots checked not blank.
`make test-report` installs the browser (scripts/setup_browser.sh) and sets CODEFLEET_REQUIRE_BROWSER=1, so CI
fails rather than skips when it is missing."""

from __future__ import annotations

import os
import pathlib

import pytest
import report_sample as sample
from browser_check import CHROMIUM, assert_not_blank, browser_missing, check_report_in_browser

from codefleet.analysis.report import write_report

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture(scope="module")
def browser_ready():
    reason = browser_missing()
    if reason and os.environ.get("CODEFLEET_REQUIRE_BROWSER"):
        pytest.fail(f"CODEFLEET_REQUIRE_BROWSER is set but {reason}")
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("report")
    write_report(str(out_dir), sample.summary(), sample.tables(), sample.details())
    return out_dir


def test_report_sorts_filters_and_opens_transcripts_in_chromium(browser_ready, out, tmp_path):
    seen = check_report_in_browser(str(out), str(tmp_path / "shots"))
    assert seen["table"] == "rollouts"
    assert seen["sorted"]["ascending"] != seen["sorted"]["before"]  # the sample is not in that order to start with
    category = seen["filtered"]["category"]
    assert seen["filtered"]["shown"] == sum(r.get("category") == category for r in sample.rows()) > 0
    assert "/rollouts/" in seen["transcript"]
    assert all(pathlib.Path(p).stat().st_size > 5_000 for p in seen["screenshots"].values())


def _visible_tasks(page, table_id: str = "rollouts") -> list[str]:
    return page.eval_on_selector_all(
        f"#{table_id} tbody tr:not([hidden])", "rows => rows.map(r => r.cells[2].innerText)"
    )


def test_flag_step_and_reward_filters_and_a_long_output_expand(browser_ready, out, tmp_path):
    from playwright.sync_api import sync_playwright  # optional: the `browser` extra

    rows = sample.rows()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto((out / "report.html").as_uri())
            page.select_option("#f-flag", value="tests_edited")
            assert _visible_tasks(page) == ["calc-8"] and _visible_tasks(page, "worst_failures") == []
            page.select_option("#f-flag", value="")
            page.check("#f-suspicious")
            assert _visible_tasks(page) == ["calc-8"]
            page.click("#f-reset")
            page.fill("#f-step-min", "1")
            page.fill("#f-step-max", "2")
            expected = [r["task_id"] for r in rows if r.get("step") is not None and 1 <= r["step"] <= 2]
            assert _visible_tasks(page) == expected and len(expected) >= 4  # rows without a step drop out
            page.fill("#f-reward-min", "0.2")
            expected = [
                r["task_id"]
                for r in rows
                if r.get("step") is not None
                and 1 <= r["step"] <= 2
                and r.get("reward") is not None
                and r["reward"] >= 0.2
            ]
            assert _visible_tasks(page) == expected
            assert page.inner_text('.count[data-for="rollouts"]') == f"{len(expected)} of {len(rows)} rows shown"
            page.click("#f-reset")
            page.locator("#rollouts a.rollout", has_text="calc-1").first.click()
            page.wait_for_load_state("load")
            long_output = page.locator("details", has=page.locator("summary", has_text="show all 5,018 characters"))
            rest = long_output.locator("pre")
            assert not rest.is_visible()
            long_output.locator("summary").click()
            assert rest.is_visible() and len(rest.inner_text()) == 5_018 - 2_000
            shot = str(tmp_path / "expanded.png")
            page.screenshot(path=shot)
            assert_not_blank(shot)
            page.click("text=back to the report")
            assert page.url.endswith("/report.html")
        finally:
            browser.close()
