"""The report's plots, drawn with matplotlib's Agg backend and embedded as base64 PNG <img> tags (data: URLs).

Success over steps, success per family (stacked by failure category), turn / wall-clock / token distributions
(the summary's fixed 1-2-5 bins, log x axis), the tool-use mix and parallel calls per turn. They read only the
summary's aggregates, never a rollout. Their labels (family, tool and category names) come from rollouts, so they
are drawn as plain text (`PLAIN_TEXT`): a tool named `$\\foo$` is shown as typed, never parsed as math text, whose
parse error would leave the run with no report.
"""

from __future__ import annotations

import base64
import io

import matplotlib
from matplotlib.figure import Figure

from codefleet.analysis.rules import CATEGORIES

PLAIN_TEXT = {"text.parse_math": False, "text.usetex": False}  # labels from rollouts: never math, never TeX


def _png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=80)
    return f'<img alt="" src="data:image/png;base64,{base64.b64encode(buffer.getvalue()).decode()}">'


def plots(summary: dict) -> list[str]:
    """The report's plots as <img> tags (see the module docstring)."""
    with matplotlib.rc_context(PLAIN_TEXT):  # read when each text is made and when the figure is drawn
        return _plots(summary)


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
        widths = [right - left for left, right in zip(lefts, edges[1:])]
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
