"""report.html and one transcript page per rollout: a self-contained directory that opens from disk.

`write_report(out_dir, summary, tables, details)` writes

    out_dir/report.html             overview, clusters, KPIs, plots, outcomes, then three tables
    out_dir/rollouts/<slug>.html    one page per rollout in `details` (transcript.py), at transcript_path(id)

report.html reads top to bottom as a researcher asks: the overview paragraph (what won, what lost and why), the
clusters of failure reasons and of suspicious wins (label, count, example rollouts), the KPIs, the plots
(report_plots.py), the outcome counts, then the tables: suspicious wins, worst failures and a browse table (every
rollout of a small run, a uniform sample of a big one). Every row whose rollout has a page links to it; an id
without a page is plain text, never a dead link.

The tables are rendered as HTML rows carrying their filter keys in data-* attributes (category, family, step,
reward, finding kinds, suspicious); an inline script (report.js) sorts on a header click (numbers numerically,
empty cells last) and hides the rows the filter bar excludes, with a count of rows shown. No rollout data is ever
placed inside the script, and every text is escaped (html_page.esc), so a transcript holding markup or
`</script>` is only ever shown as text; the pages' Content-Security-Policy forbids any network fetch besides.

Each file is written atomically (temporary file + os.replace). Pages are written first, then report.html, then
the pages an earlier analysis left in rollouts/ that this one did not write are removed: the directory always
holds exactly the pages the current report links to once write_report returns. Every write and removal goes
through codefleet.store.safe_files beneath `root` (the directory the user named: OUT, or RUN_DIR for the default
RUN_DIR/analysis): a link planted anywhere below it (analysis/, rollouts/, a page) is refused, never followed.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from importlib import resources

from codefleet.analysis.html_page import as_list, esc, fmt, number, page, write_atomic
from codefleet.analysis.report_plots import plots
from codefleet.analysis.transcript import render_transcript
from codefleet.store import safe_files

PAGES_DIR = "rollouts"
# (row key, header, "num" | "str"): the columns of the three tables, in order.
COLUMNS = [
    ("run", "run", "str"),
    ("step", "step", "num"),
    ("task_id", "task", "str"),
    ("family", "family", "str"),
    ("attempt", "attempt", "num"),
    ("category", "category", "str"),
    ("stop_reason", "stop reason", "str"),
    ("reward", "reward", "num"),
    ("checks", "checks", "num"),
    ("turns", "turns", "num"),
    ("n_tool_calls", "tool calls", "num"),
    ("wall_s", "wall s", "num"),
    ("findings", "findings", "str"),
    ("judge_score", "judge score", "num"),
    ("judge_reason", "judge reason", "str"),
    ("judge_error", "judge error", "str"),
]
CELL_CHARS = 300  # a long text cell is cut here (the transcript page has it whole)
TABLES = [
    (
        "suspicious_wins",
        "Suspicious wins",
        "Solved, but the diff edits or deletes tests, skips checks or hard-codes outputs.",
    ),
    ("worst_failures", "Worst failures", "Lowest judge score first, then the longest."),
    ("rollouts", "Rollouts", ""),
]


def transcript_path(rollout_id: str) -> str:
    """The transcript page of `rollout_id`, relative to the output directory: a readable, filesystem-safe prefix
    of the id and a short sha1 of the whole id (unique per id, whatever characters it holds)."""
    readable = re.sub(r"[^A-Za-z0-9_.-]+", "_", str(rollout_id)).strip("._-")[:48] or "rollout"
    return f"{PAGES_DIR}/{readable}-{hashlib.sha1(str(rollout_id).encode()).hexdigest()[:12]}.html"


def finding_kind(finding: object) -> str:
    """The kind of a rule finding ("tests_edited: tests/test_x.py" -> "tests_edited"), one token."""
    return re.sub(r"\s+", "_", str(finding).split(":", 1)[0].strip()) or "finding"


def _link(rollout_id: object, text: str, pages: set[str]) -> str:
    """`text` linking to the rollout's page when it has one, else plain."""
    if rollout_id is None or str(rollout_id) not in pages:
        return esc(text)
    return f'<a class="rollout" href="{esc(transcript_path(str(rollout_id)))}">{esc(text)}</a>'


def _sort_key(x: float | None) -> str:
    """A numeric cell's data-v: the number, or "" (sorted last)."""
    return "" if x is None else repr(x)


def _cell(row: dict, key: str, kind: str, pages: set[str]) -> str:
    if key == "checks":
        passed, total = number(row.get("checks_passed")), number(row.get("checks_total"))
        text = f"{fmt(row.get('checks_passed'))}/{fmt(row.get('checks_total'))}" if total is not None else ""
        value = passed / total if passed is not None and total else None
        return f'<td data-v="{_sort_key(value)}">{esc(text)}</td>'
    value = row.get(key)
    text = fmt(value)
    if kind == "num":
        x = number(value)
        return f'<td data-v="{_sort_key(x)}">{esc(text)}</td>'
    if len(text) > CELL_CHARS:
        text = text[:CELL_CHARS] + "…"
    if key == "task_id":
        return f"<td>{_link(row.get('rollout_id'), text or str(row.get('rollout_id') or '?'), pages)}</td>"
    return f"<td>{esc(text)}</td>"


def _row(row: dict, pages: set[str]) -> str:
    kinds = sorted({finding_kind(f) for f in as_list(row.get("findings"))})
    step, reward = number(row.get("step")), number(row.get("reward"))
    attrs = {
        "data-category": fmt(row.get("category")),
        "data-family": fmt(row.get("family")),
        "data-step": _sort_key(step),
        "data-reward": _sort_key(reward),
        "data-flags": " ".join(kinds),
        "data-suspicious": "1" if row.get("suspicious") else "0",
    }
    cls = ' class="sus"' if row.get("suspicious") else ""
    attr_html = "".join(f' {k}="{esc(v)}"' for k, v in attrs.items())
    return f"<tr{cls}{attr_html}>" + "".join(_cell(row, k, t, pages) for k, _, t in COLUMNS) + "</tr>"


def _table(table_id: str, rows: list[dict], pages: set[str]) -> str:
    if not rows:
        return '<p class="muted">none</p>'
    head = "".join(f'<th data-type="{t}" title="sort by {esc(label)}">{esc(label)}</th>' for _, label, t in COLUMNS)
    body = "".join(_row(r, pages) for r in rows)
    return (
        f'<p class="count" data-for="{table_id}">{len(rows)} of {len(rows)} rows shown</p>'
        f'<table class="rows" id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
    )


def _options(values: Iterable[str]) -> str:
    return '<option value="">all</option>' + "".join(
        f'<option value="{esc(v)}">{esc(v)}</option>' for v in sorted(set(values) - {""})
    )


def _filters(rows: list[dict]) -> str:
    """The filter bar: category, family, step and reward ranges, a finding kind, suspicious only."""
    kinds = {finding_kind(f) for r in rows for f in as_list(r.get("findings"))}
    return (
        '<div id="filters">'
        f'<label>category <select id="f-category">{_options(fmt(r.get("category")) for r in rows)}</select></label>'
        f'<label>family <select id="f-family">{_options(fmt(r.get("family")) for r in rows)}</select></label>'
        '<label>step <input id="f-step-min" type="number" step="any" placeholder="min"> – '
        '<input id="f-step-max" type="number" step="any" placeholder="max"></label>'
        '<label>reward <input id="f-reward-min" type="number" step="any" placeholder="min"> – '
        '<input id="f-reward-max" type="number" step="any" placeholder="max"></label>'
        f'<label>finding <select id="f-flag">{_options(kinds)}</select></label>'
        '<label><input id="f-suspicious" type="checkbox"> suspicious only</label>'
        '<button id="f-reset" type="button">reset</button></div>'
    )


def _clusters(summary: dict, pages: set[str]) -> str:
    clusters = summary.get("clusters") or {}
    if not clusters:
        return ""
    parts = [
        f'<h2>Reasons, grouped</h2><p class="muted">clusters from the {esc(clusters.get("source") or "?")}'
        + (f": {esc(clusters['note'])}" if clusters.get("note") else "")
        + "</p>"
    ]
    for key, title in (("failures", "Failures"), ("suspicious_wins", "Suspicious wins")):
        items = [c for c in as_list(clusters.get(key)) if isinstance(c, dict)]
        rows = "".join(
            f"<tr><td>{esc(c.get('label'))}</td><td>{esc(fmt(c.get('count')))}</td><td>"
            + ", ".join(_link(e, str(e), pages) for e in as_list(c.get("examples"))[:10])
            + "</td></tr>"
            for c in items
        )
        parts.append(
            f"<h3>{title}</h3>"
            + (
                f'<table class="clusters" id="clusters-{key}"><tr><th>reason</th>'
                f"<th>rollouts</th><th>examples</th></tr>{rows}</table>"
                if rows
                else '<p class="muted">none</p>'
            )
        )
    return "".join(parts)


def _kpis(summary: dict) -> str:
    rate, judge, quantiles = summary.get("success_rate"), summary.get("judge") or {}, summary.get("quantiles") or {}

    def p50_p90(column: str) -> str:
        q = quantiles.get(column) or {}
        return f"{fmt(q.get('p50'))} / {fmt(q.get('p90'))}"

    kpis = [
        ("rollouts", summary.get("rollouts")),
        ("success rate", f"{rate:.1%}" if rate is not None else "-"),
        ("suspicious wins", summary.get("suspicious_wins")),
        ("turns p50 / p90", p50_p90("turns")),
        ("wall s p50 / p90", p50_p90("wall_s")),
        ("judge", f"{judge.get('backend')} ({judge.get('scored')} scored, {judge.get('errors')} errors)"),
    ]
    return "".join(f'<span class="kpi"><b>{esc(v)}</b>{esc(k)}</span>' for k, v in kpis)


def render(summary: dict, tables: dict, pages: set[str]) -> str:
    """The report page as a string; `pages`: the rollout ids that have a transcript page."""
    overview = f'<p class="overview">{esc(summary["overview"])}</p>' if summary.get("overview") else ""
    categories = "".join(
        f"<tr><td>{esc(k)}</td><td>{esc(v)}</td></tr>" for k, v in (summary.get("categories") or {}).items()
    )
    problems = (summary.get("files") or {}).get("skipped_or_upgraded") or []
    problem_html = (
        "<h2>Input problems</h2><ul>" + "".join(f"<li>{esc(p)}</li>" for p in problems) + "</ul>" if problems else ""
    )
    browse = summary.get("browse") or {}
    notes = {
        "rollouts": (
            f"A uniform sample: {browse['shown']:,} of {browse['of']:,} rollouts."
            if browse.get("shown") is not None and browse.get("of") and browse["shown"] < browse["of"]
            else "Every rollout."
        )
    }
    all_rows = [r for name, _, _ in TABLES for r in (tables.get(name) or [])]
    sections = "".join(
        f"<section><h2>{title}</h2><p class='muted'>{esc(notes.get(name, note))}</p>"
        f"{_table(name, tables.get(name) or [], pages)}</section>"
        for name, title, note in TABLES
    )
    body = (
        f"<h1>Rollout analysis — {esc(summary.get('store', ''))}</h1>{overview}{_clusters(summary, pages)}"
        f"<h2>Key figures</h2><div>{_kpis(summary)}</div>"
        f"<h2>Plots</h2><div class='plots'>{''.join(plots(summary))}</div>"
        f"<h2>Outcomes</h2><table><tr><th>category</th><th>rollouts</th></tr>{categories}</table>"
        f"<h2>Tables</h2><p class='muted'>Click a header to sort; a task opens its transcript.</p>"
        f"{_filters(all_rows)}{sections}{problem_html}"
    )
    script = resources.files("codefleet.analysis").joinpath("report.js").read_text(encoding="utf-8")
    return page("codefleet analysis", body, script)


def _remove_stale(root: str, page_dir: str, keep: set[str]) -> None:
    for name in safe_files.listdir_beneath(root, page_dir):
        if name not in keep:
            safe_files.remove_beneath(root, os.path.join(page_dir, name))


def write_report(out_dir: str, summary: dict, tables: dict, details: Iterable[dict], root: str | None = None) -> None:
    """Write out_dir/report.html and a transcript page per rollout in `details` (see the module docstring).
    `root`: the directory the user named, out_dir or one above it (default out_dir); nothing below it is
    reached through a link."""
    root = root or out_dir
    page_dir = os.path.join(out_dir, PAGES_DIR)
    safe_files.makedirs_beneath(root, page_dir)
    pages, files = set(), set()
    for detail in details:
        if not isinstance(detail, dict) or detail.get("rollout_id") is None:
            continue  # nothing to name its page by
        rollout_id = str(detail["rollout_id"])
        relative = transcript_path(rollout_id)
        write_atomic(os.path.join(out_dir, relative), render_transcript(detail), root)
        pages.add(rollout_id)
        files.add(os.path.basename(relative))
    write_atomic(os.path.join(out_dir, "report.html"), render(summary, tables, pages), root)
    _remove_stale(root, page_dir, files)
