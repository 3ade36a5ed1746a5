"""`codefleet bench controller`: what asynchronous rollouts under a staleness bound buy over
synchronous RL, measured with the real `Controller` and real Ray actors.

Simulated work, real machinery. An attempt is a call to an async Ray actor method that sleeps a
lognormal duration (σ = 1.0, median `median_rollout_s`, capped at 20× the median) and returns
reward 0 or 1 at random; the trainer is a Ray actor whose `train` sleeps `trainer_step_s`. Durations
and rewards come from a seeded generator on the driver. Everything else — admission, the
completion handling of every attempt, the buffer, the trainer thread — is the production code.
Setup: 64 rollout slots, batches of 16 groups × 4 attempts, η ∈ {0, 1, 2, 4} one after another in
one Ray session (η = 0 is the synchronous baseline).

The trainer step is 30% of the expected synchronous step, fixed before anything runs. At η = 0 a
step runs its 64 attempts at once (64 slots), waits for the slowest, then trains, so its expected
length is S = E[max of 64 draws] + T. T = 0.3 · S gives T = (0.3 / 0.7) · E[max of 64 draws];
E[max] = ∫₀^cap (1 − F(x)^64) dx for the capped lognormal F is integrated numerically (≈ 11.0×
the median), so T ≈ 4.71× the median and S ≈ 15.7× the median. The η = 0 run's measured mean step
is reported next to it (`measured_sync_step_s`). Against the expected S the best possible speedup is
S / T = 1 / 0.3 ≈ 3.33: once the trainer never waits it is the bottleneck (64 slots can produce ~39
rollouts per median duration, the trainer consumes ~13.6). `speedup` divides by the measured η = 0
rate, whose step is longer than S by the per-step cost of launching 64 attempts and collecting them
(tens of ms on a loaded 2-core machine) and by sampling noise (the max of 64 draws varies a lot over
a few steps), so it can read above 3.33; `speedup_vs_expected_sync` divides by 64 / S instead.

Measured, per η (from the Controller's RunReport): `rollouts_per_s` = rollouts trained / seconds
from the start of run() to the end of its last step, pipeline fill included; `trainer_busy_fraction`
= seconds inside train() / seconds from the first batch to the end of the last step; version lag =
trainer step − the version an attempt started at. `speedup` is the best async rollouts/s over the
synchronous one. Shared-machine noise: the quick run has few steps, so the fill (one partial
synchronous step) weighs more and its speedup reads lower than the full run's.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import random
import time
from dataclasses import asdict, dataclass

import ray

from codefleet.bench.report import Log, report
from codefleet.fleet.controller import AttemptResult, Controller, ControllerConfig
from codefleet.fleet.ray_init import init_ray
from codefleet.fleet.staleness import Batch, Rollout, Ticket


@dataclass
class BenchConfig:
    median_rollout_s: float = 0.2  # ~200× Ray's ~1 ms per-call overhead
    sigma: float = 1.0
    cap_x_median: float = 20.0
    rollout_slots: int = 64
    batch_groups: int = 16
    group_size: int = 4
    trainer_fraction: float = 0.3  # trainer step / expected synchronous step
    etas: tuple[int, ...] = (0, 1, 2, 4)
    sync_steps: int = 12  # steps of the η = 0 run (each is alike)
    async_steps: int = 32  # steps of each η > 0 run (more, so the pipeline fill weighs little)
    rollout_actors: int = 2
    seed: int = 0
    quick: bool = False


QUICK = BenchConfig(median_rollout_s=0.03, sync_steps=4, async_steps=14, quick=True)


def expected_max_lognormal(n: int, sigma: float, cap: float, steps: int = 20_000) -> float:
    """E[max of n draws] of a lognormal with median 1 and shape `sigma`, capped at `cap`."""
    h = cap / steps
    total = 0.0
    for i in range(steps):
        x = (i + 0.5) * h
        cdf = 0.5 * (1 + math.erf(math.log(x) / (sigma * math.sqrt(2))))
        total += (1 - cdf**n) * h
    return total


@ray.remote(num_cpus=0)
class SimRolloutWorker:
    """Holds many attempts at once: each is a coroutine that sleeps."""

    async def attempt(
        self, rollout_id: str, group_id: int, version: int, duration_s: float, reward: float
    ) -> AttemptResult:
        await asyncio.sleep(duration_s)
        return AttemptResult(Rollout(rollout_id, group_id, version, reward))

    def ping(self) -> bool:
        return True


@ray.remote(num_cpus=0)
class SimTrainerWorker:
    def train(self, n_rollouts: int, step_s: float) -> dict[str, float]:
        time.sleep(step_s)
        return {"rollouts": float(n_rollouts)}


class SimRunner:
    """GroupRunner: attempts round-robin over the rollout actors, durations and rewards from a seeded rng."""

    def __init__(self, actors: list, cfg: BenchConfig, rng: random.Random):
        self.actors, self.cfg, self.rng = actors, cfg, rng
        self.next_actor = itertools.count()
        self.controller: Controller | None = None
        self.longest_s: dict[int, float] = {}  # version -> longest attempt drawn at it

    def draw_s(self) -> float:
        m = self.cfg.median_rollout_s
        return min(m * math.exp(self.rng.gauss(0.0, self.cfg.sigma)), self.cfg.cap_x_median * m)

    def start(self, ticket: Ticket, item: object, attempts: list[int]) -> list[ray.ObjectRef]:
        version = self.controller.version
        refs = []
        for a in attempts:
            actor = self.actors[next(self.next_actor) % len(self.actors)]
            duration_s = self.draw_s()
            self.longest_s[version] = max(self.longest_s.get(version, 0.0), duration_s)
            refs.append(
                actor.attempt.remote(
                    f"{ticket.group_id}/{a}", ticket.group_id, version, duration_s, float(self.rng.random() < 0.5)
                )
            )
        return refs


class SimTrainer:
    """TrainerClient: one blocking call to the trainer actor per step."""

    def __init__(self, actor, step_s: float):
        self.actor, self.step_s = actor, step_s

    def train(self, batch: Batch) -> dict[str, float]:
        return ray.get(self.actor.train.remote(len(batch.lags), self.step_s))


def _run_eta(eta: int, steps: int, cfg: BenchConfig, actors: list, trainer: SimTrainer) -> dict:
    runner = SimRunner(actors, cfg, random.Random(cfg.seed * 1000 + eta))
    config = ControllerConfig(
        eta=eta,
        rollout_slots=cfg.rollout_slots,
        batch_groups=cfg.batch_groups,
        group_size=cfg.group_size,
        rollout_timeout_s=60 * cfg.cap_x_median * cfg.median_rollout_s,
    )
    controller = Controller(config, runner, trainer, itertools.count())
    runner.controller = controller
    r = controller.run(steps)
    out = {
        "steps": r.steps,
        "wall_s": round(r.wall_s, 3),
        "mean_step_s": round(r.wall_s / max(r.steps, 1), 4),
        "rollouts_per_s": round(r.rollouts_per_s, 2),
        "trainer_busy_fraction": round(r.trainer_busy_fraction, 4),
        "version_lag_p50": r.version_lag_p50,
        "version_lag_p99": r.version_lag_p99,
        "version_lag_max": r.version_lag_max,
        "infra_failures": r.infra_failures,
    }
    if eta == 0:  # a synchronous step = its longest attempt + the trainer step + the loop's own overhead
        longest = [runner.longest_s[v] for v in range(steps)]
        out["mean_longest_attempt_s"] = round(sum(longest) / steps, 4)
        out["overhead_s_per_step"] = round(r.wall_s / steps - out["mean_longest_attempt_s"] - trainer.step_s, 4)
    return out


def run(cfg: BenchConfig, log: Log = print) -> dict:
    """Run every η in `cfg.etas` (0 first, as the baseline) and return the results as a JSON-able dict."""
    if 0 not in cfg.etas:
        raise ValueError(f"etas={cfg.etas} must include 0, the synchronous baseline")
    started_ray = init_ray(2)  # RAY_ADDRESS: that cluster (the actors need no CPUs); else a fresh local Ray
    n_draws = cfg.batch_groups * cfg.group_size
    e_max = expected_max_lognormal(n_draws, cfg.sigma, cfg.cap_x_median) * cfg.median_rollout_s
    trainer_step_s = cfg.trainer_fraction / (1 - cfg.trainer_fraction) * e_max
    actors = [SimRolloutWorker.remote() for _ in range(cfg.rollout_actors)]
    trainer_actor = SimTrainerWorker.remote()
    try:
        ray.get([a.ping.remote() for a in actors] + [trainer_actor.train.remote(0, 0.0)])
        trainer = SimTrainer(trainer_actor, trainer_step_s)
        per_eta = {}
        for eta in sorted(cfg.etas):
            steps = cfg.sync_steps if eta == 0 else cfg.async_steps
            log(f"eta={eta}: {steps} steps of {n_draws} rollouts ...")
            per_eta[str(eta)] = _run_eta(eta, steps, cfg, actors, trainer)
    finally:
        for a in [*actors, trainer_actor]:
            ray.kill(a)
        if started_ray:
            ray.shutdown()
    sync = per_eta["0"]["rollouts_per_s"]
    for row in per_eta.values():
        row["speedup"] = round(row["rollouts_per_s"] / sync, 3) if sync else 0.0
    async_rates = {k: v["rollouts_per_s"] for k, v in per_eta.items() if k != "0"}
    best = max(async_rates, key=async_rates.get) if async_rates else "0"
    speedup = per_eta[best]["speedup"]
    busy = per_eta[best]["trainer_busy_fraction"]
    out = {
        "quick": cfg.quick,
        "sync_rollouts_per_s": sync,
        "async_rollouts_per_s": async_rates,
        "speedup": speedup,
        "best_eta": int(best),
        "trainer_busy_fraction": busy,
        "version_lag_p99": per_eta[best]["version_lag_p99"],
        "target_met": speedup >= 3 and busy >= 0.9,
        "median_rollout_s": cfg.median_rollout_s,
        "trainer_step_s": round(trainer_step_s, 4),
        "expected_sync_step_s": round(e_max + trainer_step_s, 4),
        "measured_sync_step_s": per_eta["0"]["mean_step_s"],
        "sync_mean_longest_attempt_s": per_eta["0"]["mean_longest_attempt_s"],
        "sync_overhead_s_per_step": per_eta["0"]["overhead_s_per_step"],
        "ideal_speedup": round(1 / cfg.trainer_fraction, 3),
        # the best async rate over the rate of an ideal synchronous loop (expected step, no overhead):
        # free of the η = 0 run's sampling noise and of its per-step launch overhead
        "speedup_vs_expected_sync": round(async_rates.get(best, sync) * (e_max + trainer_step_s) / n_draws, 3),
        "steps": {k: v["steps"] for k, v in per_eta.items()},
        "per_eta": per_eta,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("quick", "etas")},
    }
    if not out["target_met"]:
        out["note"] = (
            f"target (speedup >= 3 with trainer busy >= 0.9) missed: best eta={best} gives "
            f"{speedup:.2f}x with the trainer busy {busy:.0%}"
        )
    return out


def table(r: dict) -> str:
    rows = [("eta", "rollouts/s", "speedup", "trainer busy", "lag p50", "lag p99", "steps")]
    for eta, row in r["per_eta"].items():
        rows.append(
            (
                eta,
                f"{row['rollouts_per_s']:.1f}",
                f"{row['speedup']:.2f}x",
                f"{row['trainer_busy_fraction']:.1%}",
                f"{row['version_lag_p50']:g}",
                f"{row['version_lag_p99']:g}",
                str(row["steps"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.append(
        f"trainer step {r['trainer_step_s']:.3f} s; synchronous step expected "
        f"{r['expected_sync_step_s']:.3f} s, measured {r['measured_sync_step_s']:.3f} s (longest attempts "
        f"{r['sync_mean_longest_attempt_s']:.3f} s, loop overhead "
        f"{r['sync_overhead_s_per_step'] * 1000:.0f} ms per step)"
    )
    lines.append(
        f"speedup vs the expected synchronous step {r['speedup_vs_expected_sync']:.2f}x; ideal "
        f"{r['ideal_speedup']:.2f}x; target >= 3x with the trainer busy >= 90%"
    )
    return "\n".join(lines)


def run_cli(quick: bool = False, as_json: bool = False) -> int:
    cfg = QUICK if quick else BenchConfig()
    return report(
        lambda log: run(cfg, log),
        lambda r: f"codefleet bench controller (median rollout {r['median_rollout_s']} s{', quick' if quick else ''})",
        table,
        as_json,
        note_key="note",
        name="controller",
    )
