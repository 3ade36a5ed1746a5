"""The agent loop: model turn -> tool calls (concurrently) -> next turn.

    loop = AgentLoop(policy, sandbox, budgets)
    trajectory = loop.run(build_messages("Fix the failing test"))

One iteration: check the budgets, hand any corrections the user injected to
the model as user messages, ask the policy for one assistant turn, execute
all of its tool calls at once (parallel.py) and append one `tool` message per
call, in call order, each with its `tool_call_id`. The episode ends when

- the model calls `submit` (stop_reason "submit"),
- the model answers without tool calls ("no_tool_calls"),
- a budget runs out: turns, tool calls, tokens or wall clock
  ("max_turns", "max_tool_calls", "max_tokens", "wall_clock"),
- the policy fails, e.g. the endpoint stays down after its retries ("error";
  what failed is `trajectory.failure`, the message `trajectory.metadata["error"]`),
- `cancel()` was called, e.g. on Ctrl-C ("cancelled").

Anything malformed a model writes becomes an error observation (tools.py);
the loop never raises because of model output. Each Turn records the model
and tool time, tokens, tool calls and results, errors and — when the policy
provides them — the sampled token ids, logprobs, policy versions and routed
experts for RL. `inject()` and `cancel()` are thread-safe and may be called
while `run()` is in progress, from any thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import replace

from codefleet.agent.parallel import execute_calls
from codefleet.agent.policy import OutOfTime, assistant_message
from codefleet.agent.tools import Toolbox, ToolConfig, tool_schemas
from codefleet.contracts import Policy, Sandbox
from codefleet.types import Budgets, Failure, PolicyOutput, ToolCall, ToolResult, Trajectory, Turn

Event = dict
EventSink = Callable[[Event], None]


class AgentLoop:
    def __init__(
        self,
        policy: Policy,
        sandbox: Sandbox,
        budgets: Budgets | None = None,
        tool_config: ToolConfig | None = None,
        on_event: EventSink | None = None,
        show_tools: bool = True,
    ):
        self.policy = policy
        self.toolbox = Toolbox(sandbox, tool_config)
        self.budgets = budgets or Budgets()
        self.on_event = on_event or (lambda event: None)
        self.tools = tool_schemas() if show_tools else []  # the schemas the policy sees; every tool works either way
        self._corrections: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._cancelled = threading.Event()

    def inject(self, message: str) -> None:
        """A correction from the user; the model sees it as a user message at its next turn."""
        self._corrections.put(message)

    def cancel(self) -> None:
        """Stop before the next turn (the current model call or tool calls finish first)."""
        self._cancelled.set()

    def run(self, messages: list[dict], task_id: str = "") -> Trajectory:
        """Run the episode from `messages` (system prompt, task, ...); `messages` grows in place."""
        started = time.perf_counter()
        turns: list[Turn] = []
        stop_reason, error, failure = "", "", Failure.POLICY
        while not stop_reason:
            stop_reason = self._budget_stop(turns, time.perf_counter() - started)
            if stop_reason:
                break
            self._deliver_corrections(messages)
            model_started = time.perf_counter()
            try:
                output = self.policy.generate(messages, self.tools)
            except Exception as e:  # the endpoint, not the model's words: end the episode, say why
                error, failure = f"{type(e).__name__}: {e}", getattr(e, "failure", Failure.POLICY)
                stop_reason = "wall_clock" if isinstance(e, OutOfTime) else "error"  # the budget, not the endpoint
                self.on_event({"event": "model_error", "turn": len(turns), "error": error})
                break
            turn = self._new_turn(len(turns), output, time.perf_counter() - model_started)
            messages.append(assistant_message(replace(output, tool_calls=turn.tool_calls)))
            turns.append(turn)
            if not turn.tool_calls:
                stop_reason = "no_tool_calls"
            else:
                stop_reason = self._act(turn, messages, turns, started)
            self.on_event(
                {
                    "event": "turn",
                    "turn": turn.index,
                    "tool_calls": [c.name for c in turn.tool_calls],
                    "model_s": turn.model_s,
                    "tool_s": turn.tool_s,
                    "errors": turn.errors,
                    "tokens": turn.prompt_tokens + turn.completion_tokens,
                    "text": turn.text,
                }
            )
        trajectory = Trajectory(
            task_id=task_id,
            messages=messages,
            turns=turns,
            stop_reason=stop_reason,
            wall_s=time.perf_counter() - started,
            model_s=sum(t.model_s for t in turns),
            tool_s=sum(t.tool_s for t in turns),
        )
        if error:
            trajectory.metadata["error"] = error
            trajectory.failure = failure if stop_reason == "error" else None
        self.on_event(
            {
                "event": "stop",
                "stop_reason": stop_reason,
                "turns": len(turns),
                "wall_s": trajectory.wall_s,
                "error": error,
            }
        )
        return trajectory

    # -- one turn -----------------------------------------------------------------------

    def _budget_stop(self, turns: list[Turn], elapsed_s: float) -> str:
        b = self.budgets
        if self._cancelled.is_set():
            return "cancelled"
        if len(turns) >= b.max_turns:
            return "max_turns"
        if sum(len(t.tool_calls) for t in turns) >= b.max_tool_calls:
            return "max_tool_calls"
        if sum(t.prompt_tokens + t.completion_tokens for t in turns) >= b.max_tokens:
            return "max_tokens"
        if elapsed_s >= b.wall_clock_s:
            return "wall_clock"
        return ""

    def _deliver_corrections(self, messages: list[dict]) -> None:
        while True:
            try:
                text = self._corrections.get_nowait()
            except queue.Empty:
                return
            messages.append({"role": "user", "content": text})
            self.on_event({"event": "correction", "text": text})

    def _new_turn(self, index: int, output: PolicyOutput, model_s: float) -> Turn:
        """A Turn for the policy's output, with every tool call given a unique id."""
        calls: list[ToolCall] = []
        seen: set[str] = set()
        for i, call in enumerate(output.tool_calls):
            if not call.id or call.id in seen:  # some servers omit or repeat ids
                call = replace(call, id=f"call_{index}_{i}")
            seen.add(call.id)
            calls.append(call)
        return Turn(
            index=index,
            text=output.text or "",
            tool_calls=calls,
            model_s=model_s,
            prompt_tokens=output.prompt_tokens,
            completion_tokens=output.completion_tokens,
            token_ids=output.token_ids,
            logprobs=output.logprobs,
            policy_versions=output.policy_versions,
            routed_experts=output.routed_experts,
        )

    def _act(self, turn: Turn, messages: list[dict], turns: list[Turn], started: float) -> str:
        """Execute the turn's tool calls, append their results; the stop reason, if this turn ends the episode."""
        used = sum(len(t.tool_calls) for t in turns[:-1])
        allowed = max(self.budgets.max_tool_calls - used, 0)
        calls, refused = turn.tool_calls[:allowed], turn.tool_calls[allowed:]
        left_s = self.budgets.wall_clock_s - (time.perf_counter() - started)
        tools_started = time.perf_counter()
        results = execute_calls(self.toolbox, calls, max_timeout_s=max(left_s, 1.0))
        turn.tool_s = time.perf_counter() - tools_started
        results += [
            ToolResult(
                c.id,
                c.name,
                f"error: not run — the episode's budget of {self.budgets.max_tool_calls} tool calls is used up",
                False,
            )
            for c in refused
        ]
        turn.tool_results = results
        turn.errors = [f"{r.name}: {r.output[len('error: ') :]}" for r in results if r.output.startswith("error: ")]
        for result in results:
            messages.append({"role": "tool", "tool_call_id": result.call_id, "content": result.output})
        if any(r.name == "submit" and r.ok for r in results):
            return "submit"
        return "max_tool_calls" if refused else ""
