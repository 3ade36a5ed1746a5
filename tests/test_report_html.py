"""report.html and the transcript pages, as files: links, contents, caps, escaping, stale pages (no browser, no Ray).
tests/test_report_browser.py drives the same output in a real Chromium."""

from __future__ import annotations

import html
import os
import re

import pytest
import report_sample as sample

from codefleet.analysis.report import transcript_path, write_report
from codefleet.analysis.transcript import PAGE_CAP_BYTES, PREVIEW_CHARS, render_transcript

CSP_META = (
    '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; img-src data:; '
    "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">"
)


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """One analysis directory written from the sample (pages are slow-ish: the huge output)."""
    out_dir = tmp_path_factory.mktemp("report")
    write_report(str(out_dir), sample.summary(), sample.tables(), iter(sample.details()))  # a generator is fine
    return out_dir


def _page(out, rollout_id: str) -> str:
    return (out / transcript_path(rollout_id)).read_text(encoding="utf-8")


def _rows_of(report: str, table_id: str) -> list[str]:
    body = report.split(f'id="{table_id}"')[1].split("</tbody>")[0]
    return re.findall(r"<tr[ >].*?</tr>", body.split("<tbody>")[1])


def test_every_row_with_a_page_links_to_it_and_no_link_is_dead(out):
    report = (out / "report.html").read_text(encoding="utf-8")
    with_page = {d["rollout_id"] for d in sample.details()}
    for table_id, rows in sample.tables().items():
        rendered = _rows_of(report, table_id)
        assert len(rendered) == len(rows), table_id
        for row, tr in zip(rows, rendered):
            links = re.findall(r'href="([^"]+)"', tr)
            expected = [html.escape(transcript_path(row["rollout_id"]))] if row["rollout_id"] in with_page else []
            assert links == expected, (table_id, row["rollout_id"])
    hrefs = set(re.findall(r'href="([^"]+)"', report))
    assert hrefs and all((out / html.unescape(h)).is_file() for h in hrefs)
    assert len(os.listdir(out / "rollouts")) == len(with_page)
    assert f"{len(sample.rows())} of {len(sample.rows())} rows shown" in report


def test_report_reads_overview_then_clusters_then_figures(out):
    report = (out / "report.html").read_text(encoding="utf-8")
    order = [
        report.index(s)
        for s in (
            'class="overview"',
            "Reasons, grouped",
            "Key figures",
            "<h2>Plots",
            "<h2>Suspicious wins",
            "<h2>Worst failures",
            "<h2>Rollouts",
        )
    ]
    assert order == sorted(order)
    failures = report.split('id="clusters-failures"')[1].split("</table>")[0]
    assert f'href="{transcript_path("run-a/step-1/calc-1/0")}"' in failures
    assert "run-a/step-3/no-page/0" in failures and transcript_path("run-a/step-3/no-page/0") not in failures
    assert "grouped by finding and stop reason" in report
    assert len(re.findall(r'<img alt="" src="data:image/png;base64,[A-Za-z0-9+/=]{200,}">', report)) == 7
    # the filter bar offers what the rows hold; the rows carry their filter keys
    for option in ("wrong_answer", "strings", "tests_edited", "skip_added"):
        assert f'<option value="{option}">' in report
    win = _rows_of(report, "suspicious_wins")[0]
    assert 'data-flags="skip_added tests_edited"' in win and 'data-suspicious="1"' in win and 'data-step="2.0"' in win


def test_transcript_page_shows_task_turns_calls_outputs_diff_checks_and_judge(out):
    page = _page(out, "run-a/step-0/calc-4/0")
    order = [
        page.index(s)
        for s in (
            html.escape(sample.TASK_TEXT),
            "turn 1 · assistant",
            "Let me read the file",
            "read_file",
            "turn 2 · assistant",
            "edit_file",
            "<h2>Diff",
            "<h2>Checks",
            "<h2>Judge",
        )
    ]
    assert order == sorted(order)
    assert html.escape('{\n  "path": "pkg/calc.py"\n}') in page  # arguments as indented JSON
    assert "pytest -q {not json" in page  # arguments that do not parse: as given
    assert html.escape("def add(a, b):\n    return a - b") in page  # the matching tool output
    assert '<span class="add">+    return a + b</span>' in page and '<span class="del">-    return a - b</span>' in page
    checks = page.split("<h2>Checks</h2>")[1]
    assert checks.index("✗ failed: tests/test_calc.py::test_sub") < checks.index("✓ passed: tests/test_calc.py::")
    assert "1 of 2 failed" in checks
    assert "1 (correctness 0.5, costs -0.05)" in page  # the reward and its parts
    assert "exit code 1" in page and "0.012 s" in page  # the store's per-call record, matched to its call
    assert 'href="../report.html"' in page and "reads well" in page and "1234" in page


def test_long_outputs_are_capped_and_expandable_and_pages_stay_under_the_cap(out):
    page = _page(out, "run-a/step-1/calc-1/0")
    output = "collected 3 items\n" + "x" * 5_000
    assert f"show all {len(output):,} characters" in page
    assert f"<pre>{output[:PREVIEW_CHARS]}</pre><details>" in page and output[PREVIEW_CHARS:] in page
    huge = _page(out, "run-a/step-3/calc-3/0")
    assert len(huge.encode()) < PAGE_CAP_BYTES
    assert "HUGE-START" in huge and "cut: the page is capped at 2 MB" in huge
    assert huge.index("HUGE-START") < huge.index("edit_file") < huge.index("Done: add now adds.")  # turns after it
    assert "<h2>Judge</h2>" in huge and "reads well" in huge
    for name in os.listdir(out / "rollouts"):
        assert (out / "rollouts" / name).stat().st_size < PAGE_CAP_BYTES


def test_hostile_strings_are_only_ever_shown_escaped(out):
    files = [out / "report.html", *(out / "rollouts").iterdir()]
    for path in files:
        text = path.read_text(encoding="utf-8")
        assert CSP_META in text, path.name
        assert sample.HOSTILE_TAG not in text and "<img src=x" not in text and "alert(1)</script>" not in text
        assert text.count("<script") == (1 if path.name == "report.html" else 0), path.name
    report = (out / "report.html").read_text(encoding="utf-8")
    assert html.escape(sample.HOSTILE_TAG) in report and html.escape(sample.HOSTILE_SCRIPT) in report
    page = _page(out, f"run-a/step-1/{sample.HOSTILE_TAG}/0")
    assert html.escape(sample.HOSTILE_SCRIPT) in page and html.escape("judge said: " + sample.HOSTILE_TAG) in page


def test_old_rows_and_empty_details_render(out):
    report = (out / "report.html").read_text(encoding="utf-8")
    old = next(tr for tr in _rows_of(report, "rollouts") if "old-task" in tr)
    assert 'data-step=""' in old and 'data-reward=""' in old and 'data-category="error"' in old
    assert old.count('<td data-v=""></td>') == 8  # every numeric cell empty, so it sorts last
    page = _page(out, "old-store/rollout-1")
    assert "no diff" in page and "✗ failed: t_old" in page and "no task message recorded" in page
    assert "transcript not recorded; the store's tool calls" in page  # the per-call records stand in
    assert '<span class="tool">run</span> <span class="bad">failed</span> <span class="bad">timed out</span>' in page
    assert html.escape('{\n  "command": "pytest"\n}') in page
    assert "<li>tests_edited: tests/test_old.py</li>" in page and "none (correctness 0.25)" in page
    assert "<td>reward.correctness</td><td>0.25</td>" in page


def test_transcript_paths_are_safe_and_unique():
    ids = ["a/b", "a_b", "a b", "../../etc/passwd", "x" * 500, "é/ü", ""]
    paths = [transcript_path(i) for i in ids]
    assert len(set(paths)) == len(ids)
    assert all(re.fullmatch(r"rollouts/[A-Za-z0-9][A-Za-z0-9_.-]{0,60}-[0-9a-f]{12}\.html", p) for p in paths), paths


def test_a_second_analysis_removes_the_pages_of_the_first(tmp_path):
    write_report(str(tmp_path), sample.summary(), sample.tables(), sample.details(huge_output=False))
    (tmp_path / "rollouts" / ".leftover.tmp").write_text("from a crashed write")
    kept = [d for d in sample.details(huge_output=False) if d["rollout_id"] == "run-a/step-0/calc-4/0"]
    tables = {"worst_failures": [], "suspicious_wins": [], "rollouts": [sample.rows()[4]]}
    write_report(str(tmp_path), sample.summary(), tables, kept)
    assert os.listdir(tmp_path / "rollouts") == [os.path.basename(transcript_path("run-a/step-0/calc-4/0"))]
    report = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert len(_rows_of(report, "rollouts")) == 1 and 'id="worst_failures"' not in report


def test_a_page_stays_under_the_cap_and_keeps_its_diff_and_checks_whatever_the_transcript_holds():
    messages = [{"role": "user", "content": "the task"}]
    for i in range(3_000):  # ~100 MB of escaped text in all
        messages += [
            {
                "role": "assistant",
                "content": "é" * 3_000,
                "tool_calls": [
                    {"id": f"c{i}", "type": "function", "function": {"name": "run", "arguments": "<" * 5_000}}
                ],
            },
            {"role": "tool", "tool_call_id": f"c{i}", "content": "&" * 10_000},
        ]
    detail = {
        "rollout_id": "big",
        "transcript": messages,
        "diff": "+<added>\n" * 1_000_000,
        "per_test": [{"test": f"t{i}", "passed": i % 2 == 0} for i in range(50_000)],
        "findings": ["tests_edited: x"] * 10_000,
        "metadata": {f"task.k{i}": "v" * 5_000 for i in range(1_000)},
    }
    page = render_transcript(detail)
    assert len(page.encode()) < PAGE_CAP_BYTES
    assert re.search(r"messages \d+-6001 of 6001 cut: the page is capped at 2 MB", page)
    assert '<span class="add">+&lt;added&gt;</span>' in page and "diff lines" in page  # the diff kept its share
    assert "✗ failed: t1</li>" in page and "25000 of 50000 failed" in page


def test_a_summary_without_overview_clusters_or_browse_renders(tmp_path):
    summary = {k: v for k, v in sample.summary().items() if k not in ("overview", "clusters", "browse")}
    write_report(str(tmp_path), summary, {"worst_failures": sample.rows()[:2]}, [])
    report = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert 'class="overview"' not in report and "Reasons, grouped" not in report
    assert len(_rows_of(report, "worst_failures")) == 2 and "href=" not in report  # no pages: plain text
    assert os.listdir(tmp_path / "rollouts") == []


def test_labels_matplotlib_would_read_as_math_text_are_drawn_as_typed(tmp_path):
    """A tool or family name is the rollout's to choose: `$\\foo$` (bad math text) must not cost the run its report."""
    summary = sample.summary()
    summary["tool_mix"] = {r"$\foo$": 3, r"$x^{$": 2, "run": 1, r"\$$\frac{1}{0$": 1}
    summary["per_family"] = {**summary["per_family"], r"$\bar$": summary["per_family"]["calc"]}
    write_report(str(tmp_path), summary, sample.tables(), [])
    report = (tmp_path / "report.html").read_text(encoding="utf-8")
    assert len(re.findall(r'<img alt="" src="data:image/png;base64,[A-Za-z0-9+/=]{200,}">', report)) == 7
