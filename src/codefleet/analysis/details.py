"""Rollout ids, and the full rows behind the report's tables (transcripts, tool calls, diffs, checks).

A rollout's id is `<run>/<step>/<task_id>/<group>/<attempt>` ("-" for a missing part): readable, stable
across analyses, and computed from store columns alone, so the same id names the same rollout in
judgments.parquet, summary.json and the report. The main pass never carries transcripts; once the tables
are chosen, `fetch_details` reads the heavy columns of just those rollouts, one step's partition at a time
(the only files that can hold them), so memory stays bounded by one partition.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from codefleet.store.parquet import StoreScan
from codefleet.store.schema import file_columns, from_file_table, upgrade_table

ID_COLUMNS = ["run", "step", "task_id", "group", "attempt"]
DETAIL_COLUMNS = ["per_test", "diff", "transcript", "tool_calls", "metadata", "error"]


def rollout_ids(table: pa.Table) -> pa.Array:
    """The id of each row of `table` (which has ID_COLUMNS)."""
    parts = [pc.fill_null(table.column(c).cast(pa.string()), "-") for c in ID_COLUMNS]
    return pc.binary_join_element_wise(*parts, "/").combine_chunks() if table.num_rows else pa.array([], pa.string())


def with_rollout_id(table: pa.Table) -> pa.Table:
    return table.append_column("rollout_id", rollout_ids(table))


def _read_partition(files, wanted: set[str]) -> list[dict]:
    """The rows of `files` (one partition's StoreFiles) whose ids are in `wanted`, as SCHEMA dicts."""
    columns = ID_COLUMNS + DETAIL_COLUMNS
    out = []
    for f in files:
        if f.current:
            table = pq.read_table(f.path, columns=[c for c in file_columns(columns) if c in f.schema.names])
            table = from_file_table(table, run=f.run, step=f.step)
        else:
            table, _ = upgrade_table(pq.read_table(f.path), run=f.run, step=f.step)
        table = table.select([c for c in columns if c in table.column_names])
        ids = rollout_ids(table)
        table = table.append_column("rollout_id", ids).filter(pc.is_in(ids, pa.array(sorted(wanted), pa.string())))
        out += table.to_pylist()
    return out


def fetch_details(scan: StoreScan, rows: list[dict]) -> Iterator[dict]:
    """Each table row of `rows` (distinct rollout ids) with its store row's heavy columns added: per_test, diff,
    transcript (parsed into a list of messages), tool_calls, metadata (parsed), error. A row whose rollout is no
    longer in the store comes back as it was."""
    by_id = {r["rollout_id"]: r for r in rows}
    partitions: dict[int | None, set[str]] = {}
    for r in by_id.values():
        partitions.setdefault(r["step"], set()).add(r["rollout_id"])
    found = set()
    for step, wanted in sorted(partitions.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
        files = [f for f in scan.files if f.step == step]  # the run's name in a path may be escaped: ids decide
        for stored in _read_partition(files, wanted):
            if stored["rollout_id"] in found:
                continue  # the same id twice in a partition: the first is shown
            found.add(stored["rollout_id"])
            yield {
                **by_id[stored["rollout_id"]],
                **{c: stored.get(c) for c in DETAIL_COLUMNS},
                "transcript": _parsed(stored.get("transcript"), []),
                "metadata": _parsed(stored.get("metadata"), {}),
            }
    for rollout_id, row in by_id.items():
        if rollout_id not in found:
            yield row


def _parsed(text: str | None, default):
    try:
        value = json.loads(text) if text else default
    except ValueError:
        return default
    return value if isinstance(value, type(default)) else default
