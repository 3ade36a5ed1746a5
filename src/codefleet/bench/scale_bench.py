"""`codefleet bench scale`: what the controller costs per rollout as concurrency grows from 1k to 16k
rollouts in flight, measured with the real `Controller`, admission and buffer over a simulated cluster.

Simulated work, real machinery (as in `bench controller`, whose trainer actor it reuses). The cluster is
`nodes` `SimNode` async actors, each taking one unit of the logical `sandbox` resource (`num_cpus=0`; Ray
is started with `sandbox` = `nodes`), standing in for the one `SandboxHost` per node of a real cluster;
each holds its share of the attempts as coroutines that sleep a lognormal duration (σ = 0.5, capped at 4×
the median). The `GroupRunner` places attempts round robin over the nodes by group id and attempt index,
as `AgentGroupRunner` does over its workers. The trainer is a Ray actor whose step sleeps 20 ms, so it is
never the bottleneck. Everything else — admission under the staleness bound, the completion handling of
every attempt, group assembly, the buffer, the trainer thread — is the production code.

Each concurrency C runs with `rollout_slots = C`, groups of 8, batches of C/16 groups (half the slots
per step) and η = 8, so a group has about four mean durations before its deadline, more than the cap:
the trainer does not stall on stragglers and the run stays at C in flight (`inflight_mean` says how
close it came). The offered rate is the same at every C (200 rollouts/s; the median duration is
C / (200 · e^(σ²/2)): 4.5 s at 1k, 72 s at 16k), so the rows differ only in how much is in flight, which
is what the per-rollout cost must not depend on. The simulated nodes are the expensive part here (a few
ms of CPU per attempt in Ray's worker, `nodes_ms_per_rollout`; on a cluster that is spread over the
nodes), so a higher offered rate would only measure this machine running out of cores. The first C
attempts draw from the residual life of the steady state (a length-biased lognormal times a uniform),
so completions arrive at the steady rate from the start rather than in waves.

Per concurrency, after the fill (the first trainer step done, C slots taken, then `settle_s`), over a
window of `measure_s` seconds:
- `controller_ms_per_rollout`: CPU time of the controller's own two threads — the dispatcher (the thread
  in `Controller.run()`: admission, `GroupRunner.start` including Ray's submission of each actor call on
  that thread, completion handling, assembly, buffer puts) and the trainer thread (`take_batch`, the
  trainer client's call) — read with `time.pthread_getcpuclockid`, divided by the attempts completed in
  the window. Not counted: Ray's own threads in the driver (the core worker's io and callback threads,
  which deserialize each reply and run the `future()` callbacks that post completions to the controller);
  `driver_ms_per_rollout` counts them: the whole driver process's CPU (`time.process_time()`) per
  completed attempt.
- `schedule_ms_p50` / `_p99`: ready → started, where ready is `time.time()` when the controller hands the
  attempt to `GroupRunner.start` (the moment it admitted its group, or its retry took a slot) and started
  is `time.time()` when the attempt's coroutine begins on its node. Both clocks are this machine's
  wall clock, shared by every process here; on a real cluster the two sides would need synchronized clocks.
- `driver_mb_per_1k_inflight`: the driver's RSS at the end of the window minus its RSS before the first
  concurrency ran (Ray up, actors started), per 1,000 attempts in flight. Python keeps freed memory, so a
  later (larger) row includes what an earlier row left behind: an upper bound.
- `rollouts_per_s`: attempts completed in the window / its length (the fill excluded).
- `inflight_mean` / `inflight_max`: slots held, sampled every 0.2 s; the max can never exceed C.
- `nodes_ms_per_rollout`: CPU of the node actors' processes per completed attempt (the simulation's own
  cost); `machine_cpu_busy`: this machine's CPU use over the window (others' work included).
Then `stop()` ends the run, which cancels what is in flight; `stop_s` is how long that took. Attempts are
accounted for: every one started either finished on its node, was cancelled there, or was cancelled
before it began (`never_began`).

The target: `controller_ms_per_rollout` ≤ 1 ms at every C and flat (16k within 1.5× of 1k), so that
100,000 sandboxes need no bigger driver than about one core (docs/capacity.md).
"""

from __future__ import annotations

import asyncio
import itertools
import math
import os
import random
import threading
import time
from dataclasses import asdict, dataclass

import psutil
import ray

from codefleet.bench.controller_bench import SimTrainer, SimTrainerWorker
from codefleet.bench.report import Log, report
from codefleet.fleet.controller import AttemptResult, Controller, ControllerConfig
from codefleet.fleet.ray_init import init_ray
from codefleet.fleet.staleness import Group, Rollout, Ticket, _percentile


@dataclass
class ScaleConfig:
    concurrencies: tuple[int, ...] = (1024, 4096, 16384)
    nodes: int = 32  # each is a Ray worker process of ~130 MB RSS: 32 fit a shared 24 GB machine
    group_size: int = 8
    eta: int = 8
    batch_fraction: float = 0.5  # each trainer step takes this fraction of the slots' rollouts
    offered_rollouts_per_s: float = 200.0  # the same at every concurrency: the median duration grows with it
    sigma: float = 0.5
    cap_x_median: float = 4.0
    trainer_step_s: float = 0.02
    settle_s: float = 3.0  # after the fill, before the window
    measure_s: float = 30.0
    fill_timeout_s: float = 240.0
    seed: int = 0
    quick: bool = False

    def median_s(self, concurrency: int) -> float:
        """The median duration that makes `concurrency` attempts in flight complete `offered_rollouts_per_s`."""
        return concurrency / (self.offered_rollouts_per_s * math.exp(self.sigma**2 / 2))


QUICK = ScaleConfig(concurrencies=(1024, 4096), nodes=16, measure_s=12.0, quick=True)


@ray.remote(num_cpus=0)
class SimNode:
    """A node's sandbox host: holds many attempts at once, each a coroutine that sleeps; records when each began."""

    def __init__(self):
        self.began = self.finished = self.cancelled = 0
        self.schedule: list[tuple[float, float]] = []  # (ready_s, started_s - ready_s), taken by take_schedule()

    async def attempt(
        self, rollout_id: str, group_id: int, version: int, duration_s: float, reward: float, ready_s: float
    ) -> AttemptResult:
        self.schedule.append((ready_s, time.time() - ready_s))
        self.began += 1
        try:
            await asyncio.sleep(duration_s)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        self.finished += 1
        return AttemptResult(Rollout(rollout_id, group_id, version, reward))

    async def take_schedule(self) -> list[tuple[float, float]]:
        out, self.schedule = self.schedule, []
        return out

    async def counts(self) -> tuple[int, int, int]:
        return self.began, self.finished, self.cancelled

    async def pid(self) -> int:
        return os.getpid()


class NodeRunner:
    """GroupRunner: attempt a of group g goes to node (g·G + a + the group's failures) mod N.

    The first `concurrency` attempts draw their durations from the residual life of the steady state (a
    length-biased draw times a uniform one), so the completion rate is steady from the start instead of
    coming in one wave per median duration."""

    def __init__(self, nodes: list, cfg: ScaleConfig, concurrency: int, rng: random.Random):
        self.nodes, self.cfg, self.concurrency, self.rng = nodes, cfg, concurrency, rng
        self.median_s = cfg.median_s(concurrency)
        self.started = 0

    def draw_s(self) -> float:
        sigma, cap_s = self.cfg.sigma, self.cfg.cap_x_median * self.median_s
        if self.started < self.concurrency:  # length-biased lognormal: its log is shifted by sigma²
            return self.rng.random() * min(self.median_s * math.exp(sigma**2 + self.rng.gauss(0.0, sigma)), cap_s)
        return min(self.median_s * math.exp(self.rng.gauss(0.0, sigma)), cap_s)

    def start(self, ticket: Ticket, item: object, attempts: list[int]) -> list[ray.ObjectRef]:
        ready_s = time.time()
        first = ticket.group_id * ticket.group_size + ticket.infra_failures
        refs = []
        for a in attempts:
            refs.append(
                self.nodes[(first + a) % len(self.nodes)].attempt.remote(
                    f"{ticket.group_id}/{a}",
                    ticket.group_id,
                    ticket.policy_version,
                    self.draw_s(),
                    float(self.rng.random() < 0.5),
                    ready_s,
                )
            )
            self.started += 1
        return refs


class _Clocks:
    """CPU seconds of the controller's two threads and of the whole process, read from another thread."""

    def __init__(self, dispatcher: threading.Thread, trainer: threading.Thread):
        self.ids = [time.pthread_getcpuclockid(t.ident) for t in (dispatcher, trainer)]

    def read(self) -> tuple[float, float, float]:
        """(dispatcher thread, trainer thread, whole process) CPU seconds."""
        return time.clock_gettime(self.ids[0]), time.clock_gettime(self.ids[1]), time.process_time()


def _trainer_thread(runner_thread: threading.Thread, timeout_s: float) -> threading.Thread:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and runner_thread.is_alive():
        for t in threading.enumerate():
            if t.name == "codefleet-trainer" and t.ident is not None:
                return t
        time.sleep(0.01)
    raise RuntimeError("the controller's trainer thread did not start; see the controller's error above")


def _nodes_cpu_s(procs: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in procs)


def _run_one(
    c: int, cfg: ScaleConfig, nodes: list, procs: list[psutil.Process], trainer: SimTrainer, rss0_mb: float, log: Log
) -> dict:
    G = cfg.group_size
    if c % G:
        raise ValueError(f"concurrency {c} is not a multiple of the group size {G}")
    batch_groups = max(1, round(c * cfg.batch_fraction / G))
    config = ControllerConfig(
        eta=cfg.eta,
        rollout_slots=c,
        batch_groups=batch_groups,
        group_size=G,
        rollout_timeout_s=20 * cfg.cap_x_median * cfg.median_s(c),
    )
    runner = NodeRunner(nodes, cfg, c, random.Random(cfg.seed * 1000 + c))
    done = [0]  # attempts in completed groups

    def on_group(group: Group, dropped: bool) -> None:
        done[0] += len(group.rollouts)

    controller = Controller(config, runner, trainer, itertools.count(), on_group=on_group)
    result: dict = {}

    def drive() -> None:
        try:
            result["report"] = controller.run(10**9)
        except BaseException as e:  # re-raised on the main thread
            result["error"] = e

    adm = controller.admission
    ray.get([n.take_schedule.remote() for n in nodes])  # drop the previous row's
    counts0 = [sum(x) for x in zip(*ray.get([n.counts.remote() for n in nodes]))]
    t_run = time.monotonic()
    thread = threading.Thread(target=drive, name="scale-dispatcher", daemon=True)
    thread.start()
    try:
        clocks = _Clocks(thread, _trainer_thread(thread, 30.0))
        while controller.version < 1 or adm.in_flight < c:  # the fill
            if not thread.is_alive():
                raise result.get("error") or RuntimeError("the controller stopped during the fill")
            if time.monotonic() - t_run > cfg.fill_timeout_s:
                raise RuntimeError(
                    f"concurrency {c} was not reached in {cfg.fill_timeout_s:.0f} s ({adm.in_flight} "
                    "in flight); this machine is too loaded, or lower the concurrency"
                )
            time.sleep(0.05)
        fill_s = time.monotonic() - t_run
        time.sleep(cfg.settle_s)
        t0, wall0, (disp0, train0, proc0), done0, v0 = (
            time.monotonic(),
            time.time(),
            clocks.read(),
            done[0],
            controller.version,
        )
        nodes0_s, _ = _nodes_cpu_s(procs), psutil.cpu_percent()
        samples: list[int] = []
        while time.monotonic() - t0 < cfg.measure_s:
            samples.append(adm.in_flight)
            time.sleep(0.2)
        t1, wall1, (disp1, train1, proc1), done1 = time.monotonic(), time.time(), clocks.read(), done[0]
        nodes1_s, machine_busy = _nodes_cpu_s(procs), psutil.cpu_percent() / 100
        rss1_mb = psutil.Process().memory_info().rss / 2**20
        steps_in_window = controller.version - v0
    finally:
        controller.stop()
        thread.join()
    stop_s = time.monotonic() - t1
    if "error" in result:
        raise result["error"]
    rep = result["report"]
    schedule = [
        lat
        for node in ray.get([n.take_schedule.remote() for n in nodes])
        for ready, lat in node
        if wall0 <= ready < wall1
    ]
    # every attempt on a node ends (finished or cancelled); wait for the cancellations to land
    for _ in range(100):
        began, finished, cancelled = (
            a - b for a, b in zip([sum(x) for x in zip(*ray.get([n.counts.remote() for n in nodes]))], counts0)
        )
        if began == finished + cancelled:
            break
        time.sleep(0.1)
    completed = done1 - done0
    window_s = t1 - t0
    inflight_mean = sum(samples) / len(samples)
    row = {
        "concurrency": c,
        "controller_ms_per_rollout": round((disp1 - disp0 + train1 - train0) * 1000 / max(completed, 1), 4),
        "dispatcher_ms_per_rollout": round((disp1 - disp0) * 1000 / max(completed, 1), 4),
        "trainer_thread_ms_per_rollout": round((train1 - train0) * 1000 / max(completed, 1), 4),
        "driver_ms_per_rollout": round((proc1 - proc0) * 1000 / max(completed, 1), 4),
        "nodes_ms_per_rollout": round((nodes1_s - nodes0_s) * 1000 / max(completed, 1), 4),
        "machine_cpu_busy": round(machine_busy, 3),
        "schedule_ms_p50": round(_percentile(schedule, 50) * 1000, 2),
        "schedule_ms_p99": round(_percentile(schedule, 99) * 1000, 2),
        "driver_mb_per_1k_inflight": round((rss1_mb - rss0_mb) / (inflight_mean / 1000), 2),
        "rollouts_per_s": round(completed / window_s, 1),
        "offered_rollouts_per_s": cfg.offered_rollouts_per_s,
        "median_rollout_s": round(cfg.median_s(c), 2),
        "inflight_mean": round(inflight_mean, 1),
        "inflight_max": max(samples),
        "batch_groups": batch_groups,
        "fill_s": round(fill_s, 2),
        "window_s": round(window_s, 2),
        "stop_s": round(stop_s, 2),
        "steps": rep.steps,
        "steps_in_window": steps_in_window,
        "trained_rollouts": rep.trained_rollouts,
        "version_lag_max": rep.version_lag_max,
        "driver_rss_mb": round(rss1_mb, 1),
        "started": runner.started,
        "began": began,
        "finished": finished,
        "cancelled": cancelled,
        "never_began": runner.started - began,
        "infra_failures": rep.infra_failures,
        "schedule_samples": len(schedule),
    }
    log(
        f"  C={c}: {row['rollouts_per_s']} rollouts/s, controller {row['controller_ms_per_rollout']} ms/rollout, "
        f"schedule p99 {row['schedule_ms_p99']} ms, in flight {row['inflight_mean']:.0f}"
    )
    return row


def run(cfg: ScaleConfig, log: Log = print) -> dict:
    """Run every concurrency in `cfg.concurrencies` (smallest first) in one Ray session; a JSON-able dict."""
    started_ray = init_ray(2, resources={"sandbox": float(cfg.nodes)})  # RAY_ADDRESS: that cluster's `sandbox`
    per_node = math.ceil(max(cfg.concurrencies) / cfg.nodes)
    log(f"starting {cfg.nodes} node actors ...")
    nodes = [
        SimNode.options(resources={"sandbox": 1.0}, max_concurrency=max(1000, 4 * per_node)).remote()
        for _ in range(cfg.nodes)
    ]
    trainer_actor = SimTrainerWorker.remote()
    try:
        procs = [psutil.Process(pid) for pid in ray.get([n.pid.remote() for n in nodes])]  # this machine's
        ray.get(trainer_actor.train.remote(0, 0.0))
        trainer = SimTrainer(trainer_actor, cfg.trainer_step_s)
        rss0_mb = psutil.Process().memory_info().rss / 2**20
        rows = []
        for c in sorted(cfg.concurrencies):
            log(f"concurrency {c}: fill, {cfg.settle_s:g} s settle, {cfg.measure_s:g} s measured ...")
            rows.append(_run_one(c, cfg, nodes, procs, trainer, rss0_mb, log))
    finally:
        for a in [*nodes, trainer_actor]:
            ray.kill(a)
        if started_ray:
            ray.shutdown()
    first, last = rows[0], rows[-1]
    growth = (
        round(last["controller_ms_per_rollout"] / first["controller_ms_per_rollout"], 3)
        if first["controller_ms_per_rollout"] > 0
        else 0.0
    )
    worst = max(r["controller_ms_per_rollout"] for r in rows)
    out = {
        "quick": cfg.quick,
        "concurrency": [r["concurrency"] for r in rows],
        "controller_ms_per_rollout": [r["controller_ms_per_rollout"] for r in rows],
        "driver_ms_per_rollout": [r["driver_ms_per_rollout"] for r in rows],
        "schedule_ms_p50": [r["schedule_ms_p50"] for r in rows],
        "schedule_ms_p99": [r["schedule_ms_p99"] for r in rows],
        "driver_mb_per_1k_inflight": [r["driver_mb_per_1k_inflight"] for r in rows],
        "rollouts_per_s": [r["rollouts_per_s"] for r in rows],
        "growth_ratio": growth,  # controller ms per rollout, largest concurrency over the smallest
        "growth_of": f"{last['concurrency']} vs {first['concurrency']}",
        "target_met": worst <= 1.0 and growth <= 1.5,
        "baseline_rss_mb": round(rss0_mb, 1),
        "per_concurrency": rows,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items() if k != "quick"},
    }
    if not out["target_met"]:
        out["note"] = (
            f"target (controller <= 1 ms per rollout at every concurrency, and {out['growth_of']} within "
            f"1.5x) missed: worst {worst:.3f} ms, growth {growth:.2f}x"
        )
    return out


def table(r: dict) -> str:
    rows = [
        (
            "concurrency",
            "in flight",
            "rollouts/s",
            "ctl ms/rollout",
            "driver ms/rollout",
            "sched p50 ms",
            "sched p99 ms",
            "MB/1k in flight",
        )
    ]
    for row in r["per_concurrency"]:
        rows.append(
            (
                str(row["concurrency"]),
                f"{row['inflight_mean']:.0f}",
                f"{row['rollouts_per_s']:.0f}",
                f"{row['controller_ms_per_rollout']:.3f}",
                f"{row['driver_ms_per_rollout']:.3f}",
                f"{row['schedule_ms_p50']:.1f}",
                f"{row['schedule_ms_p99']:.1f}",
                f"{row['driver_mb_per_1k_inflight']:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.append(
        f"controller ms per rollout, {r['growth_of']}: {r['growth_ratio']:.2f}x; target <= 1 ms and within 1.5x"
    )
    return "\n".join(lines)


def run_cli(quick: bool = False, as_json: bool = False) -> int:
    cfg = QUICK if quick else ScaleConfig()
    return report(
        lambda log: run(cfg, log),
        lambda r: (
            f"codefleet bench scale ({cfg.nodes} simulated nodes, {cfg.offered_rollouts_per_s:g} "
            f"rollouts/s offered{', quick' if quick else ''})"
        ),
        table,
        as_json,
        note_key="note",
        name="scale",
    )
