"""The chat template: OpenAI-style messages and tools <-> text and token ids,
and the parser for the tool calls a model writes.

One conversation renders as

    <|bos|><|system|>You are ...<|end|>
    <|tools|>{"name": "read_file", "description": ..., "parameters": {...}}
    {"name": "run", ...}<|end|>
    <|user|>Task: ...<|end|>
    <|assistant|>Reading both files.<|tool_call|>{"name": "read_file", "arguments": {"path": "a.py"}}<|/tool_call|><|tool_call|>{...}<|/tool_call|><|end|>
    <|tool|>     1	import os ...<|end|>
    <|tool|>...<|end|>
    <|assistant|>                                   <- the generation prompt

(no newlines between blocks: the special tokens delimit them). The tools
block (one JSON function schema per line) follows the leading system
message(s). Tool results come in the order of the calls they answer, so a
`<|tool|>` block carries no id. An assistant turn ends with `<|end|>`: that
is the stop token (`STOP`); the engine also stops on `<|eos|>`.

Special tokens enter the ids only where this template puts them: every
piece of message text is encoded as plain text (`Tokenizer.encode`), so a
user or a tool result that contains the string "<|tool_call|>" gets
ordinary byte tokens, never the special id. `encode_chat` and
`tokenizer.encode(render(...), allow_special=True)` give the same ids as
long as no message text spells a special token.

`encode_chat_with_mask` is the SFT view: mask 1 exactly on the tokens the
assistant wrote (its content, its tool calls and the `<|end|>` closing its
turn), 0 on the prompt, the role tokens, tool results and everything else.

`parse_tool_calls(text)` reads one generated assistant turn (decoded with
special tokens kept) into `ParsedTurn(content, tool_calls, errors)`.
Several calls per turn are allowed; a malformed block (bad JSON, no name,
arguments that are not an object, no closing marker) becomes one sentence
in `errors` that says what was wrong and how to write it, and is left out
of `tool_calls`. It never raises. Each call is a dict
`{"id", "name", "arguments_json"}` where `arguments_json` is the arguments
object exactly as the model wrote it (or `{}` when it wrote none), ready for
`codefleet.agent.policy.parse_tool_call(id, name, arguments_json)`.
Inside a rendered call, "<|" is written "<\\u007c" (the same JSON value), so
arguments that mention a special token cannot end the block early.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from codefleet.chat.tokenizer import Tokenizer

BOS = "<|bos|>"
EOS = "<|eos|>"
END = "<|end|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL = "<|tool|>"
TOOLS = "<|tools|>"
CALL_OPEN = "<|tool_call|>"
CALL_CLOSE = "<|/tool_call|>"

ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
STOP = [END, EOS]  # strings (and, via stop_ids, token ids) that end an assistant turn

# Prompt styles a policy is trained and served with: "full", the system prompt and tool schemas (what any
# model needs to use the agent harness); "bare", the conversation alone, for a policy trained on the harness
# from its demonstrations. A checkpoint records its style (checkpoint.usage); the server renders requests in it.
PROMPTS = ("full", "bare")


def check_prompt(prompt: str) -> str:
    """`prompt` if it is a prompt style, else a ValueError naming the styles."""
    if prompt not in PROMPTS:
        raise ValueError(f"prompt {prompt!r} is not a prompt style; use 'full' (system prompt and tool schemas) "
                         "or 'bare' (the task alone, for a policy trained on this harness)")
    return prompt


class Piece(NamedTuple):
    text: str
    special: bool  # one special token (text is its string)
    assistant: bool  # written by the assistant (loss mask 1)


class ParsedTurn(NamedTuple):
    content: str
    tool_calls: list[dict]  # {"id": str, "name": str, "arguments_json": str}
    errors: list[str]


# -- rendering ---------------------------------------------------------------------------


def _text(content: object) -> str:
    """Message content as text: a string, None, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _call_json(call: dict) -> str:
    """`{"name": ..., "arguments": ...}` for one OpenAI tool call, arguments as the model wrote them."""
    function = call.get("function", call)
    raw = function.get("arguments")
    if isinstance(raw, dict):
        raw = json.dumps(raw, ensure_ascii=False)
    if not isinstance(raw, str) or not raw.strip():
        raw = "{}"
    text = f'{{"name": {json.dumps(function.get("name", ""), ensure_ascii=False)}, "arguments": {raw}}}'
    # "<|" can only occur inside JSON strings, where "<\u007c" means the same: a call that edits text holding
    # "<|/tool_call|>" (codefleet's own codefleet_template.py, say) cannot end its block early.
    return text.replace("<|", "<\\u007c")


def _tools_text(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)


def pieces(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> list[Piece]:
    """The conversation as a flat list of text and special-token pieces (what render and encode share)."""
    out = [Piece(BOS, True, False)]
    tools_done = not tools

    def emit_tools() -> None:
        nonlocal tools_done
        out.extend([Piece(TOOLS, True, False), Piece(_tools_text(tools or []), False, False), Piece(END, True, False)])
        tools_done = True

    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLE_TOKENS:
            raise ValueError(f"message {i} has role {role!r}; the chat template knows "
                             f"{', '.join(ROLE_TOKENS)} (OpenAI chat messages)")
        if role != "system" and not tools_done:
            emit_tools()
        mine = role == "assistant"
        out.append(Piece(ROLE_TOKENS[role], True, False))
        out.append(Piece(_text(message.get("content")), False, mine))
        calls = (message.get("tool_calls") or []) if mine else []
        for call in calls:
            out += [Piece(CALL_OPEN, True, True), Piece(_call_json(call), False, True), Piece(CALL_CLOSE, True, True)]
        out.append(Piece(END, True, mine))
    if not tools_done:
        emit_tools()
    if add_generation_prompt:
        out.append(Piece(ASSISTANT, True, False))
    return [p for p in out if p.text]


def render(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """The conversation as template text (special tokens spelled out)."""
    return "".join(p.text for p in pieces(messages, tools, add_generation_prompt))


def encode_chat_with_mask(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None,
                          add_generation_prompt: bool = False) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and a loss mask: 1 on the assistant's own tokens, 0 elsewhere."""
    ids: list[int] = []
    mask: list[int] = []
    for piece in pieces(messages, tools, add_generation_prompt):
        piece_ids = [tokenizer.special_id(piece.text)] if piece.special else tokenizer.encode(piece.text)
        ids += piece_ids
        mask += [int(piece.assistant)] * len(piece_ids)
    return ids, mask


def encode_chat(tokenizer: Tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of the conversation; with the generation prompt, ready for the model to write a turn."""
    return encode_chat_with_mask(tokenizer, messages, tools, add_generation_prompt)[0]


def stop_ids(tokenizer: Tokenizer) -> list[int]:
    """The token ids that end an assistant turn."""
    return [tokenizer.special_id(s) for s in STOP]


# -- parsing -----------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")
_FORMAT = f'write {CALL_OPEN}{{"name": "read_file", "arguments": {{"path": "src/app.py"}}}}{CALL_CLOSE}'


def _member_spans(body: str) -> dict[str, tuple[int, int]]:
    """Where each top-level member's value lies in the JSON object `body` (already known to be valid)."""
    spans: dict[str, tuple[int, int]] = {}
    try:
        i = _WS.match(body, 0).end()
        if body[i] != "{":
            return {}
        i = _WS.match(body, i + 1).end()
        while body[i] != "}":
            key, i = _DECODER.raw_decode(body, i)
            i = _WS.match(body, i).end() + 1  # past ':'
            start = _WS.match(body, i).end()
            _, end = _DECODER.raw_decode(body, start)
            spans[key] = (start, end)
            i = _WS.match(body, end).end()
            if body[i] == ",":
                i = _WS.match(body, i + 1).end()
    except (ValueError, IndexError):
        return {}
    return spans


def _parse_call(body: str, number: int) -> tuple[str, str] | str:
    """(name, arguments_json) from one block's text, or the error sentence."""
    where = f"tool call {number}"
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return f"{where} is not valid JSON ({e.msg} at character {e.pos}); {_FORMAT}"
    if not isinstance(value, dict):
        return f"{where} must be a JSON object with \"name\" and \"arguments\", got {type(value).__name__}; {_FORMAT}"
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"{where} has no \"name\" (a non-empty string naming the tool); {_FORMAT}"
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # arguments written as a JSON string, as in the OpenAI wire format
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            decoded = None
        if not isinstance(decoded, dict):
            return f"{where} ({name}): \"arguments\" must be a JSON object; {_FORMAT}"
        return name, arguments if arguments.strip() else "{}"
    if not isinstance(arguments, dict):
        return f"{where} ({name}): \"arguments\" must be a JSON object, got {type(arguments).__name__}; {_FORMAT}"
    span = _member_spans(body).get("arguments")
    raw = body[span[0]:span[1]] if span else json.dumps(arguments, ensure_ascii=False)
    return name, raw


def parse_tool_calls(text: str, id_prefix: str = "call_") -> ParsedTurn:
    """One generated assistant turn -> (content, tool calls, errors). Never raises.

    Text after a stop marker (`<|end|>`, `<|eos|>`) is ignored. Calls get ids
    `<id_prefix><n>` in order (n counts well-formed calls); pass a unique
    prefix per turn where ids must be unique across a conversation."""
    return split_turn(text, CALL_OPEN, CALL_CLOSE, STOP, _FORMAT, _parse_call, id_prefix)


def split_turn(text: str, opening: str, closing: str, stops, example: str,
               parse_call: Callable[[str, int], tuple[str, str] | str], id_prefix: str) -> ParsedTurn:
    """A turn's text cut at the first of `stops`, split into its content and the call blocks between `opening`
    and `closing` markers; each block's body goes to `parse_call(body, number)` -> (name, arguments_json) or an
    error sentence. A stray or missing marker is one error naming `example`. Every tool-call format uses this
    (`tool_parser`); only the markers and the body's parser differ."""
    for stop in stops:
        text = text.split(stop, 1)[0]
    content: list[str] = []
    calls: list[dict] = []
    errors: list[str] = []
    number = pos = 0
    while True:
        start = text.find(opening, pos)
        outside = text[pos:] if start < 0 else text[pos:start]
        if closing in outside:
            errors.append(f"a {closing} without an opening {opening} was ignored; {example}")
            outside = outside.replace(closing, "")
        content.append(outside)
        if start < 0:
            break
        number += 1
        body_start = start + len(opening)
        end = text.find(closing, body_start)
        reopen = text.find(opening, body_start)
        if end < 0 or 0 <= reopen < end:
            errors.append(f"tool call {number} has no closing {closing} (the output may have hit its token "
                          f"limit); end every call with {closing}")
            if end < 0:
                break
            pos = reopen
            continue
        parsed = parse_call(text[body_start:end].strip(), number)
        if isinstance(parsed, str):
            errors.append(parsed)
        else:
            calls.append({"id": f"{id_prefix}{len(calls)}", "name": parsed[0], "arguments_json": parsed[1]})
        pos = end + len(closing)
    return ParsedTurn("".join(content).strip(), calls, errors)


def openai_tool_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls in the OpenAI message format (`message["tool_calls"]`)."""
    return [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments_json"]}}
            for c in calls]
