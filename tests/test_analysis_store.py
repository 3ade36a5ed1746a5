"""The rollout store: records from real Trajectory objects, atomic appends, hive layout,
older schema versions, corrupt and incomplete files."""

from __future__ import annotations

import json
import os
import threading

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from codefleet.store.parquet import (
    RolloutWriter,
    read_rollouts,
    records_to_table,
    rollout_record,
    scan_store,
    upgrade_store,
)
from codefleet.store.schema import FILE_SCHEMA, SCHEMA, SCHEMA_VERSION
from codefleet.types import CheckResult, ToolCall, ToolResult, Trajectory, Turn


def make_trajectory(task_id: str = "t1", passed: bool = True) -> Trajectory:
    turns = [
        Turn(
            0,
            "",
            [
                ToolCall("c1", "read_file", '{"path": "a.py"}', {"path": "a.py"}),
                ToolCall("c2", "search", '{"pattern": "x"', None, "invalid JSON"),
            ],
            [ToolResult("c1", "read_file", "x = 1", True, 0.01), ToolResult("c2", "search", "error", False, 0.0)],
            model_s=0.5,
            tool_s=0.01,
            prompt_tokens=100,
            completion_tokens=20,
            policy_versions=[3, 3, 4],
        ),
        Turn(
            1,
            "done",
            [ToolCall("c3", "run", '{"command": "pytest"}', {"command": "pytest"})],
            [ToolResult("c3", "run", "1 failed", False, 1.5)],
            model_s=0.25,
            tool_s=1.5,
            prompt_tokens=150,
            completion_tokens=10,
            policy_versions=[5],
        ),
    ]
    checks = CheckResult(2 if passed else 1, 2, passed, {"test_a": True, "test_b": passed})
    return Trajectory(
        task_id,
        [{"role": "user", "content": "fix it"}],
        turns,
        "submit",
        diff="--- a\n+++ b\n",
        checks=checks,
        reward=1.0 if passed else 0.0,
        wall_s=2.5,
        model_s=0.75,
        tool_s=1.51,
        metadata={"task.family": "calc", "policy": "stub"},
    )


def test_record_flattens_a_trajectory():
    record = rollout_record(
        make_trajectory(), run="r1", step=2, group=1, attempt=3, extra={"infra_retries": 2, "sampler": "t=1.0"}
    )
    assert (record["family"], record["group"], record["attempt"], record["split"]) == ("calc", 1, 3, "train")
    assert (record["policy_version_min"], record["policy_version_max"]) == (3, 5)
    assert (record["checks_passed"], record["checks_total"], record["all_passed"]) == (2, 2, True)
    assert (record["prompt_tokens"], record["completion_tokens"], record["turns"]) == (250, 30, 2)
    assert record["tool_calls_per_turn"] == 1.5 and record["infra_retries"] == 2
    calls = record["tool_calls"]
    assert [c["name"] for c in calls] == ["read_file", "search", "run"]
    assert calls[0] == {
        "turn": 0,
        "name": "read_file",
        "arguments": '{"path": "a.py"}',
        "duration_s": 0.01,
        "ok": True,
        "error": None,
    }
    assert calls[1]["error"] == "invalid JSON" and calls[1]["arguments"] == '{"pattern": "x"'
    assert calls[2]["ok"] is False and calls[2]["error"] == "1 failed"
    assert json.loads(record["transcript"]) == [{"role": "user", "content": "fix it"}]


def test_append_writes_hive_partitions_and_reads_back(tmp_path):
    root = str(tmp_path / "rollouts")
    writer = RolloutWriter(root)
    records = [
        rollout_record(
            make_trajectory(f"t{i}", i % 2 == 0), run="r1", step=i // 2, group=0, attempt=i, extra={"sampler": "greedy"}
        )
        for i in range(4)
    ]
    paths = writer.append(records).split(", ")
    assert len(paths) == 2 and all(os.path.exists(p) for p in paths)
    assert {os.path.relpath(os.path.dirname(p), root) for p in paths} == {"run=r1/step=0", "run=r1/step=1"}
    assert os.path.basename(paths[0]).startswith("part-")
    assert pq.read_schema(paths[0]).equals(FILE_SCHEMA)  # run and step in the path only, run_name in the file
    assert {"run", "step"}.isdisjoint(FILE_SCHEMA.names) and "run_name" in FILE_SCHEMA.names
    writer.append(records[:1])  # a second append adds a file, never rewrites one
    table = read_rollouts(str(tmp_path))  # a run directory works as well as the store itself
    assert table.num_rows == 5 and table.schema.equals(SCHEMA)
    rows = sorted(table.to_pylist(), key=lambda r: (r["attempt"], r["created_at"]))
    assert [r["task_id"] for r in rows] == ["t0", "t0", "t1", "t2", "t3"]
    assert rows[0]["schema_version"] == SCHEMA_VERSION and rows[0]["per_test"][1] == {"test": "test_b", "passed": True}
    assert json.loads(rows[0]["metadata"]) == {"policy": "stub", "sampler": "greedy", "task.family": "calc"}
    assert read_rollouts(root, columns=["task_id", "reward"]).column_names == ["task_id", "reward"]
    projected = read_rollouts(root, columns=["step", "run", "attempt"])
    assert projected.schema == pa.schema([SCHEMA.field(c) for c in ("step", "run", "attempt")])  # step: int64
    assert sorted(projected.to_pylist(), key=lambda r: r["attempt"])[-1] == {"step": 1, "run": "r1", "attempt": 3}


def test_run_names_that_cannot_name_a_directory_and_incomplete_records(tmp_path):
    writer = RolloutWriter(str(tmp_path / "odd"))
    path = writer.append([rollout_record(make_trajectory(), run="../my run/2", step=0, group=0, attempt=0)])
    assert os.path.relpath(path, tmp_path / "odd").startswith("run=.._my_run_2/step=0/part-")
    assert read_rollouts(str(tmp_path / "odd")).column("run").to_pylist() == ["../my run/2"]  # the exact name
    writer = RolloutWriter(str(tmp_path / "bad"))
    with pytest.raises(ValueError, match="no run name"):
        writer.append([rollout_record(make_trajectory(), run="", step=0, group=0, attempt=0)])
    with pytest.raises(ValueError, match="must be an int >= 0"):
        writer.append([rollout_record(make_trajectory(), run="r", step=0, group=0, attempt=0) | {"step": -1}])
    record = rollout_record(make_trajectory(), run="r", step=0, group=0, attempt=0)
    del record["reward"]
    with pytest.raises(ValueError, match="lacks reward"):
        writer.append([record])
    assert not [f for _, _, fs in os.walk(tmp_path / "bad") for f in fs]  # nothing half-written left behind


def test_readers_never_see_partial_files_while_a_writer_appends(tmp_path):
    root = str(tmp_path)
    writer = RolloutWriter(root)
    record = rollout_record(make_trajectory(), run="live", step=0, group=0, attempt=0)
    done = threading.Event()
    problems: list[str] = []

    def write():
        for _ in range(40):
            writer.append([record] * 20)
        done.set()

    thread = threading.Thread(target=write)
    thread.start()
    seen = []
    while not done.is_set():
        seen.append(read_rollouts(root, columns=["task_id"], on_problem=problems.append).num_rows)
    thread.join()
    assert problems == [] and all(n % 20 == 0 for n in seen)
    assert read_rollouts(root).num_rows == 800


def test_older_version_corrupt_and_incomplete_files_are_reported_and_skipped(tmp_path):
    root = str(tmp_path)
    RolloutWriter(root).append([rollout_record(make_trajectory(), run="r", step=0, group=0, attempt=0)])
    old_dir = tmp_path / "run=r" / "step=1"
    old_dir.mkdir(parents=True)
    # version 0: no run/step in the rows (they come from the path), no split/metadata, an int32 reward
    pq.write_table(
        pa.table(
            {
                "task_id": ["old"],
                "reward": pa.array([1], pa.int32()),
                "stop_reason": ["submit"],
                "turns": [3],
                "legacy_field": ["x"],
            }
        ),
        old_dir / "part-old.parquet",
    )
    (old_dir / "part-corrupt.parquet").write_bytes(b"PAR1 this is not parquet")
    pq.write_table(pa.table({"task_id": ["t"], "turns": [1]}), old_dir / "part-noreward.parquet")
    pq.write_table(
        pa.table({"task_id": ["t"], "reward": ["high"], "stop_reason": ["submit"]}),  # text for a number
        old_dir / "part-textreward.parquet",
    )
    problems: list[str] = []
    table = read_rollouts(root, on_problem=problems.append)
    assert table.num_rows == 2 and table.schema.equals(SCHEMA)
    old = [r for r in table.to_pylist() if r["task_id"] == "old"][0]
    assert (old["run"], old["step"], old["schema_version"], old["split"], old["reward"]) == ("r", 1, 0, "train", 1.0)
    joined = "\n".join(problems)
    assert "part-corrupt.parquet: not a readable Parquet file" in joined
    assert "part-noreward.parquet: lacks required column(s) reward, stop_reason; skipped" in joined
    assert "part-old.parquet: older or different schema" in joined
    assert "part-textreward.parquet: cannot be read as rollouts (column reward has type string" in joined
    assert len(scan_store(root).files) == 2


def test_empty_store_reads_as_empty_table_and_analysis_output_is_not_rollouts(tmp_path):
    assert read_rollouts(str(tmp_path)).num_rows == 0
    # an analysis written into a store directory not named rollouts/ must not be read back as rollouts
    (tmp_path / "analysis" / "judgments.parquet").mkdir(parents=True)
    pq.write_table(
        pa.table({"task_id": ["t"], "reward": [1.0], "stop_reason": ["submit"]}),
        tmp_path / "analysis" / "judgments.parquet" / "0.parquet",
    )
    assert read_rollouts(str(tmp_path), on_problem=pytest.fail).num_rows == 0


def test_a_file_from_a_newer_schema_version_is_read_and_named(tmp_path):
    root = str(tmp_path)
    table = records_to_table(
        [rollout_record(make_trajectory(f"t{i}"), run="r", step=0, group=0, attempt=i) for i in range(3)]
    )
    table = table.set_column(0, "schema_version", pa.array([SCHEMA_VERSION + 1] * 3, pa.int32()))
    os.makedirs(tmp_path / "run=r" / "step=0")
    pq.write_table(
        table.append_column("reviewer", pa.array(["a", "b", "c"])),
        tmp_path / "run=r" / "step=0" / "part-future.parquet",
    )
    problems: list[str] = []
    assert read_rollouts(root, on_problem=problems.append).num_rows == 3  # the rows are not lost
    assert len(problems) == 1, problems  # one sentence, saying what happened and what to do
    assert (
        f"part-future.parquet: written by a newer codefleet (schema version {SCHEMA_VERSION + 1}; this one "
        f"reads up to {SCHEMA_VERSION}); read as version {SCHEMA_VERSION} (ignored unknown column(s) reviewer): "
        "upgrade codefleet to read all of it"
    ) in problems[0]


def test_a_version_1_store_reads_as_before_and_upgrade_store_rewrites_it_for_other_readers(tmp_path):
    """Version 1 repeated run and step in the rows (pandas and pyarrow datasets cannot merge them with the
    path): codefleet still reads such files, and upgrade_store rewrites them as the current version."""
    records = [
        rollout_record(make_trajectory(f"t{i}"), run="demo/v1 run", step=i, group=0, attempt=i) for i in range(2)
    ]
    v1 = records_to_table(records).set_column(0, "schema_version", pa.array([1, 1], pa.int32()))
    for step in (0, 1):
        os.makedirs(tmp_path / "run=demo_v1_run" / f"step={step}")
        pq.write_table(
            v1.filter(pc.equal(v1.column("step"), step)),
            tmp_path / "run=demo_v1_run" / f"step={step}" / "part-v1.parquet",
        )
    RolloutWriter(str(tmp_path)).append(
        [rollout_record(make_trajectory("t2"), run="demo/v1 run", step=1, group=0, attempt=2)]
    )
    problems: list[str] = []
    before = read_rollouts(str(tmp_path), on_problem=problems.append)
    assert before.schema.equals(SCHEMA) and before.num_rows == 3
    assert sorted((r["run"], r["step"], r["attempt"]) for r in before.to_pylist()) == [
        ("demo/v1 run", 0, 0),
        ("demo/v1 run", 1, 1),
        ("demo/v1 run", 1, 2),
    ]
    assert len(problems) == 2 and "repeats the partition key(s) run, step); upgraded on read" in problems[0]
    assert upgrade_store(str(tmp_path), on_problem=pytest.fail) == 2
    after = read_rollouts(str(tmp_path), on_problem=pytest.fail)  # nothing older is left to report
    assert after.sort_by("attempt").to_pylist() == before.sort_by("attempt").to_pylist()
    assert all(pq.read_schema(f.path).equals(FILE_SCHEMA) for f in scan_store(str(tmp_path)).files)
    assert pq.ParquetDataset(str(tmp_path)).read().num_rows == 3  # pandas' and pyarrow's default reader
