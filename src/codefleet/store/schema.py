"""The rollout store's Parquet schema, explicit and versioned (docs/rollouts.md).

One row per finished rollout, flat, so that Ray Data, pandas, DuckDB, polars
or any Parquet reader can scan it without codefleet. The schema is a
`pyarrow.Schema` written down here, never inferred from data: a writer that
produced a different type would corrupt readers silently.

Two schemas. `SCHEMA` is what codefleet's readers return: `run` (the exact
run name) and `step` (int64) among the columns. `FILE_SCHEMA` is what a file
holds: the hive partition keys `run` and `step` live only in the path
(`run=<safe name>/step=<n>/`), and the exact run name in `run_name`. A file
that repeated a partition key as a column would clash with the type every
other reader infers from the path (pyarrow: dictionary<string> and int32),
and pandas, pyarrow datasets, polars and DuckDB refuse to merge the two.
`to_file_table` and `from_file_table` convert between the schemas.

Versions. `SCHEMA_VERSION` is stored in every row (`schema_version`). A file
written by an older version is *upgraded on read* (`upgrade_table`): columns
it lacks are filled with their documented default (`COLUMN_DEFAULTS`, null
otherwise), columns are cast to the current types, unknown columns are
dropped and reported. Version 1 files repeat
`run` and `step` as columns; codefleet reads them as before (third-party
readers need version-2 files: `codefleet.store.parquet.upgrade_store`
rewrites a store). Version 0 is the pre-store layout (the flat fields of
`efficiency()` plus task id, reward, stop reason), without `split`,
`policy_version_*`, `infra_retries`, `error`, `metadata`; it reads as version
1 with those columns defaulted. A column without which a row means nothing
(`REQUIRED_COLUMNS`) cannot be defaulted: such a file is skipped with a
message naming it.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = 2

TOOL_CALL_TYPE = pa.struct(
    [
        pa.field("turn", pa.int32()),
        pa.field("name", pa.string()),
        pa.field("arguments", pa.string()),  # the raw JSON the model wrote, verbatim
        pa.field("duration_s", pa.float64()),
        pa.field("ok", pa.bool_()),
        pa.field("error", pa.string()),
    ]
)

TEST_RESULT_TYPE = pa.struct([pa.field("test", pa.string()), pa.field("passed", pa.bool_())])

SCHEMA = pa.schema(
    [
        pa.field("schema_version", pa.int32()),
        pa.field("run", pa.string()),
        pa.field("step", pa.int64()),
        pa.field("task_id", pa.string()),
        pa.field("family", pa.string()),
        pa.field("group", pa.int64()),
        pa.field("attempt", pa.int64()),
        pa.field("split", pa.string()),
        pa.field("policy_version_min", pa.int64()),
        pa.field("policy_version_max", pa.int64()),
        pa.field("reward", pa.float64()),
        pa.field("checks_passed", pa.int32()),
        pa.field("checks_total", pa.int32()),
        pa.field("all_passed", pa.bool_()),
        pa.field("per_test", pa.list_(TEST_RESULT_TYPE)),
        pa.field("stop_reason", pa.string()),
        pa.field("turns", pa.int32()),
        pa.field("tool_calls", pa.list_(TOOL_CALL_TYPE)),
        pa.field("n_tool_calls", pa.int32()),
        pa.field("tool_calls_per_turn", pa.float64()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("completion_tokens", pa.int64()),
        pa.field("model_s", pa.float64()),
        pa.field("tool_s", pa.float64()),
        pa.field("wall_s", pa.float64()),
        pa.field("infra_retries", pa.int32()),
        pa.field("error", pa.string()),
        pa.field("diff", pa.string()),
        pa.field("transcript", pa.string()),  # the messages, as one JSON array
        pa.field("metadata", pa.string()),  # trajectory.metadata + unknown `extra` keys, as one JSON object
        pa.field("created_at", pa.timestamp("us", tz="UTC")),
    ]
)

# Every field is nullable in Parquet (so files from all versions share one Arrow schema); the writer
# always sets schema_version, run, step, task_id, reward and stop_reason.
COLUMNS = tuple(SCHEMA.names)
REQUIRED_COLUMNS = ("task_id", "reward", "stop_reason")
# run and step live in the hive path (run=<safe name>/step=<step>), never as columns of a file (from version 2)
PATH_COLUMNS = ("run", "step")
RUN_NAME = "run_name"  # the file column holding the exact run name (the directory holds a filesystem-safe one)
FILE_SCHEMA = pa.schema([pa.field(RUN_NAME, pa.string()) if f.name == "run" else f for f in SCHEMA if f.name != "step"])
FILE_COLUMNS = tuple(FILE_SCHEMA.names)
COLUMN_DEFAULTS: dict[str, object] = {
    "split": "train",
    "group": 0,
    "attempt": 0,
    "infra_retries": 0,
    "family": "",
    "metadata": "{}",
    "transcript": "[]",
    "diff": "",
    "per_test": [],
    "tool_calls": [],
}
# Columns added by each version, for docs/rollouts.md and the upgrade report.
ADDED_IN = {
    1: ("split", "policy_version_min", "policy_version_max", "infra_retries", "error", "metadata"),
    2: ("run_name",),
}  # and run, step no longer in the file (the path holds them)


def file_columns(columns: list[str] | tuple[str, ...]) -> list[str]:
    """The FILE_SCHEMA columns to read for SCHEMA `columns` (run comes from run_name, step from the path)."""
    return list(dict.fromkeys(RUN_NAME if c == "run" else c for c in columns if c != "step"))


def to_file_table(table: pa.Table) -> pa.Table:
    """A SCHEMA table as FILE_SCHEMA, for one partition: `step` dropped (the path holds it), `run` as `run_name`."""
    table = table.drop_columns(["step"])
    return table.rename_columns([RUN_NAME if n == "run" else n for n in table.column_names]).cast(FILE_SCHEMA)


def from_file_table(table: pa.Table, *, run: str | None, step: int | None) -> pa.Table:
    """A FILE_SCHEMA table (or a projection of one) with the SCHEMA columns back: `run` from `run_name` (the
    exact name; `run`, the path's name, where the column was not read), `step` from the path; SCHEMA order."""
    n = table.num_rows
    if RUN_NAME in table.column_names:
        run_column = table.column(RUN_NAME)
        table = table.drop_columns([RUN_NAME])
    else:
        run_column = pa.array([run] * n, pa.string())
    by_name = dict(zip(table.column_names, table.columns))
    by_name["run"], by_name["step"] = run_column, pa.array([step] * n, pa.int64())
    names = [name for name in COLUMNS if name in by_name]
    return pa.Table.from_arrays([by_name[name] for name in names], schema=pa.schema([SCHEMA.field(x) for x in names]))


def default_column(name: str, n_rows: int) -> pa.Array:
    """`n_rows` copies of the column's default (null where none is documented)."""
    type_ = SCHEMA.field(name).type
    value = COLUMN_DEFAULTS.get(name)
    if value is None:
        return pa.nulls(n_rows, type_)
    return pa.array([value] * n_rows, type_)


def upgrade_table(table: pa.Table, *, run: str | None = None, step: int | None = None) -> tuple[pa.Table, list[str]]:
    """`table` (any schema version) as the current SCHEMA, and notes on what was changed.

    Raises ValueError naming the missing REQUIRED_COLUMNS when the table cannot be read as rollouts.
    `run`/`step` (from the file's hive path) fill those columns when the file lacks them.
    """
    notes: list[str] = []
    missing_required = [c for c in REQUIRED_COLUMNS if c not in table.column_names]
    if missing_required:
        raise ValueError(f"lacks required column(s) {', '.join(missing_required)}")
    n = table.num_rows
    if RUN_NAME in table.column_names and "run" not in table.column_names:  # version 2: the exact name
        table = table.rename_columns(["run" if c == RUN_NAME else c for c in table.column_names])
    columns = []
    filled = []
    for field in SCHEMA:
        if field.name in table.column_names:
            column = table.column(field.name)
            if column.type != field.type:
                try:
                    column = column.cast(field.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                    raise ValueError(f"column {field.name} has type {column.type}, expected {field.type}: {e}") from e
            columns.append(column)
            continue
        if field.name == "schema_version":
            columns.append(pa.array([0] * n, pa.int32()))
        elif field.name in PATH_COLUMNS and (run if field.name == "run" else step) is not None:
            columns.append(pa.array([run if field.name == "run" else step] * n, field.type))
            continue  # the path holds it (always so for step, from version 2): not a default
        else:
            columns.append(default_column(field.name, n))
        filled.append(field.name)
    if filled:
        notes.append(f"filled missing column(s) {', '.join(filled)} with defaults")
    unknown = [c for c in table.column_names if c not in SCHEMA.names and c != RUN_NAME]
    if unknown:
        notes.append(f"ignored unknown column(s) {', '.join(unknown)}")
    return pa.Table.from_arrays(columns, schema=SCHEMA), notes


def is_current(schema: pa.Schema) -> bool:
    """True when a file's schema needs no upgrade (FILE_SCHEMA's columns, types and order)."""
    return schema.names == FILE_SCHEMA.names and all(a.type == b.type for a, b in zip(schema, FILE_SCHEMA))
