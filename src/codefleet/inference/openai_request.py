"""An OpenAI chat-completions request body, validated: the prompt's token ids, the sampling parameters
(with the tool-call grammar that `tool_choice`, a `"strict"` tool or the server's `tool_grammar` asks
for) and how to answer (`ChatRequest`). Any body a client can send is either a `ChatRequest` or one
`RequestError` naming the field at fault, which the server (server.py) answers with OpenAI's error body.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from codefleet.chat import formats
from codefleet.inference.engine import Engine
from codefleet.inference.grammar import call_node
from codefleet.inference.sampling import SamplingParams

MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


class RequestError(Exception):
    """A request the server refuses; becomes an OpenAI-style error response."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: str | None = None,
        status: int = 400,
        type_: str = "invalid_request_error",
    ):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_


@dataclass
class ChatRequest:
    """A validated chat-completions request."""

    prompt: list[int]
    params: SamplingParams
    tools: list[dict]
    stream: bool
    include_usage: bool
    logprobs: bool


def parse_request(
    body: object,
    engine: Engine,
    tokenizer,
    model_name: str,
    default_max_tokens: int,
    prompt: str = "full",
    tool_grammar: bool = False,
) -> ChatRequest:
    """Validate an OpenAI chat-completions body; raises RequestError naming the bad field."""
    if not isinstance(body, dict):
        raise RequestError('the request body must be a JSON object with "model" and "messages"')
    model = body.get("model")
    if model is not None and model != model_name:
        raise RequestError(
            f"the model {model!r} does not exist here; this server serves {model_name!r} (GET /v1/models)",
            param="model",
            code="model_not_found",
            status=404,
        )
    fmt = formats.of(tokenizer)
    messages = _messages(body, fmt)
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError(
            '"tools" must be an array of {"type": "function", "function": {...}} objects',
            param="tools",
            code="invalid_type",
        )
    tools, grammar = _tool_choice(body.get("tool_choice"), tools, tool_grammar)
    markers = (fmt.tool_calls.call_open, fmt.tool_calls.call_close)
    if grammar and not all(m in tokenizer.special for m in markers):
        raise RequestError(
            f"this model's tool-call markers {markers} are not single tokens, so its tool calls "
            'cannot be constrained; send tool_choice "auto" and tools not marked strict',
            param="tool_choice",
            code="invalid_value",
        )
    params, limit_field, logprobs = _sampling(body, fmt.stop_ids(tokenizer), grammar, default_max_tokens)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise RequestError('"stream" must be true or false', param="stream", code="invalid_type")
    stream_options = body.get("stream_options") or {}
    ids = _prompt_ids(messages, tools, prompt, fmt, tokenizer, engine.max_seq_len)
    room = engine.max_seq_len - len(ids)
    if room < 1:
        raise RequestError(
            f"the prompt has {len(ids)} tokens but this model's context is {engine.max_seq_len} "
            "tokens; shorten the messages",
            param="messages",
            code="context_length_exceeded",
        )
    if body.get(limit_field) is not None and params.max_tokens > room:  # OpenAI refuses it; unsent, it is the room
        raise RequestError(
            f"{limit_field} is {params.max_tokens} but the prompt's {len(ids)} tokens leave {room} "
            f"of this model's context of {engine.max_seq_len}; lower {limit_field} or shorten the "
            "messages",
            param=limit_field,
            code="context_length_exceeded",
        )
    params.max_tokens = min(params.max_tokens, room)
    return ChatRequest(
        ids,
        params,
        tools,
        bool(stream),
        bool(isinstance(stream_options, dict) and stream_options.get("include_usage")),
        logprobs,
    )


def _messages(body: dict, fmt) -> list[dict]:
    """The request's messages, checked against the chat format's roles (a "developer" message is a system one)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(
            '"messages" must be a non-empty array of chat messages',
            param="messages",
            code="missing_required_parameter" if messages is None else "invalid_type",
        )
    # OpenAI's "developer" role is the system prompt of newer models
    messages = [
        {**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages
    ]
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in fmt.roles:
            raise RequestError(
                f'messages[{i}] must be an object whose "role" is one of {", ".join(fmt.roles)} or developer',
                param=f"messages[{i}]",
                code="invalid_value",
            )
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RequestError(
                f"messages[{i}].content must be a string, an array of content parts or null",
                param=f"messages[{i}].content",
                code="invalid_type",
            )
    return messages


def _sampling(
    body: dict, stop_token_ids: list[int], grammar: dict, default_max_tokens: int
) -> tuple[SamplingParams, str, bool]:
    """(the sampling parameters, the name of the field that limits the completion, whether logprobs were asked
    for) of the request; `grammar`: the SamplingParams fields of its tool choice (`_tool_choice`)."""
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise RequestError(
            "only n=1 is supported; send several requests for several completions", param="n", code="invalid_value"
        )
    limit_field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) for s in stop)):
        raise RequestError('"stop" must be a string or an array of strings', param="stop", code="invalid_type")
    params = SamplingParams(
        max_tokens=_field(body, "max_tokens", body.get(limit_field), int, default_max_tokens),
        temperature=float(_field(body, "temperature", body.get("temperature"), (int, float), 1.0)),
        top_p=float(_field(body, "top_p", body.get("top_p"), (int, float), 1.0)),
        top_k=_field(body, "top_k", body.get("top_k"), int, 0),
        seed=_field(body, "seed", body.get("seed"), int, None),
        stop=[s for s in (stop or []) if s],
        stop_token_ids=stop_token_ids,
        **grammar,
    )
    logprobs = bool(body.get("logprobs"))
    params.top_logprobs = _top_logprobs(body.get("top_logprobs"), logprobs)
    if params.temperature > 2:
        raise RequestError(
            f"temperature must be between 0 and 2, got {params.temperature}", param="temperature", code="invalid_value"
        )
    try:
        params.validate()
    except ValueError as e:
        raise RequestError(str(e), param=str(e).split()[0], code="invalid_value") from None
    return params, limit_field, logprobs


def _prompt_ids(messages: list[dict], tools: list[dict], prompt: str, fmt, tokenizer, max_seq_len: int) -> list[int]:
    """The prompt's token ids in the server's prompt style ("bare": no system messages, no tool schemas), refused
    before tokenizing when its characters alone prove it longer than the context."""
    shown, shown_tools = messages, tools
    if prompt == "bare":  # the policy was trained on the conversation alone (server.py's docstring)
        shown, shown_tools = [m for m in messages if m["role"] != "system"], None
        if not shown:
            raise RequestError(
                "this model was trained without system prompts and sees none; send the task as a user message",
                param="messages",
                code="invalid_value",
            )
    try:
        least = fmt.least_tokens(tokenizer, shown, shown_tools)
        if least >= max_seq_len:  # refused before tokenizing: its characters alone prove it too long
            raise RequestError(
                f"the messages are at least {least} tokens but this model's context is "
                f"{max_seq_len} tokens; shorten the messages",
                param="messages",
                code="context_length_exceeded",
            )
        return fmt.encode_chat(tokenizer, shown, shown_tools)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise RequestError(f"the messages could not be rendered: {e}", param="messages", code="invalid_value") from None


def _top_logprobs(value: object, logprobs: bool) -> int:
    """OpenAI's `top_logprobs`: an integer from 0 to 20, sent only with `"logprobs": true`."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(
            f'"top_logprobs" must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {json.dumps(value)[:40]}',
            param="top_logprobs",
            code="invalid_type",
        )
    if not 0 <= value <= MAX_TOP_LOGPROBS:
        raise RequestError(
            f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, got {value}",
            param="top_logprobs",
            code="invalid_value",
        )
    if not logprobs:
        raise RequestError(
            'top_logprobs needs "logprobs": true; send both, or leave top_logprobs out',
            param="top_logprobs",
            code="invalid_value",
        )
    return value


def _tool_choice(tool_choice: object, tools: list[dict], tool_grammar: bool) -> tuple[list[dict], dict]:
    """(the tools offered, the SamplingParams fields that constrain decoding: model.grammar) for OpenAI's
    `tool_choice`. "none" hides the tools and the turn may not open a call; "required" makes the turn tool
    calls alone, opening with one, and a named function makes it one call of that function; "auto"
    constrains the calls to tools marked `"strict": true`, or to any tool on a server started with
    tool_grammar."""

    def name_of(tool: dict) -> object:
        return (tool.get("function") or {}).get("name") if isinstance(tool.get("function"), dict) else tool.get("name")

    if tool_choice == "none":
        return [], {"tool_choice": "none"}
    max_calls = 0
    if isinstance(tool_choice, dict):  # {"type": "function", "function": {"name": ...}}
        name = (
            (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), dict) else None
        )
        tools = [t for t in tools if name_of(t) == name]
        if not tools:
            raise RequestError(
                f'tool_choice names the function {name!r}, which is not in "tools"',
                param="tool_choice",
                code="invalid_value",
            )
        tool_choice, max_calls = "required", 1  # OpenAI: call exactly this function
    elif tool_choice not in (None, "auto", "required"):
        raise RequestError(
            'tool_choice must be "auto", "none", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
            code="invalid_value",
        )
    if tool_choice == "required":
        if not tools:
            raise RequestError(
                'tool_choice requires a tool call but "tools" is empty', param="tool_choice", code="invalid_value"
            )
        grammar = {"tools": tools, "tool_choice": "required", "calls_only": True, "max_calls": max_calls}
    elif tools and (
        tool_grammar or any(isinstance(t.get("function"), dict) and t["function"].get("strict") is True for t in tools)
    ):
        grammar = {"tools": tools, "tool_choice": "auto"}
    else:
        return tools, {}
    try:
        call_node(tools)
    except ValueError as e:
        raise RequestError(f"the tools cannot constrain decoding: {e}", param="tools", code="invalid_value") from None
    return tools, grammar


def _field(body: dict, name: str, value: object, types, default):
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, types):
        kind = "an integer" if types is int else "a number"
        raise RequestError(f'"{name}" must be {kind}, got {json.dumps(value)}', param=name, code="invalid_type")
    return value
