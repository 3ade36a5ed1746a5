"""What the agent loop asks of a model (the `codefleet.contracts.Policy` Protocol), and what every backend shares.

A policy is given the conversation so far (OpenAI chat messages) and the tool
schemas, and returns ONE assistant turn: text, zero or more tool calls, token
usage and — for reinforcement learning — the exact sampled token ids, their
logprobs, the policy version that produced each token and the routed experts
(MoE). Every backend (an OpenAI-compatible HTTP endpoint, the scripted
expert, the local engine) implements this one method, so the loop never
knows which model it talks to.

Tool calls travel as the model wrote them: `raw_arguments` is the JSON text;
`parse_tool_call` decodes it once, here, so that every backend produces the
same ToolCall and malformed JSON becomes an error the loop reports back to
the model instead of an exception. In the conversation sent back to the
server such a call's arguments read "{}" (`assistant_message`).
"""

from __future__ import annotations

import json

from codefleet.types import Failure, PolicyOutput, ToolCall


class PolicyError(RuntimeError):
    """The model could not produce a turn (endpoint down, bad response); the message says what to check."""

    failure = Failure.POLICY


class OutOfTime(PolicyError):
    """The episode's wall clock ran out before or during the model call (the loop stops with "wall_clock")."""


def parse_tool_call(call_id: str, name: str, raw_arguments: str | dict | None) -> ToolCall:
    """A ToolCall from what a model wrote; bad JSON is kept and explained in `error`."""
    if isinstance(raw_arguments, dict):  # some servers send an object instead of a JSON string
        raw_arguments = json.dumps(raw_arguments)
    raw = raw_arguments if isinstance(raw_arguments, str) else ""
    if not raw.strip():
        return ToolCall(call_id, name, raw, arguments={})
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall(
            call_id,
            name,
            raw,
            error=f"the arguments of {name!r} are not valid JSON ({e.msg} at "
            f'character {e.pos}); send one JSON object, e.g. {{"path": "src/app.py"}}',
        )
    if not isinstance(value, dict):
        return ToolCall(
            call_id, name, raw, error=f"the arguments of {name!r} must be a JSON object, got {type(value).__name__}"
        )
    return ToolCall(call_id, name, raw, arguments=value)


def assistant_message(output: PolicyOutput) -> dict:
    """The OpenAI chat message that records `output` in the conversation. A call whose arguments did not
    parse is recorded with "{}": servers such as vLLM parse the arguments of the history and answer 400
    to bad JSON, which would end the episode. The text the model wrote stays in the Turn's ToolCall, and
    the tool message that answers the call says what was wrong with it."""
    message: dict = {"role": "assistant", "content": output.text or ""}
    if output.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _sendable_arguments(c)}}
            for c in output.tool_calls
        ]
    return message


def _sendable_arguments(call: ToolCall) -> str:
    """The call's arguments as the model wrote them when they are a JSON object, else "{}"."""
    if call.error is None and call.arguments is not None and call.raw_arguments.strip():
        return call.raw_arguments
    return "{}"
