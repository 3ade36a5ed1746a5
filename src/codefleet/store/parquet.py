"""The rollout store: every finished rollout as one Parquet row (schema: schema.py, docs/rollouts.md).

    writer = RolloutWriter(os.path.join(run_dir, "rollouts"))
    writer.append([rollout_record(traj, run="r1", step=3, group=0, attempt=i) for i, traj in enumerate(trajs)])
    table = read_rollouts(os.path.join(run_dir, "rollouts"))

Layout: hive partitions `root/run=<run>/step=<step>/part-<uuid>.parquet`.
The files hold `FILE_SCHEMA` (schema.py): every column but the partition keys
`run` and `step`, which live in the path only, so that pandas, pyarrow
datasets, polars, DuckDB and Ray Data read the store with their defaults
(a key repeated in the file with another type than the one they infer from
the path is a merge error for most of them).
Each `append` writes NEW files only, never rewrites one: a file is written
under a hidden temporary name in its partition directory and then
`os.replace`d to its final name, which is atomic on POSIX. A reader scanning
while a run is live therefore sees whole files or nothing, never half a
file; temporary names start with "." and end in ".tmp", which every reader
here (and Ray Data's `.parquet` extension filter) ignores. Small appends make
small files; the analytics pipeline does not care, and a run writes one file
per step and group batch.

The root may be an fsspec URL (`s3://bucket/run/rollouts`, codefleet.store.storage): each new file is then
serialised in memory and written with one PUT (`storage.put_file_atomic`, a temporary name and a rename for
`file://`), so a reader of the bucket sees whole files only, as on a local disk. Reading takes a local
directory (download a URL's store first, e.g. `storage.download_dir`).

The directory holds a filesystem-safe run name (`run_directory_name`: the
name itself when it is safe), the `run_name` column the exact one, so a file
copied out of its directory still names its run; its step is in the path
only. codefleet's readers return `SCHEMA`, with `run` (the exact name, from
`run_name`) and `step` (int64, from the path) as columns, as before.
`upgrade_store` rewrites the files of older versions (which repeat `run` and
`step` in the rows) so that third-party readers open the store too.

Reading (`scan_store`, `read_rollouts`) validates each file's footer first: a
corrupt or truncated file, or one lacking a required column, is skipped and
reported by path; files of older schema versions are upgraded (schema.py).
"""

from __future__ import annotations

import json
import numbers
import os
import re
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from codefleet.store import safe_files, storage
from codefleet.store.schema import (
    COLUMNS,
    FILE_COLUMNS,
    REQUIRED_COLUMNS,
    RUN_NAME,
    SCHEMA,
    SCHEMA_VERSION,
    file_columns,
    from_file_table,
    is_current,
    to_file_table,
    upgrade_table,
)
from codefleet.types import Trajectory

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "RolloutWriter",
    "StoreScan",
    "find_store",
    "read_rollouts",
    "records_to_table",
    "rollout_record",
    "scan_store",
    "upgrade_store",
]

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def run_directory_name(run: str) -> str:
    """The run's directory is `run=<this>`: its name with anything but letters, digits, '.', '_', '-'
    replaced by '_' (the `run=` prefix keeps even ".." a plain name). The rows keep the exact name."""
    return _UNSAFE.sub("_", run)


_MAX_ERROR_CHARS = 500


def rollout_record(
    trajectory: Trajectory,
    *,
    run: str,
    step: int,
    group: int,
    attempt: int,
    split: str = "train",
    extra: dict | None = None,
) -> dict:
    """One flat store row for a finished (scored) trajectory. `extra` keys are merged in: a key that
    is a column (e.g. "infra_retries") sets it, any other key lands in the `metadata` JSON."""
    results = {r.call_id: r for turn in trajectory.turns for r in turn.tool_results}
    tool_calls = []
    for turn in trajectory.turns:
        for call in turn.tool_calls:
            result = results.get(call.id)
            error = call.error
            if error is None and result is not None and not result.ok:
                error = result.output[:_MAX_ERROR_CHARS]
            if error is None and result is None:
                error = "no result recorded"
            tool_calls.append(
                {
                    "turn": turn.index,
                    "name": call.name,
                    "arguments": call.raw_arguments,
                    "duration_s": result.duration_s if result else 0.0,
                    "ok": error is None and bool(result and result.ok),
                    "error": error,
                }
            )
    versions = [v for turn in trajectory.turns for v in (turn.policy_versions or [])]
    checks = trajectory.checks
    meta = trajectory.metadata
    record = {
        "schema_version": SCHEMA_VERSION,
        "run": run,
        "step": int(step),
        "task_id": trajectory.task_id,
        "family": str(meta.get("task.family", "")),
        "group": int(group),
        "attempt": int(attempt),
        "split": split,
        "policy_version_min": min(versions) if versions else None,
        "policy_version_max": max(versions) if versions else None,
        "reward": float(trajectory.reward),
        "checks_passed": checks.passed if checks else None,
        "checks_total": checks.total if checks else None,
        "all_passed": checks.all_passed if checks else None,
        "per_test": [{"test": k, "passed": bool(v)} for k, v in (checks.per_test if checks else {}).items()],
        "stop_reason": trajectory.stop_reason,
        "turns": trajectory.n_turns,
        "tool_calls": tool_calls,
        "n_tool_calls": trajectory.n_tool_calls,
        "tool_calls_per_turn": float(trajectory.tool_calls_per_turn),
        "prompt_tokens": sum(t.prompt_tokens for t in trajectory.turns),
        "completion_tokens": sum(t.completion_tokens for t in trajectory.turns),
        "model_s": float(trajectory.model_s),
        "tool_s": float(trajectory.tool_s),
        "wall_s": float(trajectory.wall_s),
        "infra_retries": 0,
        "error": meta.get("error") or meta.get("checks_error") or None,
        "diff": trajectory.diff,
        "transcript": json.dumps(trajectory.messages, default=str),
        "metadata": meta,
        "created_at": datetime.now(UTC),
    }
    record.update(extra or {})
    return record


def records_to_table(records: list[dict]) -> pa.Table:
    """Rows as a table of exactly SCHEMA (what readers return; a file holds `to_file_table` of it); keys that are not
    columns go into each row's `metadata` JSON."""
    rows = []
    for record in records:
        meta = record.get("metadata") or {}
        meta = dict(json.loads(meta) if isinstance(meta, str) else meta)
        meta.update({k: v for k, v in record.items() if k not in SCHEMA.names})
        row = {name: record.get(name) for name in COLUMNS}
        row["metadata"] = json.dumps(meta, default=str, sort_keys=True)
        row["schema_version"] = row["schema_version"] or SCHEMA_VERSION
        row["created_at"] = row["created_at"] or datetime.now(UTC)
        missing = [c for c in ("run", "step", *REQUIRED_COLUMNS) if row.get(c) is None]
        if missing:
            raise ValueError(f"rollout record lacks {', '.join(missing)}; build records with rollout_record()")
        rows.append(row)
    return pa.Table.from_pylist(rows, schema=SCHEMA)


class RolloutWriter:
    """Appends rollouts to a store directory (normally RUN_DIR/rollouts) or URL; safe while readers scan it.
    Several writers (processes) may append to the same store: file names are unique. `beneath`: the directory
    the user named (default: the store's parent, RUN_DIR); no link below it is followed (safe_files)."""

    def __init__(self, root: str, compression: str = "zstd", beneath: str | None = None):
        self.root = root
        self.compression = compression
        self.beneath = beneath or storage.parent(storage.absolute(root))
        storage.makedirs(root, root=self.beneath)

    def append(self, records: list[dict]) -> str:
        """Write `records` as one new file per (run, step) partition; returns the path(s) written,
        ", "-joined when the records span several partitions ("" for no records)."""
        by_partition: dict[tuple[str, int], list[dict]] = {}
        for record in records:
            run, step = str(record.get("run") or ""), record.get("step")
            if not run:
                raise ValueError("a rollout record has no run name; build records with rollout_record(run=...)")
            if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
                raise ValueError(f"step {step!r} of run {run!r} must be an int >= 0")
            by_partition.setdefault((run, int(step)), []).append(record)
        paths = []
        for (run, step), rows in by_partition.items():
            if storage.is_url(self.root):
                paths.append(self._put(rows, run, step))
                continue
            directory = os.path.join(self.root, f"run={run_directory_name(run)}", f"step={step}")
            path = os.path.join(directory, f"part-{uuid.uuid4().hex}.parquet")
            table = to_file_table(records_to_table(rows))
            safe_files.write_file_beneath(
                self.beneath,
                path,
                lambda f, table=table: pq.write_table(table, f, compression=self.compression),
                mode=0o644,
            )
            paths.append(path)
        return ", ".join(paths)

    def _put(self, rows: list[dict], run: str, step: int) -> str:
        """One new file of `rows` under a URL root, written whole with one PUT."""
        buffer = pa.BufferOutputStream()
        pq.write_table(to_file_table(records_to_table(rows)), buffer, compression=self.compression)
        url = storage.join(
            self.root, f"run={run_directory_name(run)}", f"step={step}", f"part-{uuid.uuid4().hex}.parquet"
        )
        storage.put_file_atomic(url, buffer.getvalue().to_pybytes(), root=self.beneath)
        return url


# -- reading ---------------------------------------------------------------------------------------


@dataclass
class StoreFile:
    path: str
    rows: int
    current: bool  # schema needs no upgrade
    schema: pa.Schema
    run: str | None = None  # from the hive path
    step: int | None = None


@dataclass
class StoreScan:
    root: str
    files: list[StoreFile] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # one sentence per skipped or upgraded file

    @property
    def rows(self) -> int:
        return sum(f.rows for f in self.files)


def find_store(path: str) -> str:
    """The store directory for `path`: PATH/rollouts when it exists (a run directory), else PATH itself."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory; pass a run directory (with rollouts/) or a store")
    candidate = os.path.join(path, "rollouts")
    return candidate if os.path.isdir(candidate) else path


def partition_values(path: str) -> tuple[str | None, int | None]:
    run = step = None
    for part in path.split(os.sep):
        if part.startswith("run="):
            run = part[4:]
        elif part.startswith("step=") and part[5:].isdigit():
            step = int(part[5:])
    return run, step


def scan_store(root: str) -> StoreScan:
    """Every readable `.parquet` file under `root` (sorted), with problems for the ones skipped. Hidden
    files and directories, `analysis/` and `*.parquet/` directories (analysis output) are not scanned."""
    scan = StoreScan(root)
    paths = []
    for directory, dirs, files in os.walk(root):
        # hidden dirs, and an analysis written into the store (analysis/, judgments.parquet/), are not rollouts
        dirs[:] = sorted(
            d for d in dirs if not d.startswith((".", "_")) and d != "analysis" and not d.endswith(".parquet")
        )
        paths += [os.path.join(directory, f) for f in files if f.endswith(".parquet") and not f.startswith((".", "_"))]
    for path in sorted(paths):
        try:
            meta = pq.read_metadata(path)
            schema = meta.schema.to_arrow_schema()
        except Exception as e:  # truncated, not Parquet, unreadable
            why = " ".join(str(e).split())[:200]
            scan.problems.append(f"{path}: not a readable Parquet file ({type(e).__name__}: {why}); skipped")
            continue
        missing = [c for c in REQUIRED_COLUMNS if c not in schema.names]
        if missing:
            scan.problems.append(f"{path}: lacks required column(s) {', '.join(missing)}; skipped")
            continue
        run, step = partition_values(os.path.relpath(path, root))
        current = is_current(schema)
        newer = _newest_version(path, schema)
        notes: list[str] = []
        if not current:
            try:  # a column of another type may not cast (text where a number belongs): find out now, not mid-pipeline
                _, notes = upgrade_table(pq.read_table(path), run=run, step=step)
            except Exception as e:
                why = " ".join(str(e).split())[:200]
                scan.problems.append(f"{path}: cannot be read as rollouts ({why}); skipped")
                continue
        if newer > SCHEMA_VERSION:  # read what this version knows rather than lose the rows; say so
            scan.problems.append(
                f"{path}: written by a newer codefleet (schema version {newer}; this one reads up to "
                f"{SCHEMA_VERSION}); read as version {SCHEMA_VERSION}"
                f"{' (' + '; '.join(notes) + ')' if notes else ''}: upgrade codefleet to read all of it"
            )
        elif not current:
            names = set(schema.names) | ({RUN_NAME} if "run" in schema.names else set())
            lacking = [c for c in FILE_COLUMNS if c not in names]
            unknown = [n for n in notes if n.startswith("ignored")]
            keys = [c for c in ("run", "step") if c in schema.names]
            scan.problems.append(
                f"{path}: older or different schema (lacks {', '.join(lacking) or 'nothing'}"
                f"{'; ' + unknown[0] if unknown else ''}"
                f"{'; repeats the partition key(s) ' + ', '.join(keys) if keys else ''}); "
                "upgraded on read (codefleet.store.parquet.upgrade_store rewrites it for other readers)"
            )
        scan.files.append(StoreFile(path, meta.num_rows, current, schema, run, step))
    return scan


def _newest_version(path: str, schema: pa.Schema) -> int:
    """The highest schema_version in a file's rows (0 when it has no such column or no rows)."""
    if "schema_version" not in schema.names:
        return 0
    try:
        newest = pc.max(pq.read_table(path, columns=["schema_version"]).column(0)).as_py()
    except (OSError, pa.ArrowException):  # pages that do not read: the pipeline names the file (unreadable_bodies)
        return 0
    return int(newest or 0)


def read_file(store_file: StoreFile, columns: list[str] | None = None) -> pa.Table:
    """One store file as SCHEMA (upgraded if needed), optionally projected to `columns`."""
    if store_file.current:
        # read only what is asked for; pq.read_table of one file adds no columns from its path
        table = pq.read_table(store_file.path, columns=file_columns(columns or COLUMNS))
        table = from_file_table(table, run=store_file.run, step=store_file.step)
    else:
        table, _ = upgrade_table(pq.read_table(store_file.path), run=store_file.run, step=store_file.step)
    return table.select(columns) if columns else table


def read_rollouts(
    root: str, columns: list[str] | None = None, on_problem: Callable[[str], None] | None = None
) -> pa.Table:
    """The whole store as one table (small scale: tests, eval summaries; use codefleet.analysis.pipeline
    for big stores). Skipped and upgraded files are reported through `on_problem` (default: stderr)."""
    report = on_problem or (lambda msg: print(f"rollout store: {msg}", file=sys.stderr))
    scan = scan_store(find_store(root))
    for problem in scan.problems:
        report(problem)
    tables = []
    for store_file in scan.files:
        try:
            tables.append(read_file(store_file, columns))
        except Exception as e:  # a footer that reads but a body that does not
            report(f"{store_file.path}: could not be read ({type(e).__name__}: {e}); skipped")
    if not tables:
        return SCHEMA.empty_table().select(columns) if columns else SCHEMA.empty_table()
    return pa.concat_tables(tables)


def upgrade_store(root: str, on_problem: Callable[[str], None] | None = None) -> int:
    """Rewrite every file of an older schema version under the store `root` as the current version (a new
    file, then the old one removed), so that readers other than codefleet's open the store; returns the
    number of files rewritten. Rows are unchanged as codefleet reads them. Not while a run writes the store
    (a reader could count a rewritten file twice for a moment)."""
    report = on_problem or (lambda msg: print(f"rollout store: {msg}", file=sys.stderr))
    store = find_store(root)
    scan = scan_store(store)
    rewritten = 0
    for store_file in scan.files:
        if store_file.current:
            continue
        if store_file.run is None or store_file.step is None:  # its step would be lost: the path must hold it
            report(f"{store_file.path}: not under run=<run>/step=<step>/; left as it is")
            continue
        try:
            table = to_file_table(read_file(store_file))
        except Exception as e:  # a body that does not read: leave the file as it is
            report(f"{store_file.path}: could not be read ({type(e).__name__}: {e}); left as it is")
            continue
        final = os.path.join(os.path.dirname(store_file.path), f"part-{uuid.uuid4().hex}.parquet")
        # nothing below the store is followed: a link planted in it is refused, never written or removed through
        safe_files.write_file_beneath(
            store, final, lambda f, table=table: pq.write_table(table, f, compression="zstd"), mode=0o644
        )
        safe_files.remove_beneath(store, store_file.path)
        rewritten += 1
    return rewritten
