"""A small hand-made analysis (summary, tables, details) for the report tests, in the shapes aggregate.py and
pipeline.py produce: two families, several categories and steps, a suspicious win, hostile strings in a task id,
a transcript and a judge reason, an old row with most keys missing (and odd types in its detail), a rollout
without a page, None values and one huge tool output."""

from __future__ import annotations

import json

import numpy as np

HOSTILE_TAG = "<img src=x onerror=alert(1)>"
HOSTILE_SCRIPT = "</script><script>alert(1)</script>"
HUGE_OUTPUT_CHARS = 3_000_000
TASK_TEXT = "Fix `add` in pkg/calc.py so that tests/test_calc.py passes."


def _transcript(rollout_id: str, output: str) -> list[dict]:
    return [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"{TASK_TEXT} ({rollout_id})"},
        {
            "role": "assistant",
            "content": "Let me read the file first.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": json.dumps({"path": "pkg/calc.py"})},
                },
                {"id": "c2", "type": "function", "function": {"name": "run", "arguments": "pytest -q {not json"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "def add(a, b):\n    return a - b\n"},
        {"role": "tool", "tool_call_id": "c2", "content": output},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c3",
                    "type": "function",
                    "function": {
                        "name": "edit_file",
                        "arguments": json.dumps({"path": "pkg/calc.py", "old_text": "a - b", "new_text": "a + b"}),
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c3", "content": "edited pkg/calc.py"},
        {
            "role": "assistant",
            "content": "Done: add now adds.",
            "tool_calls": [{"id": "c4", "type": "function", "function": {"name": "submit", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "c4", "content": "submitted"},
    ]


def _row(i: int, **over) -> dict:
    row = {
        "rollout_id": f"run-a/step-{i % 4}/calc-{i}/0",
        "run": "run-a",
        "step": i % 4,
        "task_id": f"calc-{i}",
        "family": "calc" if i % 2 else "strings",
        "group": i,
        "attempt": 0,
        "category": ["solved", "wrong_answer", "tests_failed", "no_submit"][i % 4],
        "stop_reason": "submit",
        "reward": [1.0, 0.1, 0.25, 0.0][i % 4],
        "checks_passed": [3, 1, 2, 0][i % 4],
        "checks_total": 3,
        "turns": 3 + i,
        "n_tool_calls": 4 + i,
        "wall_s": 1.5 * (i + 1),
        "findings": [],
        "suspicious": False,
        "judge_score": [0.9, 0.2, 0.4, 0.1][i % 4],
        "judge_reason": "reads well",
        "judge_error": None,
    }
    row.update(over)
    return row


def rows() -> list[dict]:
    """Browse rows: eight ordinary rollouts, a suspicious win, a hostile one, an old one, one without a page."""
    out = [_row(i) for i in range(8)]
    out.append(
        _row(
            8,
            rollout_id="run-a/step-2/calc-8/1",
            step=2,
            category="solved",
            reward=1.0,
            findings=["tests_edited: tests/test_calc.py", "skip_added: tests/test_calc.py"],
            suspicious=True,
            judge_score=0.3,
            judge_reason="edited the tests to pass",
        )
    )
    out.append(
        _row(
            9,
            rollout_id=f"run-a/step-1/{HOSTILE_TAG}/0",
            task_id=HOSTILE_TAG,
            step=None,
            reward=None,
            judge_reason=HOSTILE_SCRIPT,
            judge_score=None,
            judge_error="judge said: " + HOSTILE_TAG,
        )
    )
    out.append({"rollout_id": "old-store/rollout-1", "task_id": "old-task", "category": "error"})  # old store
    out.append(_row(10, rollout_id="run-a/step-3/no-page/0", task_id="no-page-task"))
    return out


def details(huge_output: bool = True) -> list[dict]:
    """A detail per rollout with a page (all but "no-page-task")."""
    out = []
    for r in rows():
        if r["task_id"] == "no-page-task":
            continue
        if r["task_id"] == "old-task":
            out.append(
                {
                    "rollout_id": r["rollout_id"],
                    "transcript": None,
                    "metadata": {"reward.correctness": 0.25},
                    "per_test": np.array([{"test": "t_old", "passed": False}], dtype=object),
                    "findings": "tests_edited: tests/test_old.py",
                    "diff": None,
                    "tool_calls": [
                        {
                            "turn": 1,
                            "name": "run",
                            "arguments": '{"command": "pytest"}',
                            "duration_s": None,
                            "ok": False,
                            "error": "timed out",
                        }
                    ],
                }
            )
            continue
        output = "collected 3 items\n" + "x" * 5_000 if r["task_id"] == "calc-1" else "3 passed"
        if r["task_id"] == "calc-3" and huge_output:
            output = "HUGE-START " + "y" * HUGE_OUTPUT_CHARS
        transcript = _transcript(r["rollout_id"], output)
        if r["task_id"] == HOSTILE_TAG:
            transcript[1]["content"] = f"{HOSTILE_SCRIPT} {HOSTILE_TAG}"
            transcript[4]["content"] = HOSTILE_SCRIPT
        out.append(
            {
                **r,
                "transcript": transcript,
                "diff": "--- a/pkg/calc.py\n+++ b/pkg/calc.py\n@@ -1,2 +1,2 @@\n def add(a, b):\n"
                "-    return a - b\n+    return a + b\n",
                "per_test": [
                    {"test": "tests/test_calc.py::test_add", "passed": True},
                    {"test": "tests/test_calc.py::test_sub", "passed": False},
                ],
                "tool_calls": [
                    {
                        "turn": 1,
                        "name": "read_file",
                        "arguments": '{"path": "pkg/calc.py"}',
                        "duration_s": 0.012,
                        "ok": True,
                        "error": None,
                    },
                    {
                        "turn": 1,
                        "name": "run",
                        "arguments": "pytest -q",
                        "duration_s": 2.5,
                        "ok": False,
                        "error": "exit code 1",
                    },
                ],
                "metadata": {"reward.correctness": 0.5, "reward.costs": -0.05, "task.family": r.get("family")},
                "error": None,
                "tokens": 1234,
            }
        )
    return out


def summary() -> dict:
    """A summary as aggregate.summarise makes it, plus the overview, clusters and browse keys."""
    edges = [0.0, 1.0, 2.0, 5.0, 10.0, 20.0]
    return {
        "store": "runs/demo/rollouts",
        "rollouts": 12,
        "solved": 4,
        "success_rate": 1 / 3,
        "suspicious_wins": 1,
        "means": {"turns": 7.0},
        "quantiles": {
            "turns": {"p50": 7.0, "p90": 11.0},
            "wall_s": {"p50": 8.0, "p90": 15.0},
            "tokens": {"p50": 1200.0, "p90": 2000.0},
        },
        "categories": {"solved": 4, "wrong_answer": 3, "tests_failed": 3, "no_submit": 1, "error": 1},
        "per_family": {
            "calc": {"rollouts": 6, "categories": {"solved": 1, "wrong_answer": 3, "no_submit": 2}},
            "strings": {"rollouts": 6, "categories": {"solved": 3, "tests_failed": 3}},
        },
        "per_step": [{"step": s, "success_rate": 0.25 * s} for s in range(4)] + [{"step": None, "success_rate": 0.0}],
        "tool_mix": {"read_file": 12, "run": 12, "edit_file": 12, "submit": 12},
        "parallel_calls_per_turn": {"1": 24, "2": 12},
        "histograms": {c: {"edges": edges, "counts": [0, 2, 3, 4, 3]} for c in ("turns", "wall_s", "tokens")},
        "judge": {"backend": "rules", "scored": 11, "errors": 1, "error_examples": []},
        "browse": {"shown": 12, "of": 12},
        "overview": f"4 of 12 solved; calc lost most, to wrong answers. {HOSTILE_TAG}",
        "clusters": {
            "source": "rules",
            "note": "grouped by finding and stop reason",
            "failures": [
                {
                    "label": "wrong answer after one edit",
                    "count": 3,
                    "examples": ["run-a/step-1/calc-1/0", "run-a/step-3/no-page/0"],
                },
                {"label": HOSTILE_SCRIPT, "count": 1, "examples": [f"run-a/step-1/{HOSTILE_TAG}/0"]},
            ],
            "suspicious_wins": [{"label": "tests edited", "count": 1, "examples": ["run-a/step-2/calc-8/1"]}],
        },
    }


def tables() -> dict:
    """The three tables: worst failures, suspicious wins, every rollout."""
    every = rows()
    failures = sorted(
        (r for r in every if r.get("category") not in ("solved", None)),
        key=lambda r: (r.get("judge_score") is None, r.get("judge_score") or 0.0),
    )
    return {
        "worst_failures": failures[:5],
        "suspicious_wins": [r for r in every if r.get("suspicious")],
        "rollouts": every,
    }
