"""Evaluation of a checkpoint on a task set: success, turns, tool calls, wall clock.

    report = evaluate("runs/demo/checkpoints/rl", tasks, attempts=1)
    print(report.table())

The checkpoint is served by an in-process engine (continuous batching);
`jobs` tasks run at once, each with `attempts` attempts forked from one
prepared sandbox (`agent.attempts.run_task_attempts`), so their turns share
decode steps. Decoding is greedy by default, so an evaluation is repeatable.
Every attempt is a scored trajectory; the figures are:

- `success_rate`: solved attempts / attempts (all hidden checks pass);
- `pass_at_n`: tasks with at least one solved attempt / tasks;
- `turns`, `tool_calls`, `tool_calls_per_turn`, `tool_errors`, `wall_s`: means over attempts;
- `turns_per_solved`, `wall_s_per_solved`: means over solved attempts (None when none solved).
- `broken`: tasks whose set-up fails (task id -> why): left out of every figure above, and named.
- `wall_clock_stops`: the share of attempts their wall-clock budget cut off. `jobs` x `attempts`
  episodes share one engine and the machine's cores; too many at once and the clock, not the policy,
  ends them (32 attempts x 10 jobs on 2 cores: 72% of them), which the table then says.

`codefleet eval --checkpoint DIR --tasks DIR [--attempts N]` prints the table
and the JSON (and writes the trajectories to a rollout store with `--out`). The
checkpoint, the task directory and `--out` may be fsspec URLs (`s3://...`,
codefleet.store.storage): the checkpoint and the tasks are read from this
node's download cache, the rollouts are written to the URL.
`codefleet eval --model URL` (`evaluate_endpoint`) evaluates any model behind an
OpenAI-compatible endpoint on the same tasks, the same way, for a baseline to
hold a trained policy against.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import torch

from codefleet.agent.attempts import run_task_attempts
from codefleet.agent.clients import OpenAIConfig, OpenAIPolicy
from codefleet.agent.clients.local_engine import LocalEnginePolicy, grammar_options
from codefleet.agent.reward import tool_errors
from codefleet.inference.engine import Engine
from codefleet.recipe.eval_config import EvalConfig
from codefleet.store import storage
from codefleet.tasks.checks import TaskSetupError
from codefleet.types import Task, Trajectory

CLOCK_WARNING = 0.1  # EvalReport.clock_warning above this share of attempts stopped by the wall clock


@dataclass
class EvalReport:
    checkpoint: str
    tasks: int
    attempts: int
    success_rate: float
    pass_at_n: float
    turns: float
    tool_calls: float
    tool_calls_per_turn: float
    tool_errors: float
    wall_s: float
    turns_per_solved: float | None
    wall_s_per_solved: float | None
    eval_s: float
    wall_clock_stops: float = 0.0  # attempts cut off by the episode's wall-clock budget / attempts
    per_task: dict[str, list[dict]] = field(default_factory=dict)
    broken: dict[str, str] = field(default_factory=dict)  # task id -> why its set-up fails (not in the figures)
    # success per value of a task's metadata (`breakdown`): {"library": {"six": {"tasks": 2, "success_rate": 0.5}}}
    groups: dict[str, dict[str, dict]] = field(default_factory=dict)

    def summary(self) -> dict:
        out = asdict(self)
        out.pop("per_task")
        return out

    def table(self, label: str = "") -> str:
        n = self.tasks * self.attempts
        lo, hi = wilson_interval(round(self.success_rate * n), n)
        rows = [
            ("success rate", f"{self.success_rate:.1%} (95% interval {lo:.1%} to {hi:.1%}, {n} attempts)"),
            (f"pass@{self.attempts}", f"{self.pass_at_n:.1%}"),
            ("turns / attempt", f"{self.turns:.2f}"),
            ("tool calls / turn", f"{self.tool_calls_per_turn:.2f}"),
            ("tool errors", f"{self.tool_errors:.2f}"),
            ("wall s / attempt", f"{self.wall_s:.2f}"),
            ("turns / solved", "-" if self.turns_per_solved is None else f"{self.turns_per_solved:.2f}"),
            ("wall s / solved", "-" if self.wall_s_per_solved is None else f"{self.wall_s_per_solved:.2f}"),
        ]
        head = f"{label or self.checkpoint}: {self.tasks} tasks x {self.attempts} attempts"
        warning = self.clock_warning()
        broken = (
            [f"{len(self.broken)} task(s) left out, their set-up fails: {', '.join(sorted(self.broken))}"]
            if self.broken
            else []
        )
        by = [
            f"  by {key:<15} "
            + ", ".join(f"{value} {g['success_rate']:.0%} ({g['tasks']})" for value, g in sorted(values.items()))
            for key, values in self.groups.items()
        ]
        return "\n".join([head] + [f"  {k:<18} {v}" for k, v in rows] + by + ([warning] if warning else []) + broken)

    def clock_warning(self) -> str:
        """A sentence when so many attempts ran out of wall clock that the figures measure the machine."""
        if self.wall_clock_stops <= CLOCK_WARNING:
            return ""
        return (
            f"warning: {self.wall_clock_stops:.0%} of the attempts ran out of their wall-clock budget, so turns "
            f"and success are cut short by the machine, not the policy; run fewer at once (--jobs x --attempts "
            f"episodes share the engine and the cores) or give each more (--wall-clock)"
        )


def _solved(t: Trajectory) -> bool:
    return bool(t.checks and t.checks.all_passed)


def _mean(xs: list[float]) -> float | None:
    return round(statistics.fmean(xs), 4) if xs else None


BREAKDOWN_KEYS = ("family", "library", "mutation")  # task metadata the report breaks success down by


def breakdown(tasks: list[Task], results: dict[str, list[Trajectory]]) -> dict[str, dict[str, dict]]:
    """Success per value of each of BREAKDOWN_KEYS that tells the evaluated tasks apart (mined tasks: per library
    and per mutation kind); a key every task shares one value of is left out."""
    out: dict[str, dict[str, dict]] = {}
    for key in BREAKDOWN_KEYS:
        values = {str(t.metadata[key]) for t in tasks if t.id in results and key in t.metadata}
        if len(values) < 2 and key == "family":
            continue
        groups: dict[str, list[Trajectory]] = {}
        for t in tasks:
            if t.id in results and key in t.metadata:
                groups.setdefault(str(t.metadata[key]), []).extend(results[t.id])
        if groups:
            out[key] = {
                value: {
                    "tasks": sum(1 for t in tasks if t.id in results and str(t.metadata.get(key)) == value),
                    "success_rate": round(sum(map(_solved, ts)) / len(ts), 4) if ts else 0.0,
                }
                for value, ts in groups.items()
            }
    return out


def summarize(
    checkpoint: str,
    results: dict[str, list[Trajectory]],
    attempts: int,
    eval_s: float,
    broken: dict[str, str] | None = None,
) -> EvalReport:
    flat = [t for ts in results.values() for t in ts]
    solved = [t for t in flat if _solved(t)]
    return EvalReport(
        checkpoint=checkpoint,
        tasks=len(results),
        attempts=attempts,
        success_rate=round(len(solved) / len(flat), 4) if flat else 0.0,
        pass_at_n=round(sum(any(map(_solved, ts)) for ts in results.values()) / max(len(results), 1), 4),
        turns=_mean([t.n_turns for t in flat]) or 0.0,
        tool_calls=_mean([t.n_tool_calls for t in flat]) or 0.0,
        tool_calls_per_turn=_mean([t.tool_calls_per_turn for t in flat]) or 0.0,
        tool_errors=_mean([tool_errors(t) for t in flat]) or 0.0,
        wall_s=_mean([t.wall_s for t in flat]) or 0.0,
        turns_per_solved=_mean([t.n_turns for t in solved]),
        wall_s_per_solved=_mean([t.wall_s for t in solved]),
        eval_s=round(eval_s, 2),
        wall_clock_stops=round(sum(t.stop_reason == "wall_clock" for t in flat) / len(flat), 4) if flat else 0.0,
        per_task={
            tid: [
                {
                    "solved": _solved(t),
                    "reward": t.reward,
                    "turns": t.n_turns,
                    "tool_calls": t.n_tool_calls,
                    "wall_s": round(t.wall_s, 3),
                    "stop_reason": t.stop_reason,
                }
                for t in ts
            ]
            for tid, ts in results.items()
        },
        broken=dict(broken or {}),
    )


def evaluate(
    checkpoint: str,
    tasks: list[Task],
    config: EvalConfig | None = None,
    sandbox_config=None,
    episode_config=None,
    on_task=None,
    tool_grammar: str = "off",
) -> tuple[EvalReport, dict[str, list[Trajectory]]]:
    """Run every task `attempts` times with the checkpoint (a directory or a URL, which labels the report); the
    report and the trajectories by task id. `tool_grammar` is how the checkpoint is meant to decode tool calls
    ("auto"/"required": constrained to parse and fit their schemas, model.grammar; its metadata's `usage`)."""
    config = config or EvalConfig()
    if not tasks:
        raise ValueError("no tasks to evaluate: give a directory made by `codefleet tasks generate`")
    torch.set_num_threads(config.threads)
    started = time.perf_counter()
    engine = Engine.load(storage.local_copy(checkpoint), max_batch=max(1, config.jobs * config.attempts))
    try:
        policy = LocalEnginePolicy(
            engine=engine,
            max_tokens=config.max_tokens,
            temperature=config.temperature,
            seed=0,
            name=f"local:{checkpoint}",
            **grammar_options(tool_grammar),
        )
        return evaluate_policy(policy, checkpoint, tasks, config, sandbox_config, episode_config, on_task, started)
    finally:
        engine.close()


def evaluate_endpoint(
    base_url: str,
    tasks: list[Task],
    config: EvalConfig | None = None,
    model: str = "",
    sandbox_config=None,
    episode_config=None,
    on_task=None,
) -> tuple[EvalReport, dict[str, list[Trajectory]]]:
    """The same evaluation of a model behind an OpenAI-compatible endpoint (vLLM, SGLang, `codefleet serve`,
    ...): each turn is one chat request, so `exact_tokens` does not apply."""

    config = config or EvalConfig()
    if config.exact_tokens:
        raise ValueError(
            "exact tokens need codefleet's own engine in process; evaluate a checkpoint for that, "
            "an endpoint sees the conversation rendered again each turn"
        )
    if not tasks:
        raise ValueError("no tasks to evaluate: give a directory made by `codefleet tasks generate`")
    policy = OpenAIPolicy(
        OpenAIConfig(base_url=base_url, model=model, temperature=config.temperature, max_tokens=config.max_tokens)
    )
    label = policy.model_name()  # fails here, in one sentence (PolicyError), if the endpoint cannot be reached
    return evaluate_policy(policy, label, tasks, config, sandbox_config, episode_config, on_task)


def evaluate_policy(
    policy,
    label: str,
    tasks: list[Task],
    config: EvalConfig,
    sandbox_config=None,
    episode_config=None,
    on_task=None,
    started: float | None = None,
) -> tuple[EvalReport, dict[str, list[Trajectory]]]:
    """`jobs` tasks at once, `attempts` forked attempts each, with `policy`; the report is labelled `label`."""

    started = time.perf_counter() if started is None else started

    def one(task: Task) -> list[Trajectory] | TaskSetupError:
        try:
            trajectories = run_task_attempts(
                task, policy, config.attempts, sandbox_config, config=episode_config, exact_tokens=config.exact_tokens
            )
        except TaskSetupError as e:  # the task's fault, not the policy's: named in the report, not scored
            return e
        if on_task:
            on_task(task, trajectories)
        return trajectories

    with ThreadPoolExecutor(max_workers=config.jobs, thread_name_prefix="eval") as pool:
        done = dict(zip([t.id for t in tasks], pool.map(one, tasks), strict=True))
    results = {tid: r for tid, r in done.items() if not isinstance(r, TaskSetupError)}
    broken = {tid: str(r) for tid, r in done.items() if isinstance(r, TaskSetupError)}
    report = summarize(label, results, config.attempts, time.perf_counter() - started, broken)
    report.groups = breakdown(tasks, results)
    return report, results


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion k/n."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(center - half, 0.0), min(center + half, 1.0)


def difference_interval(k_new: int, n_new: int, k_base: int, n_base: int) -> tuple[float, float]:
    """95% interval of k_new/n_new - k_base/n_base (Newcombe's hybrid score interval, from two Wilson intervals)."""
    p_new, p_base = k_new / n_new, k_base / n_base
    (l_new, u_new), (l_base, u_base) = wilson_interval(k_new, n_new), wilson_interval(k_base, n_base)
    d = p_new - p_base
    return (
        d - math.sqrt((p_new - l_new) ** 2 + (u_base - p_base) ** 2),
        d + math.sqrt((u_new - p_new) ** 2 + (p_base - l_base) ** 2),
    )


def mean_ratio_interval(
    new: list[float], base: list[float], resamples: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% bootstrap interval (percentiles, seeded) of mean(new) / mean(base) - 1."""
    rng = random.Random(seed)
    changes = sorted(
        statistics.fmean(rng.choices(new, k=len(new))) / statistics.fmean(rng.choices(base, k=len(base))) - 1
        for _ in range(resamples)
    )
    return changes[int(0.025 * resamples)], changes[int(0.975 * resamples) - 1]


def compare(base: dict, new: dict) -> dict:
    """How `new` did against `base` (two evaluation summaries of the same tasks and settings, with `solved_turns`):
    the change in success with its 95% interval, and the change in turns per solved task with its bootstrap 95%
    interval (None when either solved nothing)."""
    n_base, n_new = base["tasks"] * base["attempts"], new["tasks"] * new["attempts"]
    k_base, k_new = round(base["success_rate"] * n_base), round(new["success_rate"] * n_new)
    points = k_new / n_new - k_base / n_base
    points_ci = difference_interval(k_new, n_new, k_base, n_base)
    out = {
        "success_points": round(points, 4),
        "success_points_ci": [round(x, 4) for x in points_ci],
        "solved": [k_base, k_new],
        "episodes": [n_base, n_new],
        "turns_change": None,
        "turns_change_ci": None,
    }
    turns_base, turns_new = base.get("solved_turns") or [], new.get("solved_turns") or []
    if turns_base and turns_new:
        out["turns_change"] = round(statistics.fmean(turns_new) / statistics.fmean(turns_base) - 1, 4)
        out["turns_change_ci"] = [round(x, 4) for x in mean_ratio_interval(turns_new, turns_base)]
    return out


def _direction(interval: list[float], up: str, down: str) -> str | None:
    """`up` or `down` when the 95% interval lies clear of zero on that side, else None."""
    lo, hi = interval
    return up if lo > 0 else down if hi < 0 else None


def comparison_line(c: dict, base: str = "sft", new: str = "rl") -> str:
    """What `new` changed against `base` (`compare()`), with intervals, and which changes are clear of noise."""
    lo, hi = c["success_points_ci"]
    text = (
        f"{new} against {base}: success {100 * c['success_points']:+.1f} points (95% interval {100 * lo:+.1f} to "
        f"{100 * hi:+.1f}; {c['solved'][1]} vs {c['solved'][0]} solved of {c['episodes'][1]} and "
        f"{c['episodes'][0]} episodes)"
    )
    clear = [_direction(c["success_points_ci"], "success rose", "success fell")]
    if c["turns_change"] is not None:
        tlo, thi = c["turns_change_ci"]
        text += f", turns per solved task {c['turns_change']:+.0%} (95% interval {tlo:+.0%} to {thi:+.0%})"
        clear.append(_direction(c["turns_change_ci"], "solved tasks took more turns", "solved tasks took fewer turns"))
    clear = [x for x in clear if x]
    if not clear:
        return text + ". Both intervals hold zero: at this many episodes neither change is distinguishable from noise."
    return text + f". Clear of noise: {' and '.join(clear)}."


def report_json(report: EvalReport) -> str:
    return json.dumps(report.summary(), sort_keys=True)
