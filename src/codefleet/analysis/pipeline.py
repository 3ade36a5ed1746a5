"""`codefleet analyze`: the Ray Data pipeline over a rollout store.

    result = analyze("runs/r1", AnalyzeConfig(judge=JudgeConfig(backend="http://127.0.0.1:8000/v1")))

Stages (all streaming; the driver never holds the rollouts):

    scan_store          footers checked; corrupt or incomplete files reported by name and left out
                        (a file whose footer reads but whose pages do not fails the first pass; then
                        every file is read through once, the broken ones named and left out, and the
                        pass runs again)
      -> read_parquet   one read per schema: current files projected to the needed columns (run
                        from run_name, step from the path, schema.from_file_table), older ones
                        read whole and upgraded (schema.upgrade_table) in map_batches
      -> map_batches(categorise)       rules: category, findings, tool statistics (rules.py)
      -> map_batches(judge)            rules verdict (a task), or JudgeBatch on an actor pool
      -> write_parquet  OUT/judgments.parquet/ (a directory of Parquet files: one dataset); the judge
                        stage counts its rows in a RowCounter actor, which the driver's bar reads
    read judgments back -> aggregate (aggregate.py): summary.json, the report's tables, rules clusters
      -> map_batches(ClusterBatch)     with a model judge: the reasons of failures and suspicious wins
                        grouped into labelled clusters (clusters.py)
    the tables' rollouts: transcripts, diffs, checks read from the store (details.py) -> report.html

Judgments are written first and aggregated from disk so that the judge (the
expensive part) runs exactly once whatever the number of aggregates. OUT is
locked (`OUT/.analyze.lock`) while an analysis writes it: a second analysis of
the same run into the same OUT waits rather than mixing its judgments in.

Bounded memory: rows move in blocks of `batch_rows`; transcripts and diffs are
read only when a model judge needs them and are dropped before writing; Ray
Data's streaming executor holds a bounded number of blocks in flight
(`max_blocks_in_flight_mb` caps the object store it may use).

Small machines: on 2 CPUs an actor pool that takes whole CPUs can leave Ray
Data's read tasks nothing to run on and the pipeline hangs (ray#44687). The
judge actors ask for `JudgeConfig.actor_num_cpus` (0.25) each and at most
`actors` of them, the read and rules tasks for `task_num_cpus` (0.5), so
reads, rules and judges always fit together on one CPU.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import pyarrow as pa
import pyarrow.parquet as pq
import ray.data
from ray.data import ActorPoolStrategy
from tqdm import tqdm

from codefleet.analysis import rules
from codefleet.analysis.aggregate import summarise, write_summary
from codefleet.analysis.cluster_stage import ClusterBatch, judge_clusters
from codefleet.analysis.clusters import ClusterConfig
from codefleet.analysis.details import fetch_details, with_rollout_id
from codefleet.analysis.judge import JUDGE_COLUMNS, JudgeBatch, JudgeConfig, rules_verdict
from codefleet.analysis.overview import overview
from codefleet.analysis.report import PAGES_DIR, write_report
from codefleet.fleet.ray_init import init_ray
from codefleet.store import safe_files
from codefleet.store.parquet import StoreScan, find_store, partition_values, scan_store
from codefleet.store.schema import COLUMNS, file_columns, from_file_table, upgrade_table

# store columns carried into judgments.parquet
KEEP_COLUMNS = [
    "run",
    "step",
    "task_id",
    "family",
    "group",
    "attempt",
    "split",
    "policy_version_min",
    "policy_version_max",
    "reward",
    "checks_passed",
    "checks_total",
    "all_passed",
    "stop_reason",
    "turns",
    "n_tool_calls",
    "tool_calls_per_turn",
    "prompt_tokens",
    "completion_tokens",
    "model_s",
    "tool_s",
    "wall_s",
    "infra_retries",
    "error",
]
JUDGMENT_COLUMNS = ["rollout_id"] + KEEP_COLUMNS + rules.JUDGMENT_RULE_COLUMNS + JUDGE_COLUMNS


class NoRollouts(Exception):
    """The directory holds no readable rollouts."""


@dataclass
class AnalyzeConfig:
    out_dir: str = ""  # "": RUN_DIR/analysis
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    batch_rows: int = 2048  # rows per rules batch
    task_num_cpus: float = 0.5  # per read/rules task
    max_blocks_in_flight_mb: int = 256  # object store budget of the streaming executor
    shuffle_partitions: int = 2  # hash partitions (and aggregator actors) per groupby
    aggregator_num_cpus: float = 0.1  # per groupby aggregator actor
    shuffle_aggregate: bool = False  # sum partial aggregates with a Ray Data groupby (clusters) instead of the driver
    worst_failures: int = 20  # rows in the report's tables
    suspicious_wins: int = 50
    browse_rows: int = 500  # rollouts in the report's browse table (every one in a smaller run, else a sample)
    clusters: ClusterConfig = field(default_factory=ClusterConfig)
    report: bool = True  # write report.html (matplotlib)
    progress: bool = False  # Ray Data progress bars
    num_cpus: int | None = None  # for a local Ray started by analyze() (None: min(cores, 8), at least 2)
    object_store_mb: int | None = 1024  # object store of a local Ray started by analyze() (None: Ray's 30% of RAM)


@dataclass
class AnalysisResult:
    out_dir: str
    summary: dict
    problems: list[str]  # files skipped or upgraded, judge failures: one sentence each
    timings_s: dict[str, float]


def _by_file(batch: pa.Table, convert: Callable[..., pa.Table]) -> pa.Table:
    """`convert(rows, run=, step=)` over each file's rows of `batch` (read with include_paths; a file's
    rows are contiguous), run/step from the file's hive path."""

    parts = []
    paths = batch.column("path").to_pylist()
    start = 0
    for i in range(1, len(paths) + 1):
        if i == len(paths) or paths[i] != paths[start]:
            run, step = partition_values(paths[start])
            parts.append(convert(batch.slice(start, i - start).drop_columns(["path"]), run=run, step=step))
            start = i
    return pa.concat_tables(parts) if parts else convert(batch.drop_columns(["path"]), run=None, step=None)


def _from_file(batch: pa.Table) -> pa.Table:
    """Current-version rows as SCHEMA columns (run from run_name, step from the path: schema.py) and their id."""
    return with_rollout_id(_by_file(batch, from_file_table))


def _upgrade(batch: pa.Table) -> pa.Table:
    """Older-schema rows as the current schema, run/step from their path where the file lacks them, and their id."""
    return with_rollout_id(_by_file(batch, lambda table, run, step: upgrade_table(table, run=run, step=step)[0]))


def read_store(scan: StoreScan, columns: list[str], config: AnalyzeConfig):
    """One Ray Dataset of every readable file in `scan`, as the current schema projected to `columns` (which
    must include details.ID_COLUMNS), plus `rollout_id`."""
    columns = [*columns, "rollout_id"]
    current = [f.path for f in scan.files if f.current]
    by_schema: dict[tuple[str, ...], list[str]] = {}
    for f in scan.files:
        if not f.current:
            by_schema.setdefault(tuple(f.schema.names), []).append(f.path)
    datasets = []
    if current:
        # the projection is read from the files; step lives in their paths only
        ds = ray.data.read_parquet(
            current, partitioning=None, include_paths=True, num_cpus=config.task_num_cpus
        ).select_columns([*file_columns(columns[:-1]), "path"])  # pushed down into the Parquet read
        datasets.append(
            ds.map_batches(_from_file, batch_format="pyarrow", num_cpus=config.task_num_cpus).select_columns(columns)
        )
    for _names, paths in by_schema.items():
        ds = ray.data.read_parquet(paths, partitioning=None, include_paths=True, num_cpus=config.task_num_cpus)
        datasets.append(
            ds.map_batches(_upgrade, batch_format="pyarrow", num_cpus=config.task_num_cpus).select_columns(columns)
        )
    return datasets[0].union(*datasets[1:]) if len(datasets) > 1 else datasets[0]


_SETTINGS = (
    "enable_progress_bars",
    "print_on_execution_start",
    "default_hash_shuffle_parallelism",
    "max_hash_shuffle_aggregators",
    "hash_aggregate_operator_actor_num_cpus_override",
    "hash_shuffle_operator_actor_num_cpus_override",
)


@contextlib.contextmanager
def ray_data_settings(config: AnalyzeConfig):
    """Ray Data settings for the analysis, restored afterwards (ray.data.DataContext is process-global)."""
    ctx = ray.data.DataContext.get_current()
    saved = {name: getattr(ctx, name) for name in _SETTINGS}
    saved_limits = ctx.execution_options.resource_limits
    ctx.enable_progress_bars = config.progress
    ctx.print_on_execution_start = config.progress
    ctx.execution_options.resource_limits = saved_limits.copy(
        object_store_memory=config.max_blocks_in_flight_mb * 1024 * 1024
    )
    # groupby runs as a hash shuffle on aggregator actors: few partitions, few actors, fractional CPUs,
    # or on 2 CPUs they would wait for CPUs the other operators hold (the ray#44687 pattern again)
    ctx.default_hash_shuffle_parallelism = config.shuffle_partitions
    ctx.max_hash_shuffle_aggregators = config.shuffle_partitions
    ctx.hash_aggregate_operator_actor_num_cpus_override = config.aggregator_num_cpus
    ctx.hash_shuffle_operator_actor_num_cpus_override = config.aggregator_num_cpus
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(ctx, name, value)
        ctx.execution_options.resource_limits = saved_limits


def unreadable_bodies(scan: StoreScan) -> list[str]:
    """Read every file of `scan` through, one record batch at a time (bounded memory); drop the files
    that fail from `scan.files` and return one message per dropped file."""

    messages, good = [], []
    for store_file in scan.files:
        try:
            for _ in pq.ParquetFile(store_file.path).iter_batches(batch_size=1024):
                pass
            good.append(store_file)
        except Exception as e:
            why = " ".join(str(e).split())[:200]
            messages.append(f"{store_file.path}: its data could not be read ({type(e).__name__}: {why}); skipped")
    scan.files = good
    return messages


def judgments_dataset(scan: StoreScan, config: AnalyzeConfig, counter=None):
    """The lazy pipeline from the store to one judgment row per rollout (JUDGMENT_COLUMNS); the judge stage tells
    `counter` (a RowCounter) how many rows it judged."""
    kind = config.judge.kind
    needs_text = kind != "rules"
    columns = list(dict.fromkeys(KEEP_COLUMNS + rules.INPUT_COLUMNS + (["transcript"] if needs_text else [])))
    drop = ("tool_calls",) if needs_text else ("tool_calls", "diff")
    ds = read_store(scan, [c for c in COLUMNS if c in columns], config)
    ds = ds.map_batches(
        rules.categorise,
        fn_kwargs={"drop": drop},
        batch_format="pyarrow",
        batch_size=config.batch_rows,
        num_cpus=config.task_num_cpus,
    )
    if kind == "rules":
        ds = ds.map_batches(
            rules_verdict,
            fn_kwargs={"counter": counter} if counter else None,
            batch_format="pyarrow",
            num_cpus=config.task_num_cpus,
        )
    else:
        ds = ds.map_batches(
            JudgeBatch.configured(config.judge, config.judge.rubric(), counter),
            batch_format="pyarrow",
            batch_size=config.judge.batch_rows,
            compute=ActorPoolStrategy(min_size=1, max_size=max(1, config.judge.actors)),
            num_cpus=config.judge.actor_num_cpus,
        )
    return ds.select_columns(JUDGMENT_COLUMNS)


def ensure_ray(num_cpus: int | None = None, object_store_mb: int | None = None) -> None:
    """Start a local Ray with explicit CPUs when none is running in this process (never silently join a
    `ray start` cluster someone else left on the machine); RAY_ADDRESS=<address> connects to a cluster."""

    init_ray(num_cpus or max(2, min(os.cpu_count() or 2, 8)), object_store_mb=object_store_mb)


def output_root(path: str, config: AnalyzeConfig) -> str:
    """The directory the user named for the analysis of `path`: config.out_dir, else the run directory. Nothing
    below it is reached through a link (codefleet.store.safe_files). FileNotFoundError when there is no store."""
    if config.out_dir:
        return config.out_dir
    store = find_store(path)
    return os.path.dirname(store) if os.path.basename(os.path.normpath(store)) == "rollouts" else store


def output_dir(path: str, config: AnalyzeConfig) -> str:
    """Where the analysis of `path` (a run directory or its store) goes: config.out_dir, else RUN_DIR/analysis.
    FileNotFoundError when there is no store."""
    root = output_root(path, config)
    return root if config.out_dir else os.path.join(root, "analysis")


def analyze(
    path: str,
    config: AnalyzeConfig | None = None,
    log: Callable[[str], None] | None = None,
    progress_to: TextIO | None = None,
) -> AnalysisResult:
    """Analyse the store under `path` (a run directory or the store itself); raises NoRollouts when empty.
    `progress_to`: a terminal stream for a progress bar over the rows judged (None: no bar)."""
    config = config or AnalyzeConfig()
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    _ = config.judge.kind  # an unknown backend fails here, before any work
    store, root, out_dir = find_store(path), output_root(path, config), output_dir(path, config)
    timings: dict[str, float] = {}
    started = time.perf_counter()
    scan = scan_store(store)
    problems = list(scan.problems)
    for problem in problems:
        log(f"codefleet analyze: {problem}")
    if not scan.files:
        raise NoRollouts(
            f"no readable rollouts under {store} (expected rollouts/run=<run>/step=<step>/*.parquet, "
            "written by codefleet.store.parquet.RolloutWriter)"
        )
    if not scan.rows:
        raise NoRollouts(
            f"no rollouts under {store}: its {len(scan.files)} Parquet file(s) hold no rows; "
            "analyse the run once it has finished rollouts"
        )
    # a link where the outputs go is refused now, before the judge's work, not after it
    safe_files.makedirs_beneath(root, os.path.join(out_dir, PAGES_DIR) if config.report else out_dir)
    ensure_ray(config.num_cpus, config.object_store_mb)
    with ray_data_settings(config), output_lock(out_dir, log, root):
        return _analyze_scan(scan, store, root, out_dir, config, log, problems, timings, started, progress_to)


@contextlib.contextmanager
def output_lock(out_dir: str, log: Callable[[str], None], root: str | None = None):
    """Hold OUT/.analyze.lock: a second analysis into the same directory waits for the first instead of
    deleting its judgments mid-write or adding its own files to them (doubling every count). `root`: the
    directory the user named (default out_dir), below which no link is followed."""
    with safe_files.append_beneath(root or out_dir, os.path.join(out_dir, ".analyze.lock")) as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(
                f"codefleet analyze: another analysis is writing {out_dir}; waiting for it to finish "
                "(pass --out DIR to run both at once)"
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@ray.remote(num_cpus=0)
class RowCounter:
    """How many rows the judge stage has finished: its tasks and actors add, the driver's progress bar reads."""

    def __init__(self):
        self.rows = 0

    def add(self, n: int) -> None:
        self.rows += n

    def get(self) -> int:
        return self.rows


def write_judgments(scan: StoreScan, config: AnalyzeConfig, path: str, progress_to: TextIO | None) -> None:
    """Run the pipeline and write its judgments to `path`/ (Ray Data's write_parquet: the workers write), with a
    bar over the rows judged on `progress_to` (a RowCounter the judge stage adds to, read every half second)."""
    if progress_to is None:
        judgments_dataset(scan, config).write_parquet(path)
        return
    counter = RowCounter.remote()
    failed: list[BaseException] = []

    def write() -> None:
        try:
            judgments_dataset(scan, config, counter).write_parquet(path)
        except BaseException as e:  # raised again in the caller's thread
            failed.append(e)

    writer = threading.Thread(target=write, name="codefleet-analyze-write", daemon=True)
    bar = tqdm(total=scan.rows, unit="rows", desc="judging", file=progress_to, mininterval=0.5, dynamic_ncols=True)
    try:
        writer.start()
        while writer.is_alive():
            writer.join(timeout=0.5)
            bar.update(ray.get(counter.get.remote()) - bar.n)
    finally:
        bar.close()
        ray.kill(counter)
    if failed:
        raise failed[0]


def _analyze_scan(
    scan: StoreScan,
    store: str,
    root: str,
    out_dir: str,
    config: AnalyzeConfig,
    log: Callable[[str], None],
    problems: list[str],
    timings: dict[str, float],
    started: float,
    progress_to: TextIO | None,
) -> AnalysisResult:
    """analyze() from the scan on (holding OUT's lock): judgments, then aggregates, clusters, report, summary.
    Ray Data writes judgments.parquet/ by path in its workers: the entry is removed (a link unlinked, never
    followed) and made again as a directory through safe_files just before."""

    judgments_path = os.path.join(out_dir, "judgments.parquet")
    _fresh_dir(root, judgments_path)
    try:
        write_judgments(scan, config, judgments_path, progress_to)
    except Exception as e:  # a file whose footer reads but whose pages do not: find it, leave it out, go again
        broken = unreadable_bodies(scan)
        if not broken:
            raise
        for message in broken:
            log(f"codefleet analyze: {message}")
        problems += broken
        if not scan.rows:
            raise NoRollouts(f"no readable rollouts under {store}: every file with rows failed to read") from e
        _fresh_dir(root, judgments_path)
        write_judgments(scan, config, judgments_path, progress_to)
    timings["judge_s"] = time.perf_counter() - started
    judgments = ray.data.read_parquet(judgments_path, partitioning=None)
    summary, tables = summarise(judgments, config, rows=scan.rows)
    if config.judge.kind != "rules":
        summary["clusters"] = judge_clusters(
            judgments,
            ClusterBatch.configured(config.judge, config.judge.rubric()),
            config.clusters,
            ActorPoolStrategy(min_size=1, max_size=max(1, config.judge.actors)),
            config.judge.actor_num_cpus,
        )
    summary["store"] = store
    summary["files"] = {"read": len(scan.files), "skipped_or_upgraded": list(problems)}
    summary["overview"] = overview(summary)
    if summary["judge"]["errors"]:
        msg = (
            f"judge {config.judge.backend}: {summary['judge']['errors']} of {summary['rollouts']} rollouts "
            f"could not be judged (e.g. {summary['judge']['error_examples'][0]}); their rows have judge_error set "
            f"in {judgments_path}"
        )
        problems.append(msg)
        log(f"codefleet analyze: {msg}")
    timings["aggregate_s"] = time.perf_counter() - started - timings["judge_s"]
    if config.report:
        shown = {r["rollout_id"]: r for name in ("worst_failures", "suspicious_wins", "rollouts") for r in tables[name]}
        write_report(out_dir, summary, tables, fetch_details(scan, list(shown.values())), root)
        timings["report_s"] = time.perf_counter() - started - timings["judge_s"] - timings["aggregate_s"]
    timings["total_s"] = time.perf_counter() - started
    summary["timings_s"] = {k: round(v, 3) for k, v in timings.items()}
    write_summary(os.path.join(out_dir, "summary.json"), summary, root)
    return AnalysisResult(out_dir, summary, problems, timings)


def _fresh_dir(root: str, path: str) -> None:
    """An empty directory at `path` beneath `root`, whatever was there (a link is removed, never followed)."""
    safe_files.remove_beneath(root, path)
    safe_files.makedirs_beneath(root, path)


__all__ = [
    "AnalyzeConfig",
    "AnalysisResult",
    "NoRollouts",
    "analyze",
    "ensure_ray",
    "judgments_dataset",
    "ray_data_settings",
    "read_store",
]
