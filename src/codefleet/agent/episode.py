"""One episode end to end: sandbox, (plan,) loop, diff, hidden checks, reward.

    trajectory = run_episode(task, policy, SandboxConfig())
    trajectory.reward, trajectory.checks.all_passed, trajectory.diff

`solve()` is the part the product CLI shares with training: optional plan,
then the agent loop, in a sandbox that already exists. `run_episode()` adds
what only a Task has: the sandbox is prepared from the task
(tasks.checks.prepare_sandbox: repo, setup commands, nothing hidden inside),
and after the loop the final diff is taken, the hidden checks run in the
same sandbox, and the reward and efficiency figures are computed
(reward.py). The Trajectory holds all of it plus the transcript.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from codefleet.agent.loop import AgentLoop, EventSink
from codefleet.agent.planner import make_plan
from codefleet.agent.prompts import build_messages, check_prompt
from codefleet.agent.reward import RewardConfig, efficiency, reward_parts
from codefleet.agent.tools import ToolConfig
from codefleet.contracts import Policy, Sandbox
from codefleet.sandbox.base import SandboxConfig
from codefleet.tasks.allowance import task_allowance
from codefleet.tasks.checks import prepare_sandbox, run_checks, workspace_diff
from codefleet.types import Budgets, Task, Trajectory


@dataclass
class EpisodeConfig:
    """How an episode runs. `budgets` None: the task's own budgets. `prompt`: "full" (system prompt and
    tool schemas) or "bare" (the task alone; agent.prompts)."""

    budgets: Budgets | None = None
    tools: ToolConfig = field(default_factory=ToolConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    prompt: str = "full"


def solve(
    sandbox: Sandbox,
    instruction: str,
    policy: Policy,
    *,
    planner: Policy | None = None,
    test_command: str = "",
    budgets: Budgets | None = None,
    tool_config: ToolConfig | None = None,
    on_event: EventSink | None = None,
    on_loop: Callable[[AgentLoop], None] | None = None,
    task_id: str = "",
    prompt: str = "full",
) -> Trajectory:
    """Plan (if a planner is given) and run the agent loop in `sandbox`. `on_loop` receives the loop
    before it starts, e.g. to keep a handle for `inject()`."""
    started = time.perf_counter()
    on_event = on_event or (lambda event: None)
    loop = AgentLoop(policy, sandbox, budgets, tool_config, on_event, show_tools=check_prompt(prompt) == "full")
    if on_loop:
        on_loop(loop)
    metadata: dict[str, str | int | float] = {"policy": getattr(policy, "name", "")}
    plan_text, plan_s = "", 0.0
    if planner is not None:
        try:
            plan = make_plan(planner, instruction, sandbox, test_command)
        except Exception as e:  # the planner's endpoint failed: no episode without the plan asked for
            error = f"planner failed: {type(e).__name__}: {e}"
            on_event({"event": "model_error", "turn": -1, "error": error})
            return Trajectory(
                task_id,
                build_messages(instruction, test_command, prompt=prompt),
                [],
                "error",
                wall_s=time.perf_counter() - started,
                metadata={**metadata, "error": error},
            )
        plan_text, plan_s = plan.text, plan.model_s
        metadata.update(
            planner=plan.planner,
            plan=plan.text,
            planner_model_s=round(plan.model_s, 3),
            planner_tokens=plan.prompt_tokens + plan.completion_tokens,
        )
        on_event({"event": "plan", "text": plan.text, "model_s": plan.model_s})
    trajectory = loop.run(build_messages(instruction, test_command, plan_text, prompt), task_id)
    trajectory.model_s += plan_s
    trajectory.wall_s = time.perf_counter() - started
    trajectory.metadata = {**metadata, **trajectory.metadata}
    return trajectory


def score(trajectory: Trajectory, sandbox: Sandbox, task: Task, reward: RewardConfig | None = None) -> Trajectory:
    """After the loop: the final diff, the hidden checks in the sandbox, reward and figures."""

    try:
        trajectory.diff = workspace_diff(sandbox)
        trajectory.checks = run_checks(sandbox, task)
    except Exception as e:  # a sandbox that died during the episode: no reward, say why
        trajectory.metadata["checks_error"] = f"{type(e).__name__}: {e}"
    parts = reward_parts(trajectory, reward)
    trajectory.reward = parts["reward.correctness"] - parts["reward.costs"]
    trajectory.metadata.update({k: round(v, 6) for k, v in parts.items()})  # the report shows them
    trajectory.metadata.update(efficiency(trajectory))
    for key, value in task.metadata.items():
        trajectory.metadata.setdefault(f"task.{key}", value)
    trajectory.metadata.update(task_allowance(task))  # what the task allows, for the analysis rules
    return trajectory


def run_episode(
    task: Task,
    policy: Policy,
    sandbox_config: SandboxConfig | None = None,
    *,
    planner: Policy | None = None,
    config: EpisodeConfig | None = None,
    on_event: EventSink | None = None,
    on_loop: Callable[[AgentLoop], None] | None = None,
) -> Trajectory:
    """Run `policy` on `task` in a fresh sandbox and score it; the sandbox is closed afterwards."""

    config = config or EpisodeConfig()
    sandbox = prepare_sandbox(task, sandbox_config)
    try:
        trajectory = solve(
            sandbox,
            task.instruction,
            policy,
            planner=planner,
            test_command=task.test_command,
            budgets=config.budgets or task.budgets,
            tool_config=config.tools,
            on_event=on_event,
            on_loop=on_loop,
            task_id=task.id,
            prompt=config.prompt,
        )
        return score(trajectory, sandbox, task, config.reward)
    finally:
        sandbox.close()
