"""Parallel attempts: N episodes at once in N forked sandboxes, the best one kept.

Forking gives every attempt the same starting state (copy-on-write, in
milliseconds), so attempts differ only by what the model did. They run on
threads (the work is in the model server and the sandboxes), and all of them
are reported, not just the winner.

Which attempt is best:
- for a Task, the one with the highest reward (hidden checks), ties broken
  by fewer turns, then less wall clock (`run_task_attempts`);
- for a user's repository, where there are no hidden checks, the one whose
  visible test command passes, then one that submitted, then one that
  changed something, then the fewest turns and the shortest time
  (`run_attempts`, `best_attempt`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from codefleet.agent import workspace
from codefleet.agent.episode import EpisodeConfig, score, solve
from codefleet.agent.loop import AgentLoop, Event
from codefleet.agent.tools import ToolConfig
from codefleet.contracts import Policy, Sandbox
from codefleet.sandbox.base import SandboxConfig
from codefleet.tasks.checks import prepare_sandbox
from codefleet.types import Budgets, Task, Trajectory


@dataclass
class Attempt:
    index: int
    trajectory: Trajectory
    diff: str
    tests_passed: bool | None = None  # None: no test command was given
    test_output: str = ""


def run_attempts(
    sandboxes: list[Sandbox],
    instruction: str,
    policy: Policy,
    *,
    planner: Policy | None = None,
    test_command: str = "",
    budgets: Budgets | None = None,
    tool_config: ToolConfig | None = None,
    on_event: Callable[[int, Event], None] | None = None,
    on_loop: Callable[[AgentLoop], None] | None = None,
    on_interrupt: Callable[[], None] | None = None,
    prompt: str = "full",
) -> list[Attempt]:
    """One attempt per sandbox (each already holding a workspace.snapshot()), all at once, each in the
    prompt style `prompt` (agent.prompts). The test command gets what is left of the wall-clock budget
    (at least 1 s, at most 600 s).

    The first Ctrl-C (KeyboardInterrupt while waiting) keeps the work: every loop stops before its next
    turn (stop reason "cancelled", after the model call or commands in flight), the test command is
    skipped, `on_interrupt()` is called and the attempts come back with their diffs. A second Ctrl-C
    propagates at once; the attempts run on daemon threads, so nothing then waits for them."""
    loops: list[AgentLoop] = []
    deadline = time.monotonic() + (budgets or Budgets()).wall_clock_s
    interrupted = threading.Event()

    def keep(loop: AgentLoop) -> None:
        loops.append(loop)
        if interrupted.is_set():
            loop.cancel()
        if on_loop:
            on_loop(loop)

    def attempt(index: int, sandbox: Sandbox) -> Attempt:
        sink = (lambda event: on_event(index, event)) if on_event else None
        trajectory = solve(
            sandbox,
            instruction,
            policy,
            planner=planner,
            test_command=test_command,
            budgets=budgets,
            tool_config=tool_config,
            on_event=sink,
            on_loop=keep,
            task_id=f"attempt-{index}",
            prompt=prompt,
        )
        trajectory.metadata["attempt"] = index
        result = Attempt(index, trajectory, _diff(sandbox, trajectory))
        if test_command and not interrupted.is_set():
            result.tests_passed, result.test_output = _run_test_command(sandbox, test_command, deadline)
        return result

    def cancel_all() -> None:
        for loop in list(loops):
            loop.cancel()

    def keep_the_work() -> None:  # the first Ctrl-C
        interrupted.set()
        cancel_all()
        if on_interrupt:
            on_interrupt()

    return _run_on_threads(attempt, sandboxes, on_first_interrupt=keep_the_work, on_abort=cancel_all)


def _diff(sandbox: Sandbox, trajectory: Trajectory) -> str:
    """The attempt's changes; "" with metadata["diff_error"] when the sandbox cannot say."""
    try:
        return workspace.diff(sandbox)
    except Exception as e:
        trajectory.metadata["diff_error"] = str(e)
        return ""


def _run_test_command(sandbox: Sandbox, test_command: str, deadline: float) -> tuple[bool, str]:
    """(passed, output) of the visible test command, given what is left of the wall clock (1 s to 600 s)."""
    left_s = deadline - time.monotonic()
    run = sandbox.run_oneoff(["bash", "-c", test_command], timeout_s=min(max(left_s, 1.0), 600.0))
    return run.ok, run.output


def _run_on_threads(
    attempt: Callable[[int, Sandbox], Attempt],
    sandboxes: list[Sandbox],
    *,
    on_first_interrupt: Callable[[], None],
    on_abort: Callable[[], None],
) -> list[Attempt]:
    """`attempt(i, sandbox)` for every sandbox, each on its own daemon thread, in sandbox order. A first
    KeyboardInterrupt while waiting calls `on_first_interrupt()` and waits on; anything else that escapes
    the wait (a second Ctrl-C) calls `on_abort()` and propagates. An attempt's exception is re-raised."""
    results: list[Attempt | BaseException | None] = [None] * len(sandboxes)
    finished = [threading.Event() for _ in sandboxes]

    def run(index: int, sandbox: Sandbox) -> None:
        try:
            results[index] = attempt(index, sandbox)
        except BaseException as e:
            results[index] = e
        finally:
            finished[index].set()

    def wait_all() -> None:  # Event.wait, not Thread.join: a join that Ctrl-C interrupts can lose the thread
        for done in finished:
            while not done.wait(0.2):
                pass

    for i, sb in enumerate(sandboxes):
        threading.Thread(target=run, args=(i, sb), name=f"attempt-{i}", daemon=True).start()
    try:
        try:
            wait_all()
        except KeyboardInterrupt:
            on_first_interrupt()
            wait_all()
    except BaseException:
        on_abort()
        raise
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results  # type: ignore[return-value]


def best_attempt(attempts: list[Attempt]) -> Attempt:
    """The attempt to keep for a user's repository (see the module docstring)."""
    return max(
        attempts,
        key=lambda a: (
            a.tests_passed is True,
            a.trajectory.stop_reason == "submit",
            bool(a.diff.strip()),
            -a.trajectory.n_turns,
            -a.trajectory.wall_s,
        ),
    )


def run_task_attempts(
    task: Task,
    policy: Policy,
    n: int,
    sandbox_config: SandboxConfig | None = None,
    *,
    planner: Policy | None = None,
    config: EpisodeConfig | None = None,
    exact_tokens: bool = False,
) -> list[Trajectory]:
    """n scored episodes of `task` in sandboxes forked from one prepared sandbox; in attempt order,
    each with metadata["attempt"]. Pick the best with `best_trajectory`. With `exact_tokens`, each
    episode runs on `policy.for_episode()` (a local engine's token-in/token-out view, as in RL's
    rollouts): every turn's prompt extends the exact tokens sampled before instead of the conversation
    rendered again, where a malformed call reads as the parser understood it."""

    config = config or EpisodeConfig()
    base = prepare_sandbox(task, sandbox_config)
    try:
        children = base.fork(n)
    finally:
        base.close()

    def attempt(index: int, sandbox: Sandbox) -> Trajectory:
        try:
            episode_policy = policy.for_episode() if exact_tokens else policy
            trajectory = solve(
                sandbox,
                task.instruction,
                episode_policy,
                planner=planner,
                test_command=task.test_command,
                budgets=config.budgets or task.budgets,
                tool_config=config.tools,
                task_id=task.id,
                prompt=config.prompt,
            )
            trajectory.metadata["attempt"] = index
            return score(trajectory, sandbox, task, config.reward)
        finally:
            sandbox.close()

    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="attempt") as pool:
        return list(pool.map(attempt, range(n), children))


def best_trajectory(trajectories: list[Trajectory]) -> Trajectory:
    return max(trajectories, key=lambda t: (t.reward, -t.n_turns, -t.wall_s))
