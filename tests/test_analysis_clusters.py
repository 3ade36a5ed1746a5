"""Clusters and the overview, as pure functions: parsing a judge's clusters, summing batches, rules labels."""

from __future__ import annotations

import pytest

from codefleet.analysis.clusters import combine, parse_clusters, rule_label
from codefleet.analysis.overview import overview


def test_parse_clusters_keeps_valid_members_once_and_rejects_prose():
    answer = (
        '```json\n{"clusters": [{"label": "  missed   edge cases ", "members": [1, 3, 3, 9, true, "2"]},'
        '{"label": "broke it", "members": [3, 2]}, {"label": "empty", "members": []}, "junk"]}\n```'
    )
    assert parse_clusters(answer, 4) == [("missed edge cases", [0, 2]), ("broke it", [1])]
    for bad in (
        "mostly edge cases",
        '{"clusters": []}',
        '{"clusters": [{"label": "x", "members": [7]}]}',
        '{"groups": [{"label": "x", "members": [1]}]}',
    ):
        with pytest.raises(ValueError):
            parse_clusters(bad, 4)


def row(group, label, count, examples, source="judge"):
    return {
        "group": group,
        "label": label,
        "source": source,
        "count": count,
        "examples": examples,
        "keys": [float(int(e[1:])) for e in examples],
    }


def test_combine_merges_labels_caps_the_list_and_samples_examples_by_key():
    rows = [
        row("failures", "edge a", 5, ["e9", "e2"]),
        row("failures", "edge b", 4, ["e1"]),
        row("failures", "parser", 3, ["e5"]),
        row("failures", "typo", 2, ["e7"]),
        row("failures", "env", 1, ["e8"]),
        row("suspicious_wins", "tests edited", 2, ["e3"], "rules"),
    ]
    out = combine(rows, max_clusters=3, merged={"edge a": "edge", "edge b": "edge"})
    assert out["failures"] == [
        {"label": "edge", "count": 9, "examples": ["e1", "e2", "e9"]},
        {"label": "parser", "count": 3, "examples": ["e5"]},
        {"label": "other causes", "count": 3, "examples": ["e7", "e8"]},
    ]
    assert out["suspicious_wins"] == [{"label": "tests edited", "count": 2, "examples": ["e3"]}]


def test_rule_labels_name_the_category_and_stop_or_the_finding():
    assert rule_label("solved", "submit", [], False) is None
    assert rule_label("wrong_fix", "submit", [], False) == (
        "failures",
        "wrong fix: the checks reject the change (stop: submit)",
    )
    assert rule_label("solved", "submit", ["tool_errors: 1 of 3", "skip_added: tests/t.py"], True) == (
        "suspicious_wins",
        "skips checks",
    )


def test_overview_reads_the_figures():
    summary = {
        "rollouts": 10,
        "solved": 4,
        "success_rate": 0.4,
        "suspicious_wins": 1,
        "per_step": [{"step": s, "rollouts": 5, "success_rate": r} for s, r in ((0, 0.2), (1, 0.6))],
        "per_family": {"calc": {"rollouts": 6, "success_rate": 0.5}, "dates": {"rollouts": 4, "success_rate": 0.25}},
        "clusters": {
            "failures": [{"label": "wrong fix", "count": 6, "examples": []}],
            "suspicious_wins": [{"label": "skips checks", "count": 1, "examples": []}],
        },
        "judge": {"backend": "rules", "scored": 10, "errors": 0},
    }
    text = overview(summary)
    assert text == (
        "10 rollouts over steps 0–1; 4 solved (40%). Success went from 20% at step 0 to 60% at step 1. "
        "It won most on calc (50% of 6) and least on dates (25% of 4). Why the rest failed, largest causes "
        "first: wrong fix (6, 100%). 1 of the 4 wins look suspicious: skips checks (1)."
    )
    # nothing moved: no trend and no best family to name
    flat = {
        **summary,
        "per_step": [{"step": s, "rollouts": 5, "success_rate": 0.0} for s in (0, 1)],
        "per_family": {f: {"rollouts": 5, "success_rate": 0.0} for f in ("calc", "dates")},
    }
    assert "Success stayed at 0% from step 0 to step 1." in overview(flat) and "won most" not in overview(flat)
