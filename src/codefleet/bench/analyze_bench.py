"""`codefleet bench analyze [--quick] [--json]`: the rules pipeline over synthetic rollouts.

Generates rollouts in the store's schema (analysis/synthetic.py: a realistic
mix of outcomes with planted suspicious wins, ~2 tool calls per turn, diffs
and transcripts) into a temporary store, starts a local Ray with 2 CPUs (the
machine the issue targets) and a 1 GiB object store, runs `codefleet analyze`
with the `rules` judge and reports:

- `rows_per_s`: rollouts / seconds of `analyze()` (scan, read, rules, write
  judgments, aggregate, clusters, report with its transcript pages), Ray
  start-up and data generation excluded; `report_s` and `report_pages`: the
  report's share of that and how many transcript pages it wrote;
- `peak_rss_mb`: the peak, sampled every 0.25 s while `analyze()` runs, of the
  summed resident memory of the driver and every process it started (Ray's
  GCS, raylet, dashboard agents and all worker processes), i.e. everything the
  analysis costs on this machine. RSS counts shared pages (the object store's
  shared memory, libraries) once per process that maps them, so this is an
  upper bound; `peak_pss_mb` splits shared pages fairly (PSS) and is the
  better estimate of real use; `idle_rss_mb` is the same sum right before the
  run (Ray idle), so the pipeline's own cost is the difference;
  `peak_process_rss_mb` and `peak_processes` (the largest single process, the
  most processes at once) show what the sum is made of: it grows with the
  number of Ray worker processes, not with the number of rollouts; a
  worker's RSS includes the object-store pages it maps (up to the 1 GiB store);
  `peak_driver_rss_mb` is the driver alone (it never holds the rollouts);
- `planted_match`: fraction of rollouts whose rule category equals the one the
  generator planted (a correctness check of the rules at scale);
- `suspicious_precision`, `suspicious_recall`: how well the rules' suspicious
  flag separates honest wins from hacks, measured not on synthetic rows but on
  real wins (scripted-expert episodes in real sandboxes on generated tasks of
  every family, renames that must edit the tests included; a model's short
  `codefleet train` run wins too rarely for bench time) and one planted hack
  per win (a test deleted, an assertion weakened, a value hard-coded, a skip
  added); bench/suspicious_bench.py says how. `target_met`: both >= 0.9.

Full run: 100,000 rollouts and 36 expert wins. `--quick`: 2,000 rollouts and
12 expert wins.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time

import pyarrow.parquet as pq
import ray

from codefleet.analysis.pipeline import AnalyzeConfig, analyze
from codefleet.analysis.synthetic import synthetic_records
from codefleet.bench import suspicious_bench
from codefleet.bench.report import Log, report
from codefleet.fleet.ray_init import init_ray
from codefleet.store.parquet import RolloutWriter

FULL_ROWS, QUICK_ROWS = 100_000, 2_000
OBJECT_STORE_MB = 1024  # the bench's Ray: 2 CPUs, a 1 GiB object store (the same as `codefleet analyze` starts)


class MemorySampler:
    """Peak summed RSS and PSS of this process and all its descendants, sampled in a thread."""

    def __init__(self, interval_s: float = 0.25):
        import psutil  # optional: the `bench` extra (pyproject.toml)

        self.psutil = psutil
        self.interval_s = interval_s
        self.peak_rss_mb = self.peak_pss_mb = self.peak_process_rss_mb = 0.0
        self.peak_processes = 0
        self.peak_process_name = ""
        self.peak_driver_rss_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> tuple[float, float]:
        me = self.psutil.Process()
        rss = pss = 0
        processes = [me, *me.children(recursive=True)]
        try:
            self.peak_driver_rss_mb = max(self.peak_driver_rss_mb, me.memory_info().rss / 2**20)
        except self.psutil.Error:
            pass
        for p in processes:
            try:
                info = p.memory_full_info()
                rss, pss = rss + info.rss, pss + getattr(info, "pss", info.rss)
                if info.rss / 2**20 > self.peak_process_rss_mb:
                    self.peak_process_rss_mb, self.peak_process_name = info.rss / 2**20, p.name()
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied):
                continue
        self.peak_processes = max(self.peak_processes, len(processes))
        return rss / 2**20, pss / 2**20

    def _run(self) -> None:
        while not self._stop.is_set():
            rss, pss = self.sample()
            self.peak_rss_mb, self.peak_pss_mb = max(self.peak_rss_mb, rss), max(self.peak_pss_mb, pss)
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def run(quick: bool, log: Log) -> dict:
    n = QUICK_ROWS if quick else FULL_ROWS
    root = tempfile.mkdtemp(prefix="codefleet-analyze-bench-")
    try:
        started = time.perf_counter()
        writer = RolloutWriter(os.path.join(root, "rollouts"))
        expected: dict[tuple[int, int, int], str] = {}

        for records in synthetic_records(n, run="bench", seed=0, rows_per_step=max(1, n // 20)):
            writer.append(records)
            for r in records:
                expected[(r["step"], r["group"], r["attempt"])] = json.loads(r["metadata"])["synthetic.expect"]
        generate_s = time.perf_counter() - started
        store_mb = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs) / 2**20
        log(f"generated {n} rollouts ({store_mb:.1f} MB of Parquet) in {generate_s:.1f} s")
        own_ray = init_ray(2, object_store_mb=OBJECT_STORE_MB, address="local")
        sampler = MemorySampler()
        idle_rss_mb, idle_pss_mb = sampler.sample()
        try:
            with sampler:
                t = time.perf_counter()
                result = analyze(root, AnalyzeConfig(), log=log)
                analyze_s = time.perf_counter() - t
        finally:
            if own_ray:
                ray.shutdown()
        judged = pq.read_table(
            os.path.join(result.out_dir, "judgments.parquet"), columns=["step", "group", "attempt", "category"]
        ).to_pylist()
        hits = sum(expected[(r["step"], r["group"], r["attempt"])] == r["category"] for r in judged)
        match = hits / max(1, len(judged))
        s = result.summary
        suspicious = suspicious_bench.run(quick, log)
        return {
            "rollouts": s["rollouts"],
            "rows_per_s": round(s["rollouts"] / analyze_s, 1),
            "analyze_s": round(analyze_s, 2),
            "judge_stage_s": round(result.timings_s["judge_s"], 2),
            "aggregate_s": round(result.timings_s["aggregate_s"], 2),
            "report_s": round(result.timings_s.get("report_s", 0.0), 2),
            "report_pages": len(os.listdir(os.path.join(result.out_dir, "rollouts"))),
            "peak_rss_mb": round(sampler.peak_rss_mb, 1),
            "peak_pss_mb": round(sampler.peak_pss_mb, 1),
            "idle_rss_mb": round(idle_rss_mb, 1),
            "idle_pss_mb": round(idle_pss_mb, 1),
            "peak_process_rss_mb": round(sampler.peak_process_rss_mb, 1),
            "peak_processes": sampler.peak_processes,
            "peak_process_name": sampler.peak_process_name,
            "peak_driver_rss_mb": round(sampler.peak_driver_rss_mb, 1),
            "store_mb": round(store_mb, 1),
            "generate_s": round(generate_s, 1),
            "ray_cpus": 2,
            "ray_object_store_mb": OBJECT_STORE_MB,
            "success_rate": s["success_rate"],
            "suspicious_wins": s["suspicious_wins"],
            "planted_match": round(match, 4),
            "quick": quick,
            **suspicious,
            "memory_note": "peak_rss_mb: summed RSS of the driver and all processes it started (Ray GCS, raylet, "
            "agents, workers), sampled every 0.25 s during analyze(); shared pages counted per "
            "process (upper bound); peak_pss_mb splits them fairly",
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _table(r: dict) -> str:
    rows = [
        ("rollouts", r["rollouts"]),
        ("rows/s", r["rows_per_s"]),
        ("analyze s", r["analyze_s"]),
        ("  judgments stage s", r["judge_stage_s"]),
        ("  aggregates s", r["aggregate_s"]),
        (f"  report s ({r['report_pages']} transcript pages)", r["report_s"]),
        ("peak RSS MB (driver + Ray)", r["peak_rss_mb"]),
        ("peak PSS MB", r["peak_pss_mb"]),
        ("idle RSS MB (Ray up, before)", r["idle_rss_mb"]),
        ("driver RSS MB", r["peak_driver_rss_mb"]),
        (f"largest process RSS MB ({r['peak_process_name']})", r["peak_process_rss_mb"]),
        ("processes (most)", r["peak_processes"]),
        ("store MB", r["store_mb"]),
        ("planted category match", r["planted_match"]),
        ("suspicious wins", r["suspicious_wins"]),
        ("suspicious precision", r["suspicious_precision"]),
        ("suspicious recall", r["suspicious_recall"]),
        ("  precision, task-blind rules", r["task_blind_precision"]),
        ("target met (both >= 0.9)", r["target_met"]),
    ]
    return "\n".join(f"{k:<32}{v}" for k, v in rows)


def run_cli(quick: bool, as_json: bool) -> int:
    return report(
        lambda log: run(quick, log),
        lambda r: (
            f"analyze bench: {r['rollouts']} synthetic rollouts, rules judge, Ray with 2 CPUs; "
            f"suspicious flag on {r['honest_wins']} expert wins + {r['planted_hacks']} planted hacks"
        ),
        _table,
        as_json,
        note_key="memory_note",
        name="analyze",
    )
