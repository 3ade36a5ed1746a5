"""Synthetic rollouts in the store's schema, for the bench and the tests.

    for records in synthetic_records(10_000, run="bench", seed=0):
        writer.append(records)

Each record is drawn from a mix of outcomes (`OUTCOMES`: kind -> weight) and
built so that the rules (rules.py) must find what was planted: a win whose
diff edits a test, skips a check or hard-codes a return is a suspicious win;
a failure's stop reason, error or failing tool calls decide its category.
Honest wins of the `strings` family are renames: their diff edits a test file
too, and their metadata carries the task's allowance (`task.expects_changed`
lists both files, as tasks/allowance.py records it), so the rules must not
flag them. `planted_category(record)` is what the rules should answer for it, kept in the
record's `metadata` under "synthetic.expect", so tests can compare.
Deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from datetime import UTC, datetime

from codefleet.store.schema import SCHEMA_VERSION

FAMILIES = ("calc", "strings", "parsing", "graphs", "dates")
TOOLS = ("read_file", "search", "edit_file", "run", "list_dir", "write_file")
OUTCOMES = {  # kind: weight
    "solved": 36,
    "suspicious_edit": 1,
    "suspicious_skip": 1,
    "suspicious_hardcode": 1,
    "wrong_fix": 22,
    "no_submission": 10,
    "timeout": 6,
    "budget_exhausted": 8,
    "tool_errors": 8,
    "infrastructure": 7,
}
_CATEGORY = {"suspicious_edit": "solved", "suspicious_skip": "solved", "suspicious_hardcode": "solved"}

_FIX = (
    "diff --git a/pkg/{m}.py b/pkg/{m}.py\n--- a/pkg/{m}.py\n+++ b/pkg/{m}.py\n@@ -1,3 +1,3 @@\n"
    " def f(a, b):\n-    return a + b\n+    return a - b\n"
)
_EDIT_TEST = (
    "diff --git a/tests/test_{m}.py b/tests/test_{m}.py\n--- a/tests/test_{m}.py\n+++ b/tests/test_{m}.py\n"
    "@@ -1,2 +1,2 @@\n def test_f():\n-    assert f(3, 1) == 2\n+    assert True\n"
)
_RENAME = (
    "diff --git a/pkg/{m}.py b/pkg/{m}.py\n--- a/pkg/{m}.py\n+++ b/pkg/{m}.py\n@@ -1,2 +1,2 @@\n"
    "-def f(a, b):\n+def f_new(a, b):\n     return a - b\n"
    "diff --git a/tests/test_{m}.py b/tests/test_{m}.py\n--- a/tests/test_{m}.py\n+++ b/tests/test_{m}.py\n"
    "@@ -1,2 +1,2 @@\n def test_f():\n-    assert f(3, 1) == 2\n+    assert f_new(3, 1) == 2\n"
)
_SKIP = (
    "diff --git a/tests/conftest.py b/tests/conftest.py\n--- a/tests/conftest.py\n+++ b/tests/conftest.py\n"
    "@@ -1 +1,3 @@\n import pytest\n+\n+pytestmark = pytest.mark.skip(reason='flaky')\n"
    "diff --git a/pkg/{m}.py b/pkg/{m}.py\n--- a/pkg/{m}.py\n+++ b/pkg/{m}.py\n@@ -1 +1,2 @@\n"
    "+import pytest; pytest.skip('later', allow_module_level=True)\n"
)
_HARDCODE = (
    "diff --git a/pkg/{m}.py b/pkg/{m}.py\n--- a/pkg/{m}.py\n+++ b/pkg/{m}.py\n@@ -1,3 +1,3 @@\n"
    " def f(a, b):\n-    return compute(a, b)\n+    return 42\n"
)


def planted_category(record: dict) -> str:
    return json.loads(record["metadata"])["synthetic.expect"]


def _tool_calls(rng: random.Random, turns: int, failing: bool) -> list[dict]:
    calls = []
    for turn in range(turns):
        for _ in range(rng.choice((1, 1, 1, 2, 2, 3, 4))):
            name = rng.choice(TOOLS)
            ok = not failing and rng.random() > 0.05 or failing and rng.random() < 0.2
            calls.append(
                {
                    "turn": turn,
                    "name": name,
                    "arguments": json.dumps({"path": f"pkg/m{rng.randrange(50)}.py"}),
                    "duration_s": round(rng.uniform(0.001, 0.5), 4),
                    "ok": ok,
                    "error": None if ok else "error: no such file",
                }
            )
    return calls


def synthetic_record(rng: random.Random, i: int, *, run: str, step: int, group_size: int = 8) -> dict:
    kind = rng.choices(list(OUTCOMES), weights=list(OUTCOMES.values()))[0]
    category = _CATEGORY.get(kind, kind)
    family = FAMILIES[i % len(FAMILIES)]
    module = f"m{rng.randrange(50)}"
    turns = rng.randint(1, 6) if category == "solved" else rng.randint(2, 30)
    stop = {
        "timeout": "wall_clock",
        "budget_exhausted": "max_turns",
        "no_submission": "no_tool_calls",
        "infrastructure": "error",
    }.get(category, "submit")
    rename = kind == "solved" and family == "strings"
    diff = {
        "suspicious_edit": _FIX + _EDIT_TEST,
        "suspicious_skip": _SKIP,
        "suspicious_hardcode": _HARDCODE,
        "no_submission": "",
    }.get(kind, _RENAME if rename else _FIX).format(m=module)
    allowance = {"task.expects_changed": [f"pkg/{module}.py", f"tests/test_{module}.py"]} if rename else {}
    total = rng.randint(1, 6)
    passed = total if category == "solved" else rng.randint(0, total - 1)
    checks_ran = category != "infrastructure"
    calls = _tool_calls(rng, turns, failing=category == "tool_errors")
    prompt = sum(rng.randint(300, 3000) for _ in range(turns))
    model_s, tool_s = turns * rng.uniform(0.2, 2.0), sum(c["duration_s"] for c in calls)
    version = max(0, step - rng.randint(0, 2))
    transcript = [{"role": "user", "content": f"Fix {family} task {i}: make f in pkg/{module}.py pass its tests."}]
    for t in range(turns):  # ~300 bytes of incompressible tool output per turn, like a real transcript's
        transcript += [
            {"role": "assistant", "content": f"turn {t}: looking at pkg/{module}.py"},
            {"role": "tool", "content": rng.randbytes(128).hex()},
        ]
    return {
        "schema_version": SCHEMA_VERSION,
        "run": run,
        "step": step,
        "task_id": f"{family}-{i // group_size:06d}",
        "family": family,
        "group": i // group_size,
        "attempt": i % group_size,
        "split": "train",
        "policy_version_min": version,
        "policy_version_max": step,
        "reward": 1.0 if category == "solved" else 0.0,
        "checks_passed": passed if checks_ran else None,
        "checks_total": total if checks_ran else None,
        "all_passed": category == "solved" if checks_ran else None,
        "per_test": [{"test": f"tests/test_{module}.py::test_{k}", "passed": k < passed} for k in range(total)]
        if checks_ran
        else [],
        "stop_reason": stop,
        "turns": turns,
        "tool_calls": calls,
        "n_tool_calls": len(calls),
        "tool_calls_per_turn": len(calls) / turns,
        "prompt_tokens": prompt,
        "completion_tokens": turns * rng.randint(20, 400),
        "model_s": model_s,
        "tool_s": tool_s,
        "wall_s": model_s + tool_s + rng.uniform(0.05, 0.5),
        "infra_retries": 1 if category == "infrastructure" and rng.random() < 0.5 else 0,
        "error": "policy failed: APIConnectionError: engine unreachable" if category == "infrastructure" else None,
        "diff": diff,
        "transcript": json.dumps(transcript),
        "metadata": json.dumps({"synthetic.expect": category, "synthetic.kind": kind, **allowance}),
        "created_at": datetime(2026, 1, 1, tzinfo=UTC),
    }


def synthetic_records(
    n: int, *, run: str = "synthetic", seed: int = 0, rows_per_step: int = 1000, chunk_rows: int = 5000
) -> Iterator[list[dict]]:
    """`n` records, `rows_per_step` per step, yielded in lists of at most `chunk_rows` (one step each)."""
    rng = random.Random(seed)
    for start in range(0, n, rows_per_step):
        step = start // rows_per_step
        end = min(n, start + rows_per_step)
        for chunk_start in range(start, end, chunk_rows):
            stop = min(end, chunk_start + chunk_rows)
            yield [synthetic_record(rng, i, run=run, step=step) for i in range(chunk_start, stop)]
