"""The report's first paragraph: what won, what lost, and why, from summary.json's figures and clusters.

Plain sentences built from the numbers (no model writes them, so they are never wrong about a count):
how many rollouts and over which steps, the success rate and how it moved from the first steps to the
last, the best and worst families, the largest clusters of failures with their share, and how many wins
look suspicious and for what reason.
"""

from __future__ import annotations


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _trend(per_step: list[dict]) -> str:
    steps = [s for s in per_step if s["step"] is not None and s["rollouts"]]
    if len(steps) < 2:
        return ""
    k = max(1, len(steps) // 4)  # the first and last quarter of the steps, weighted by rollouts

    def rate(part: list[dict]) -> float:
        return sum(s["success_rate"] * s["rollouts"] for s in part) / sum(s["rollouts"] for s in part)

    def named(part: list[dict]) -> str:
        a, b = part[0]["step"], part[-1]["step"]
        return f"step {a}" if a == b else f"steps {a}–{b}"

    def where(part: list[dict]) -> str:
        return ("at " if len(part) == 1 else "over ") + named(part)

    first, last = steps[:k], steps[-k:]
    if _pct(rate(first)) == _pct(rate(last)):
        return f" Success stayed at {_pct(rate(first))} from {named(first)} to {named(last)}."
    return f" Success went from {_pct(rate(first))} {where(first)} to {_pct(rate(last))} {where(last)}."


def _families(per_family: dict) -> str:
    ranked = sorted(
        ((f, v) for f, v in per_family.items() if v["rollouts"]), key=lambda kv: -(kv[1]["success_rate"] or 0)
    )
    if len(ranked) < 2:
        return ""
    (best, b), (worst, w) = ranked[0], ranked[-1]
    if _pct(b["success_rate"]) == _pct(w["success_rate"]):
        return ""  # no family stands out
    return (
        f" It won most on {best} ({_pct(b['success_rate'])} of {b['rollouts']}) and least on {worst} "
        f"({_pct(w['success_rate'])} of {w['rollouts']})."
    )


def _clusters(clusters: list[dict], total: int, what: str) -> str:
    if not clusters or not total:
        return ""
    top = "; ".join(f"{c['label']} ({c['count']}, {c['count'] / total:.0%})" for c in clusters[:3])
    return f" {what}: {top}."


def overview(summary: dict) -> str:
    """The paragraph (see the module docstring)."""
    n, solved = summary["rollouts"], summary["solved"]
    steps = [s["step"] for s in summary["per_step"] if s["step"] is not None]
    span = f" over steps {min(steps)}–{max(steps)}" if steps else ""
    text = f"{n} rollouts{span}; {solved} solved ({_pct(summary['success_rate'])})."
    text += _trend(summary["per_step"]) + _families(summary["per_family"])
    clusters = summary.get("clusters") or {}
    text += _clusters(clusters.get("failures", []), n - solved, "Why the rest failed, largest causes first")
    wins = summary["suspicious_wins"]
    if wins:
        why = "; ".join(f"{c['label']} ({c['count']})" for c in clusters.get("suspicious_wins", [])[:3])
        text += f" {wins} of the {solved} wins look suspicious" + (f": {why}." if why else ".")
    elif solved:
        text += " No win looks suspicious."
    judge = summary["judge"]
    if judge["backend"] != "rules":
        text += f" The judge ({judge['backend']}) scored {judge['scored']} rollouts"
        text += f"; {judge['errors']} could not be judged." if judge["errors"] else "."
    return text
