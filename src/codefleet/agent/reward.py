"""Reward of an episode: correctness from the hidden checks, minus what speed cost.

    reward = base - cost_per_turn * turns - cost_per_s * wall_s - cost_per_token * tokens
                  - cost_per_tool_error * tool errors

`base` is 1/0 for "all hidden checks pass" (mode "all_pass") or the fraction
of checks that pass (mode "fraction"). All costs default to zero, so the
default reward is plain correctness; turning them on trains speed, the way a
production agent is rewarded for finishing in fewer turns and less time. A
tool error (a malformed call, an unknown tool, a tool that failed) wastes a
round trip, so `cost_per_tool_error` prices it too.

`costs_on="solved"` multiplies the costs by `base`: a failed episode scores 0
however long it ran, a solved one 1 minus what it cost. With costs on every
episode (`"all"`) and few successes, ending at once is the best-paid failure:
the demo's policy learnt exactly that in 16 RL steps (1 turn, no tool calls,
on every held-out task). Scaled, speed is still rewarded among successes and
giving up never beats trying.

`require_submit` scores an episode that never called `submit` (it ran out
of turns, tokens or time, or stopped calling tools) as unsolved, whatever
its checks say: an agent should know when it is done. Without it, an
episode that passes the tests and then runs on to the turn limit is a
success like one that submits at once. (On the demo's policy it changed
nothing measurable: its training rollouts hardly ever solve a task without
submitting; docs/experiments/.)
"""

from __future__ import annotations

from dataclasses import dataclass

from codefleet.types import CheckResult, Trajectory

REWARD_MODES = ("all_pass", "fraction")
COSTS_ON = ("all", "solved")


@dataclass
class RewardConfig:
    mode: str = "all_pass"  # "all_pass" | "fraction"
    cost_per_turn: float = 0.0  # per turn the episode took
    cost_per_s: float = 0.0  # per second of episode wall clock
    cost_per_token: float = 0.0  # per prompt + completion token
    cost_per_tool_error: float = 0.0  # per tool call that came back as an error (Turn.errors)
    costs_on: str = "all"  # "all" | "solved": with "solved", costs scale with correctness (a failure scores 0)
    require_submit: bool = False  # an episode that never submitted scores as unsolved

    def __post_init__(self) -> None:
        if self.mode not in REWARD_MODES:
            raise ValueError(f"unknown reward mode {self.mode!r}; choose one of {', '.join(REWARD_MODES)}")
        if self.costs_on not in COSTS_ON:
            raise ValueError(f"unknown costs_on {self.costs_on!r}; choose one of {', '.join(COSTS_ON)}")


def correctness(checks: CheckResult | None, mode: str = "all_pass") -> float:
    if checks is None:
        return 0.0
    if mode == "fraction":
        return checks.fraction
    return 1.0 if checks.all_passed else 0.0


def compute_reward(trajectory: Trajectory, config: RewardConfig | None = None) -> float:
    """The reward of a finished trajectory (its `checks` filled in)."""
    parts = reward_parts(trajectory, config)
    return parts["reward.correctness"] - parts["reward.costs"]


def reward_parts(trajectory: Trajectory, config: RewardConfig | None = None) -> dict[str, float]:
    """The reward's two parts: `reward.correctness` (the base) and `reward.costs` (what speed cost, as
    subtracted); the reward is their difference. Kept in a rollout's metadata for the analysis."""
    config = config or RewardConfig()
    base = _base(trajectory, config)
    costs = (
        config.cost_per_turn * trajectory.n_turns
        + config.cost_per_s * trajectory.wall_s
        + config.cost_per_token * trajectory.tokens
        + config.cost_per_tool_error * tool_errors(trajectory)
    )
    return {"reward.correctness": base, "reward.costs": base * costs if config.costs_on == "solved" else costs}


def _base(trajectory: Trajectory, config: RewardConfig) -> float:
    submitted = trajectory.stop_reason == "submit"
    return correctness(trajectory.checks, config.mode) if submitted or not config.require_submit else 0.0


def solved(trajectory: Trajectory, config: RewardConfig | None = None) -> bool:
    """Whether the reward counts the episode as fully solved (every check passes; submitted, if required)."""
    return _base(trajectory, config or RewardConfig()) >= 1.0


def tool_errors(trajectory: Trajectory) -> int:
    return sum(len(t.errors) for t in trajectory.turns)


def efficiency(trajectory: Trajectory) -> dict[str, float | int]:
    """The speed figures of an episode, for logs, reports and the reward."""
    return {
        "turns": trajectory.n_turns,
        "tool_calls": trajectory.n_tool_calls,
        "tool_calls_per_turn": round(trajectory.tool_calls_per_turn, 3),
        "wall_s": round(trajectory.wall_s, 3),
        "model_s": round(trajectory.model_s, 3),
        "tool_s": round(trajectory.tool_s, 3),
        "tokens": trajectory.tokens,
        "tool_errors": tool_errors(trajectory),
    }
