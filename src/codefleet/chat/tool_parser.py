"""The tool-call parser: one generated assistant turn -> (content, tool calls, errors), for every tool-call format.

    parser = PARSERS["hermes"]
    turn = parser.parse("Reading it.\\n<tool_call>\\n{\\"name\\": \\"read_file\\", ...}\\n</tool_call>", "call_0_")
    turn.content, turn.tool_calls, turn.errors          # ParsedTurn
    openai_tool_calls(turn.tool_calls)                  # message["tool_calls"] in the OpenAI format

A format writes each call as a JSON object `{"name": ..., "arguments": {...}}` between an opening and a
closing marker; what differs is the markers:

- `"codefleet"`: codefleet's own chat template, `<|tool_call|>{...}<|/tool_call|>` (codefleet_template.py).
  Inside a rendered call, "<|" is written "<\\u007c" (the same JSON value), so arguments that mention a
  special token cannot end the block early.
- `"hermes"`: Hermes / Qwen checkpoints, `<tool_call>\\n{...}\\n</tool_call>`, several per turn.

Which one a checkpoint uses is read from its chat template (`formats.for_checkpoint`); the engine's
tool-call grammar (`codefleet.inference.grammar`) constrains sampling between the same markers, with the
guards a `ToolCallFormat` declares. Every format is parsed by the same code, with these promises: it
never raises, several calls per turn are allowed, and a malformed call (no closing marker, JSON that does
not parse, no name, arguments that are not an object) becomes one sentence in `errors` that says what was
wrong and how to write it, which the agent loop returns to the model as the call's error observation.
Text after a stop marker is ignored; calls get ids `<id_prefix><n>`, n counting the well-formed calls
(pass a unique prefix per turn where ids must be unique across a conversation).

Each call is a dict `{"id", "name", "arguments_json"}` where `arguments_json` is the arguments object
exactly as the model wrote it (`"arguments"`, or `"parameters"` as some models write it; `{}` when it
wrote none), ready for `codefleet.agent.policy.parse_tool_call(id, name, arguments_json)`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import NamedTuple

from codefleet.chat import codefleet_template


class ParsedTurn(NamedTuple):
    content: str
    tool_calls: list[dict]  # {"id": str, "name": str, "arguments_json": str}
    errors: list[str]


@dataclass(frozen=True)
class ToolCallFormat:
    """How one format writes a call: its markers (the grammar constrains between them too) and its stops."""

    name: str
    call_open: str
    call_close: str
    stops: tuple[str, ...] = ()
    text_guard: tuple[str, ...] = ()  # strings the turn's text may not spell (the parser would read a marker)
    string_guard: tuple[str, ...] = ()  # strings a JSON string inside a call may not spell

    def example(self) -> str:
        return f'write {self.call_open}{{"name": "read_file", "arguments": {{"path": "src/app.py"}}}}{self.call_close}'

    def parse(self, text: str, id_prefix: str = "call_") -> ParsedTurn:
        """One generated assistant turn -> (content, tool calls, errors) (module docstring). Never raises."""
        return _split_turn(self, text, id_prefix)

    def with_stops(self, stops: tuple[str, ...]) -> ToolCallFormat:
        return ToolCallFormat(
            self.name, self.call_open, self.call_close, tuple(stops), self.text_guard, self.string_guard
        )


PARSERS: dict[str, ToolCallFormat] = {
    # every codefleet marker starts with "<|"; its template writes "<\u007c" inside calls
    "codefleet": ToolCallFormat(
        "codefleet",
        codefleet_template.CALL_OPEN,
        codefleet_template.CALL_CLOSE,
        tuple(codefleet_template.STOP),
        ("<|",),
        ("<|",),
    ),
    "hermes": ToolCallFormat(
        "hermes", "<tool_call>", "</tool_call>", (), ("<tool_call>", "</tool_call>"), ("</tool_call>",)
    ),
}


def choose(template: str, name: str | None = None) -> ToolCallFormat:
    """The parser `name` (a key of PARSERS), or the one whose markers the chat template `template` writes
    (codefleet's first: its markers hold Hermes's); Hermes when it names none."""
    if name:
        if name not in PARSERS:
            raise ValueError(f"no tool-call parser {name!r}; choose one of {', '.join(PARSERS)}")
        return PARSERS[name]
    for parser in PARSERS.values():
        if parser.call_open in template:
            return parser
    return PARSERS["hermes"]


def openai_tool_calls(calls: list[dict]) -> list[dict]:
    """Parsed calls in the OpenAI message format (`message["tool_calls"]`)."""
    return [
        {"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments_json"]}}
        for c in calls
    ]


# -- parsing ---------------------------------------------------------------------------------

_DECODER = json.JSONDecoder()
_WS = re.compile(r"[ \t\n\r]*")


def _split_turn(fmt: ToolCallFormat, text: str, id_prefix: str) -> ParsedTurn:
    """The turn's text cut at the first of the format's stops, split into its content and the call blocks
    between its markers; a stray or missing marker is one error naming the format's example."""
    opening, closing = fmt.call_open, fmt.call_close
    for stop in fmt.stops:
        text = text.split(stop, 1)[0]
    content: list[str] = []
    calls: list[dict] = []
    errors: list[str] = []
    number = pos = 0
    while True:
        start = text.find(opening, pos)
        outside = text[pos:] if start < 0 else text[pos:start]
        if closing in outside:
            errors.append(f"a {closing} without an opening {opening} was ignored; {fmt.example()}")
            outside = outside.replace(closing, "")
        content.append(outside)
        if start < 0:
            break
        number += 1
        body_start = start + len(opening)
        end = text.find(closing, body_start)
        reopen = text.find(opening, body_start)
        if end < 0 or 0 <= reopen < end:
            errors.append(
                f"tool call {number} has no closing {closing} (the output may have hit its token "
                f"limit); end every call with {closing}"
            )
            if end < 0:
                break
            pos = reopen
            continue
        parsed = _parse_call(text[body_start:end].strip(), number, fmt.example())
        if isinstance(parsed, str):
            errors.append(parsed)
        else:
            calls.append({"id": f"{id_prefix}{len(calls)}", "name": parsed[0], "arguments_json": parsed[1]})
        pos = end + len(closing)
    return ParsedTurn("".join(content).strip(), calls, errors)


def _parse_call(body: str, number: int, how: str) -> tuple[str, str] | str:
    """(name, arguments_json) from one block's text, or the error sentence (ending in the example `how`)."""
    where = f"tool call {number}"
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return f"{where} is not valid JSON ({e.msg} at character {e.pos}); {how}"
    if not isinstance(value, dict):
        return f'{where} must be a JSON object with "name" and "arguments", got {type(value).__name__}; {how}'
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'{where} has no "name" (a non-empty string naming the tool); {how}'
    key = "arguments" if "arguments" in value or "parameters" not in value else "parameters"
    arguments = value.get(key, {})
    if isinstance(arguments, str):  # arguments written as a JSON string, as in the OpenAI wire format
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            decoded = None
        if not isinstance(decoded, dict):
            return f'{where} ({name}): "arguments" must be a JSON object; {how}'
        return name, arguments if arguments.strip() else "{}"
    if not isinstance(arguments, dict):
        return f'{where} ({name}): "arguments" must be a JSON object, got {type(arguments).__name__}; {how}'
    span = _member_spans(body).get(key)
    return name, body[span[0] : span[1]] if span else json.dumps(arguments, ensure_ascii=False)


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
