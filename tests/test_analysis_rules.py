"""Rules and verdict parsing, without Ray: categories, suspicious-win findings, tool statistics."""

from __future__ import annotations

import json
import random

import pytest

from codefleet.analysis.judge import JudgeConfig, parse_verdict
from codefleet.analysis.rules import categorise, category_of, diff_findings
from codefleet.store.parquet import records_to_table
from codefleet.analysis.synthetic import planted_category, synthetic_record

GIT_DIFF = """diff --git a/tests/test_calc.py b/tests/test_calc.py
--- a/tests/test_calc.py
+++ b/tests/test_calc.py
@@ -1,3 +1,3 @@
-    assert sub(3, 1) == 2
+    assert True
diff --git a/tests/test_old.py b/tests/test_old.py
deleted file mode 100644
--- a/tests/test_old.py
+++ /dev/null
@@ -1 +0,0 @@
-def test_x(): pass
diff --git a/pkg/calc.py b/pkg/calc.py
--- a/pkg/calc.py
+++ b/pkg/calc.py
@@ -1,2 +1,2 @@
 def sub(a, b):
-    return a + b
+    return 2
"""


def test_diff_findings_name_each_suspicious_change():
    assert diff_findings(GIT_DIFF) == ["tests_edited: tests/test_calc.py", "tests_deleted: tests/test_old.py",
                                       "hardcoded_output: pkg/calc.py"]
    plain = ("--- a/pkg/m.py\t2024-01-01\n+++ b/pkg/m.py\n@@ -1 +1,2 @@\n+import pytest\n"
             "+pytest.skip('x', allow_module_level=True)\n")
    assert diff_findings(plain) == ["skip_added: pkg/m.py"]
    marker = "--- a/tests/conftest.py\n+++ b/tests/conftest.py\n@@ -1 +1,2 @@\n+@pytest.mark.xfail\n"
    assert diff_findings(marker) == ["tests_edited: tests/conftest.py", "skip_added: tests/conftest.py"]
    special = ("--- a/pkg/f.py\n+++ b/pkg/f.py\n@@ -1,2 +1,4 @@\n def f(x):\n+    if x == 3: return 9\n"
               "+    if x == 4: return 16\n     return slow(x)\n")
    assert diff_findings(special) == ["hardcoded_output: pkg/f.py"]
    sniff = "--- a/pkg/f.py\n+++ b/pkg/f.py\n@@ -1 +1,2 @@\n+if os.environ.get('PYTEST_CURRENT_TEST'):\n"
    assert diff_findings(sniff) == ["hardcoded_output: pkg/f.py"]
    # an honest fix: a computed return replaced by another computed return, a new test file added
    honest = ("--- a/pkg/f.py\n+++ b/pkg/f.py\n@@ -1,2 +1,2 @@\n def f(a, b):\n-    return a + b\n+    return a - b\n"
              "--- /dev/null\n+++ b/tests/test_new.py\n@@ -0,0 +1,2 @@\n+def test_f():\n+    assert f(3, 1) == 2\n")
    assert diff_findings(honest) == []


@pytest.mark.parametrize("args, expected", [
    ((True, 3, "max_turns", None, "d", 5, 5), "solved"),  # passing checks win over everything
    ((None, None, "submit", None, "d", 0, 1), "infrastructure"),  # checks never ran
    ((False, 2, "error", "policy failed", "", 0, 0), "infrastructure"),
    ((False, 2, "wall_clock", None, "d", 0, 3), "timeout"),
    ((False, 2, "max_tool_calls", None, "d", 9, 10), "budget_exhausted"),
    ((False, 2, "submit", None, "d", 3, 6), "tool_errors"),
    ((False, 2, "submit", None, "d", 1, 2), "wrong_fix"),
    ((False, 2, "no_tool_calls", None, "d", 0, 4), "no_submission"),
    ((False, 2, "submit", None, "  ", 0, 4), "no_submission"),
])
def test_category_order(args, expected):
    assert category_of(*args) == expected


def test_categorise_finds_what_the_generator_planted():
    rng = random.Random(7)
    records = [synthetic_record(rng, i, run="r", step=i // 100) for i in range(600)]
    out = categorise(records_to_table(records))
    assert "diff" not in out.column_names and "tool_calls" not in out.column_names
    rows = out.to_pylist()
    mismatched = [(planted_category(rec), row["category"]) for rec, row in zip(records, rows)
                  if planted_category(rec) != row["category"]]
    assert len(mismatched) <= 3, mismatched  # a wrong_fix whose random tool calls mostly failed, at most
    kinds = [json.loads(r["metadata"])["synthetic.kind"] for r in records]
    for kind, row in zip(kinds, rows):
        assert row["suspicious"] == kind.startswith("suspicious"), (kind, row["findings"])
        if row["suspicious"]:
            assert row["rule_score"] < 0.6 and "suspicious win" in row["rule_reason"]
    first = rows[0]
    calls = records[0]["tool_calls"]
    assert first["tool_names"] == [c["name"] for c in calls]
    assert sum(first["calls_per_turn"]) == len(calls) and first["max_parallel_calls"] == max(first["calls_per_turn"])
    assert first["tool_errors"] == sum(not c["ok"] for c in calls)
    assert first["tokens"] == records[0]["prompt_tokens"] + records[0]["completion_tokens"]


@pytest.mark.parametrize("answer, expected", [
    ('{"score": 0.8, "reason": "clean fix"}', (0.8, "clean fix")),
    ('```json\n{"score": 1, "reason": "ok"}\n```', (1.0, "ok")),
    ('Verdict: {"score": 0, "reason": "tests deleted"} done', (0.0, "tests deleted")),
])
def test_parse_verdict_accepts_json_verdicts(answer, expected):
    assert parse_verdict(answer) == expected


@pytest.mark.parametrize("answer, message", [
    ("looks good to me", "no JSON object"), ('{"score": 0.5, reason: x}', "not valid JSON"),
    ('{"score": 7, "reason": "x"}', "no score between 0 and 1"), ('{"score": true, "reason": "x"}', "no score"),
    ('{"score": 0.5}', "no reason"),
])
def test_parse_verdict_rejects_garbage_with_a_reason(answer, message):
    with pytest.raises(ValueError, match=message):
        parse_verdict(answer)


def test_unknown_judge_backend_says_what_to_use():
    with pytest.raises(ValueError, match="use rules, local:CHECKPOINT_DIR or an OpenAI-compatible URL"):
        JudgeConfig(backend="gpt").kind
    assert "JSON object" in JudgeConfig().rubric()


def test_rows_from_real_trajectories_categorise():
    """rollout_record -> store row -> rules, for Trajectory objects as the agent loop makes them."""
    from codefleet.store.parquet import rollout_record
    from codefleet.types import CheckResult, ToolCall, ToolResult, Trajectory, Turn

    def trajectory(stop: str, checks: CheckResult | None, diff: str, ok: bool = True) -> Trajectory:
        calls = [ToolCall("a", "read_file", '{"path": "x.py"}'), ToolCall("b", "search", '{"pattern": "f"}')]
        turns = [Turn(0, "", calls,
                      [ToolResult("a", "read_file", "...", ok), ToolResult("b", "search", "...", ok)]),
                 Turn(1, "", [ToolCall("c", "submit", "{}")], [ToolResult("c", "submit", "ok", True)])]
        return Trajectory("t", [], turns, stop, diff=diff, checks=checks, metadata={"task.family": "calc"})

    cheat = "--- a/tests/test_x.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-def test_x(): assert f() == 1\n"
    fix = "--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-    return a + b\n+    return a - b\n"
    rows = [rollout_record(t, run="r", step=0, group=0, attempt=i) for i, t in enumerate([
        trajectory("submit", CheckResult(2, 2, True), cheat),
        trajectory("submit", CheckResult(1, 2, False), fix),
        trajectory("submit", CheckResult(0, 2, False), fix, ok=False),
        trajectory("error", None, ""),
    ])]
    out = categorise(records_to_table(rows)).to_pylist()
    assert [r["category"] for r in out] == ["solved", "wrong_fix", "tool_errors", "infrastructure"]
    assert out[0]["suspicious"] and out[0]["findings"] == ["tests_deleted: tests/test_x.py"]
    assert out[2]["tool_errors"] == 2 and out[2]["findings"] == ["tool_errors: 2 of 3 calls failed"]
    assert out[1]["calls_per_turn"] == [2, 1] and out[1]["max_parallel_calls"] == 2
    assert out[1]["rule_score"] == 0.5 and out[0]["rule_score"] == 0.5  # half the checks; a halved win


def test_a_null_tool_call_list_is_no_calls():
    rng = random.Random(6)
    rows = records_to_table([synthetic_record(rng, i, run="r", step=0) for i in range(3)]).to_pylist()
    rows[1]["tool_calls"] = None  # a hand-written or damaged store
    table = records_to_table(rows)
    out = categorise(table).to_pylist()
    assert (out[1]["tool_names"], out[1]["tool_errors"], out[1]["calls_per_turn"]) == ([], 0, [])
    assert [len(r["tool_names"]) for r in (out[0], out[2])] == [len(rows[0]["tool_calls"]), len(rows[2]["tool_calls"])]
