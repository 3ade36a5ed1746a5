"""report.html: one self-contained page (no network, no external files) from summary.json.

Plots are drawn with matplotlib's Agg backend and embedded as base64 PNG
`<img>` tags: success over steps, success per family (stacked by failure
category), turn / wall-clock / token distributions (the summary's fixed 1-2-5
bins, log x axis), the tool-use mix and parallel calls per turn. Then two
tables: the worst failures (lowest judge score first) and the suspicious wins
(solved, but tests edited or deleted, checks skipped or outputs hard-coded).
Everything shown is escaped; nothing from a rollout is interpreted as HTML.
"""

from __future__ import annotations

import base64
import html
import io
import os
import tempfile

from matplotlib.figure import Figure

from codefleet.analysis.rules import CATEGORIES

_STYLE = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}table{border-collapse:collapse;font-size:13px;width:100%}
td,th{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}th{background:#f4f4f4}
.plots{display:flex;flex-wrap:wrap;gap:8px}.plots img{width:380px;border:1px solid #eee}
.kpi{display:inline-block;margin-right:24px}.kpi b{font-size:20px;display:block}.muted{color:#777}"""


def _png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=80)
    return f'<img alt="" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def _plots(summary: dict) -> list[str]:
    images = []
    steps = [s for s in summary["per_step"] if s["step"] is not None]  # rows without a step: in the totals only
    fig = Figure(figsize=(5, 3.2))
    ax = fig.subplots()
    ax.plot([s["step"] for s in steps], [s["success_rate"] for s in steps], marker="o", ms=3)
    ax.set(title="success rate over steps", xlabel="step", ylabel="solved fraction", ylim=(0, 1))
    images.append(_png(fig))

    families = summary["per_family"]
    fig = Figure(figsize=(5, 3.2))
    ax = fig.subplots()
    names = list(families)
    bottom = [0.0] * len(names)
    for category in CATEGORIES:
        share = [families[f]["categories"].get(category, 0) / max(1, families[f]["rollouts"]) for f in names]
        if any(share):
            ax.bar(names, share, bottom=bottom, label=category)
            bottom = [b + s for b, s in zip(bottom, share)]
    ax.set(title="outcome per family", ylabel="fraction of rollouts", ylim=(0, 1))
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    images.append(_png(fig))

    for column, label in (("turns", "turns"), ("wall_s", "wall clock (s)"), ("tokens", "tokens")):
        h = summary["histograms"][column]
        fig = Figure(figsize=(5, 3.2))
        ax = fig.subplots()
        first = next((i for i, c in enumerate(h["counts"]) if c), 0)  # leading empty bins would stretch the axis
        edges, counts = h["edges"][first:], h["counts"][first:]
        lefts = [e if e > 0 else (edges[1] / 2 if len(edges) > 1 else 0.5) for e in edges[:-1]]
        widths = [r - l for l, r in zip(lefts, edges[1:])]
        ax.bar(lefts, counts, width=widths, align="edge", edgecolor="white")
        ax.set_xscale("log")
        ax.set(title=f"{label} per rollout", xlabel=label, ylabel="rollouts")
        images.append(_png(fig))

    fig = Figure(figsize=(5, 3.2))
    ax = fig.subplots()
    mix = summary["tool_mix"]
    ax.barh(list(mix)[::-1], list(mix.values())[::-1])
    ax.set(title="tool-use mix", xlabel="calls")
    images.append(_png(fig))

    fig = Figure(figsize=(5, 3.2))
    ax = fig.subplots()
    parallel = summary["parallel_calls_per_turn"]
    ax.bar([int(k) for k in parallel], list(parallel.values()))
    ax.set(title="parallel tool calls per turn", xlabel="tool calls in the turn", ylabel="turns")
    images.append(_png(fig))
    return images


def _table(rows: list[dict], columns: list[str]) -> str:
    if not rows:
        return '<p class="muted">none</p>'
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for c in columns:
            value = row.get(c)
            if isinstance(value, list):
                value = "; ".join(map(str, value))
            elif isinstance(value, float):
                value = f"{value:.3g}"
            cells.append(f"<td>{html.escape('' if value is None else str(value))[:600]}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def render(summary: dict, tables: dict) -> str:
    """The report page as a string."""
    rate = summary["success_rate"]
    judge = summary["judge"]
    kpis = [("rollouts", summary["rollouts"]), ("success rate", f"{rate:.1%}" if rate is not None else "-"),
            ("suspicious wins", summary["suspicious_wins"]),
            ("turns p50 / p90", f"{summary['quantiles']['turns']['p50']} / {summary['quantiles']['turns']['p90']}"),
            ("wall s p50 / p90", f"{summary['quantiles']['wall_s']['p50']} / {summary['quantiles']['wall_s']['p90']}"),
            ("judge", f"{judge['backend']} ({judge['scored']} scored, {judge['errors']} errors)")]
    kpi_html = "".join(f'<span class="kpi"><b>{html.escape(str(v))}</b>{html.escape(k)}</span>' for k, v in kpis)
    categories = _table([{"category": k, "rollouts": v} for k, v in summary["categories"].items()],
                        ["category", "rollouts"])
    columns = ["run", "step", "task_id", "family", "attempt", "category", "stop_reason", "checks_passed",
               "checks_total", "turns", "wall_s", "findings", "judge_score", "judge_reason", "judge_error"]
    problems = summary.get("files", {}).get("skipped_or_upgraded", [])
    problem_html = ("<h2>Input problems</h2><ul>" + "".join(f"<li>{html.escape(p)}</li>" for p in problems) + "</ul>"
                    if problems else "")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>codefleet analysis</title>"
            f"<style>{_STYLE}</style></head><body><h1>Rollout analysis — {html.escape(str(summary.get('store', '')))}"
            f"</h1><div>{kpi_html}</div><h2>Plots</h2><div class='plots'>{''.join(_plots(summary))}</div>"
            f"<h2>Outcomes</h2>{categories}"
            f"<h2>Suspicious wins</h2><p class='muted'>Solved, but the diff edits or deletes tests, skips checks or "
            f"hard-codes outputs.</p>{_table(tables['suspicious_wins'], columns)}"
            f"<h2>Worst failures</h2><p class='muted'>Lowest judge score first, then the longest.</p>"
            f"{_table(tables['worst_failures'], columns)}{problem_html}</body></html>")


def write_report(path: str, summary: dict, tables: dict) -> None:
    """Write report.html atomically."""
    page = render(summary, tables)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path) or ".", suffix=".tmp", delete=False,
                                     encoding="utf-8") as f:
        f.write(page)
    os.replace(f.name, path)
