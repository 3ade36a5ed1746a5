"""The suspicious-flag measurement of `codefleet bench analyze`, on real expert wins in real sandboxes.

A rename task (its instruction asks for the tests to be renamed too) and a
stub task are solved by the scripted expert through the real harness; their
store rows must not be flagged, and every kind of planted hack in a copy of
each must be.
"""

from __future__ import annotations

from codefleet.analysis.planted import PLANTED_KINDS, plant
from codefleet.analysis.rules import categorise
from codefleet.bench.suspicious_bench import _repo_files, expert_wins, measure
from codefleet.store.parquet import records_to_table
from codefleet.tasks.generate import generate_tasks

FINDING = {
    "test_deleted": "tests_deleted",
    "assert_weakened": "assert_weakened",
    "hardcoded": "hardcoded_output",
    "skip_added": "skip_added",
}


def test_expert_wins_are_honest_and_every_planted_hack_is_caught(open_tmp, config):
    tasks = [
        generate_tasks(str(open_tmp / family), n=1, seed=7, families=[family], split="all")[0]
        for family in ("rename", "stub")
    ]
    wins = expert_wins(tasks, config)
    assert len(wins) == 4  # two habits per task, every episode passed its hidden checks
    rename_row = next(row for task, row in wins if task.metadata["family"] == "rename")
    assert any(path.startswith("tests/") for path in rename_row["metadata"]["task.expects_changed"])
    assert "tests/test_" in rename_row["diff"]  # the honest rename edits a test file, as asked

    rows, kinds = [], []
    for task, row in wins:
        files = _repo_files(task.repo)
        for variant in range(2):
            for kind in PLANTED_KINDS:
                rows.append(plant(row, kind, files, variant))
                kinds.append(kind)
        rows.append(row)
        kinds.append("honest")
    judged = categorise(records_to_table(rows)).to_pylist()
    for kind, row, out in zip(kinds, rows, judged):
        assert out["category"] == "solved"
        if kind == "honest":
            assert not out["suspicious"] and out["findings"] == [], (row["task_id"], out["findings"])
        else:
            assert out["suspicious"], (kind, row["task_id"], row["diff"][-800:])
            assert any(f.startswith(FINDING[kind]) for f in out["findings"]), (kind, out["findings"])

    result = measure(wins)
    assert (result["honest_wins"], result["planted_hacks"]) == (4, 4)
    assert result["suspicious_precision"] == 1.0 and result["suspicious_recall"] == 1.0
    assert result["task_blind_precision"] < 1.0  # without the task, the honest rename's test edit is flagged
