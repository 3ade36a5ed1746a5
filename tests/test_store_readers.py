"""The rollout store opens with the defaults of other readers (pandas, pyarrow datasets, polars, DuckDB, Ray
Data) and they give the same rows as codefleet's read_rollouts; so does the store of a real `codefleet eval --out`.

Each reader infers the partition columns' types from the path its own way (pandas: categories, pyarrow: int32
step, DuckDB and polars: int64, Ray: strings), so rows are compared as values cast to one type, not as dtypes.
"""

from __future__ import annotations

import pyarrow.dataset as ds
import pytest
from test_analysis_store import make_trajectory

from codefleet.store.parquet import RolloutWriter, read_rollouts, rollout_record, run_directory_name

RUNS = ("r1", "demo/v2 run")  # the second needs a filesystem-safe directory name: run=demo_v2_run
STEPS = (0, 1, 12)


def _rows(records) -> list[tuple]:
    """(exact run name, directory run name, step, group, attempt, reward, task_id), sorted, values cast."""
    return sorted(
        (
            str(r["run_name"]),
            str(r["run"]),
            int(r["step"]),
            int(r["group"]),
            int(r["attempt"]),
            float(r["reward"]),
            str(r["task_id"]),
        )
        for r in records
    )


@pytest.fixture
def store(tmp_path):
    writer = RolloutWriter(str(tmp_path / "rollouts"))
    for run in RUNS:
        for step in STEPS:  # two appends per partition: two files in each
            for group in (0, 1):
                writer.append(
                    [
                        rollout_record(
                            make_trajectory(f"t{step}-{group}", passed=attempt == 0),
                            run=run,
                            step=step,
                            group=group,
                            attempt=attempt,
                        )
                        for attempt in range(2)
                    ]
                )
    return str(tmp_path / "rollouts")


@pytest.fixture
def expected(store):
    table = read_rollouts(store, on_problem=pytest.fail)
    rows = [r | {"run_name": r["run"], "run": run_directory_name(r["run"])} for r in table.to_pylist()]
    assert len(rows) == len(RUNS) * len(STEPS) * 4
    assert {r["run_name"] for r in rows} == set(RUNS) and {r["run"] for r in rows} == {"r1", "demo_v2_run"}
    assert table.schema.field("step").type == "int64" and table.schema.field("run").type == "string"
    return _rows(rows)


def test_pandas_defaults(store, expected):
    import pandas as pd

    frame = pd.read_parquet(store)
    assert _rows(frame.to_dict("records")) == expected


def test_pyarrow_dataset_with_hive_partitioning(store, expected):
    table = ds.dataset(store, partitioning="hive").to_table()
    assert _rows(table.to_pylist()) == expected


def test_polars_scan_parquet(store, expected):
    pl = pytest.importorskip("polars")  # the `test` extra installs it

    frame = pl.scan_parquet(f"{store}/**/*.parquet", hive_partitioning=True).collect()
    assert _rows(frame.to_dicts()) == expected


def test_duckdb_read_parquet(store, expected):
    duckdb = pytest.importorskip("duckdb")  # the `test` extra installs it

    frame = duckdb.sql(f"SELECT * FROM read_parquet('{store}/**/*.parquet', hive_partitioning=true)").df()
    assert _rows(frame.to_dict("records")) == expected


def test_ray_data_read_parquet(store, expected, ray_session):
    import ray.data

    rows = (
        ray.data.read_parquet(store)
        .select_columns(["run_name", "run", "step", "group", "attempt", "reward", "task_id"])
        .take_all()
    )
    assert _rows(rows) == expected


def test_the_store_of_codefleet_eval_opens_with_pandas(tmp_path, config, monkeypatch):
    """`codefleet eval --model URL --out DIR` on two tasks; the model is a real HTTP server that answers as the
    scripted expert would (edge of the world)."""
    import pandas as pd
    from openai_stub import OpenAIStub, call, reply

    from codefleet.agent.clients.scripted import ScriptedExpert
    from codefleet.cli import main
    from codefleet.tasks.generate import generate_tasks

    monkeypatch.setenv("CODEFLEET_STATE_DIR", config.state_dir)
    tasks = generate_tasks(str(tmp_path / "tasks"), n=2, seed=3, families=["bugfix"], split="test")

    def expert(body: dict):
        task_message = next(m["content"] for m in body["messages"] if m["role"] == "user")
        task = next(t for t in tasks if t.instruction.strip() in task_message)
        out = ScriptedExpert(task).generate(body["messages"], body.get("tools") or [])
        return reply(out.text, *[call(c.name, c.raw_arguments) for c in out.tool_calls])

    with OpenAIStub([expert] * 40) as stub:
        assert (
            main(
                [
                    "eval",
                    "--tasks",
                    str(tmp_path / "tasks"),
                    "--model",
                    stub.base_url,
                    "--jobs",
                    "2",
                    "--attempts",
                    "2",
                    "--json",
                    "--out",
                    str(tmp_path / "ev"),
                ]
            )
            == 0
        )
    frame = pd.read_parquet(tmp_path / "ev" / "rollouts")
    ours = read_rollouts(str(tmp_path / "ev"), on_problem=pytest.fail)
    assert len(frame) == ours.num_rows == 4 and set(frame["split"]) == {"eval"}
    assert sorted(zip(frame["run_name"], frame["step"].astype(int), frame["task_id"], frame["attempt"])) == sorted(
        zip(*[ours.column(c).to_pylist() for c in ("run", "step", "task_id", "attempt")])
    )
