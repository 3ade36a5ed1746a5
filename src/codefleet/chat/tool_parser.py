"""Tool-call parsers: one generated assistant turn -> (content, tool calls, errors), by tool-call format.

    parser = PARSERS["hermes"]
    turn = parser.parse("Reading it.\\n<tool_call>\\n{\\"name\\": \\"read_file\\", ...}\\n</tool_call>", "call_0_")
    turn.content, turn.tool_calls, turn.errors          # codefleet_template.ParsedTurn

A format writes each call as a JSON object `{"name": ..., "arguments": {...}}` between an opening and a
closing marker; what differs is the markers:

- `"codefleet"`: codefleet's own chat template, `<|tool_call|>{...}<|/tool_call|>` (`chat.parse_tool_calls`).
- `"hermes"`: Hermes / Qwen checkpoints, `<tool_call>\\n{...}\\n</tool_call>`, several per turn.

Which one a checkpoint uses is read from its chat template (`formats.for_checkpoint`). Every parser
keeps `chat.parse_tool_calls`'s promises: it never raises, several calls per turn are allowed, and a
malformed call (no closing marker, JSON that does not parse, no name, arguments that are not an object)
becomes one sentence in `errors` that says what was wrong and how to write it, which the agent loop
returns to the model as the call's error observation. Text after a stop marker is ignored; calls get ids
`<id_prefix><n>`, n counting the well-formed calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from codefleet.chat import codefleet_template
from codefleet.chat.codefleet_template import ParsedTurn


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
        if self.name == "codefleet":  # codefleet's own parser, unchanged
            return codefleet_template.parse_tool_calls(text, id_prefix)
        return _parse(self, text, id_prefix)

    def with_stops(self, stops: tuple[str, ...]) -> ToolCallFormat:
        return ToolCallFormat(self.name, self.call_open, self.call_close, tuple(stops), self.text_guard,
                              self.string_guard)


PARSERS: dict[str, ToolCallFormat] = {
    # every codefleet marker starts with "<|"; its template writes "<\u007c" inside calls
    "codefleet": ToolCallFormat("codefleet", codefleet_template.CALL_OPEN, codefleet_template.CALL_CLOSE,
                                tuple(codefleet_template.STOP), ("<|",), ("<|",)),
    "hermes": ToolCallFormat("hermes", "<tool_call>", "</tool_call>", (), ("<tool_call>", "</tool_call>"),
                             ("</tool_call>",)),
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


def _parse_call(fmt: ToolCallFormat, body: str, number: int) -> tuple[str, str] | str:
    """(name, arguments_json) from one block's text, or the error sentence."""
    where, how = f"tool call {number}", fmt.example()
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return f"{where} is not valid JSON ({e.msg} at character {e.pos}); {how}"
    if not isinstance(value, dict):
        return f"{where} must be a JSON object with \"name\" and \"arguments\", got {type(value).__name__}; {how}"
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        return f"{where} has no \"name\" (a non-empty string naming the tool); {how}"
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # arguments written as a JSON string, as in the OpenAI wire format
        try:
            decoded = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            decoded = None
        if not isinstance(decoded, dict):
            return f"{where} ({name}): \"arguments\" must be a JSON object; {how}"
        return name, arguments if arguments.strip() else "{}"
    if not isinstance(arguments, dict):
        return f"{where} ({name}): \"arguments\" must be a JSON object, got {type(arguments).__name__}; {how}"
    return name, json.dumps(arguments, ensure_ascii=False)


def _parse(fmt: ToolCallFormat, text: str, id_prefix: str) -> ParsedTurn:
    return codefleet_template.split_turn(text, fmt.call_open, fmt.call_close, fmt.stops, fmt.example(),
                           lambda body, number: _parse_call(fmt, body, number), id_prefix)
