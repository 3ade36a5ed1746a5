"""Constrained decoding of tool calls: the engine samples only turns whose tool calls parse and fit
their tools' schemas (OpenAI's strict function calling; vLLM and SGLang call it structured output).

A small policy trained for minutes writes many calls wrong: a closing marker without its opening
one, a call left unclosed, JSON that does not parse, arguments its tool does not take (measured in
docs/experiments/). Each costs a turn. With a grammar the engine never samples a token that would
break the call being written.

The grammar of one assistant turn, over the tokens of the checkpoint's chat format
(`formats.of(tokenizer)`: codefleet's `<|tool_call|>...<|/tool_call|>`, or a Hugging Face
checkpoint's, e.g. Hermes's `<tool_call>...</tool_call>`; its call markers must be single tokens):

    turn := text (CALL_OPEN ws call ws CALL_CLOSE text)* STOP
    call := {"name": NAME, "arguments": ARGS(NAME)}        ("name" first: the arguments depend on it)

NAME is one of the request's tools; ARGS(NAME) is a JSON object that follows the tool's
`parameters` schema: only its properties when `additionalProperties` is false, each at most once,
every required one before the `}`, values of their declared `type` (string, with `enum` if given;
integer; number; boolean; object; array) and any JSON value where the schema says nothing. Text
never spells a marker in bytes the parser would read as one (`ToolCallFormat.text_guard`: "<|" for
codefleet, whose template writes "<\\u007c" inside calls; the call markers for Hermes), nor does a
string inside a call (`string_guard`). Special tokens other than the markers and stops are refused,
except the added tokens a checkpoint marks as text (`<think>`). `tool_choice="required"` allows END
only after a call, `"none"` allows no call (and needs no tools). `calls_only` drops the text: the
turn opens with a call at once and holds calls alone,

    turn := (CALL_OPEN ws call ws CALL_CLOSE)+ STOP        (at most `max_calls` calls, 0: any)

which is how the server keeps OpenAI's promise for `tool_choice="required"` (one call or more) and
a named function (`max_calls=1`, one call of the one tool offered) with any model, a random one
included; the agent harness's "required" keeps the text, where its policy thinks before it calls.
A call ends in bounded tokens only if its schema bounds it (a closed object, enums, booleans);
a free string or number may still run to the token limit.

How. `TurnMatcher` follows one sequence's sampled bytes with a small pushdown recognizer (a stack
of frames). After the model samples a token, the engine asks `allows(token)`; a token the grammar
refuses is masked and the row sampled again, which draws from the model's distribution restricted
to the tokens not refused (temperature and top-k/top-p apply to what remains). After
`MAX_REJECTIONS` refusals the engine masks every refused token at once (`allowed_mask`: a token is
checked only if its first byte can follow). The logprob the engine records stays the model's own,
unconstrained, which is what the trainer computes for the same token.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field

import torch

from codefleet.chat import formats
from codefleet.inference.sampling import TOOL_CHOICES
from codefleet.inference.turn_matcher import ANY, TurnMatcher

MAX_REJECTIONS = 4  # single resamples before the full mask


def _node(schema: object) -> tuple:
    """A JSON schema (the subset function parameters use) as a matcher node."""
    if not isinstance(schema, dict):
        return ANY
    kind = schema.get("type")
    if isinstance(kind, list):  # ["string", "null"] and the like: not narrowed
        return ANY
    if kind == "string":
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(e, str) and _plain(e) for e in enum):
            return ("string", tuple(e.encode() for e in enum))
        return ("string", None)
    if kind in ("integer", "number", "boolean", "null"):
        return (kind,)
    if kind == "array":
        return ("array", _node(schema.get("items")))
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        required = frozenset(k for k in schema.get("required") or [] if k in properties)
        closed = schema.get("additionalProperties") is False
        return ("object", {k: _node(v) for k, v in properties.items()}, required, closed, None)
    return ANY


def _plain(text: str) -> bool:
    """A string JSON writes without escapes (so an enum can be matched byte by byte)."""
    return json.dumps(text, ensure_ascii=False)[1:-1] == text and "<|" not in text


def call_node(tools: list[dict]) -> tuple:
    """The node of one call, `{"name": NAME, "arguments": ARGS(NAME)}`, for OpenAI tool schemas."""
    by_name: dict[str, tuple] = {}
    for tool in tools:
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        name = function.get("name")
        if not isinstance(name, str) or not name or not _plain(name):
            raise ValueError(f"a tool needs a name of plain characters (no quotes or backslashes), got {name!r}")
        node = _node(function.get("parameters") or {"type": "object"})
        by_name[name] = node if node[0] == "object" else ("object", {}, frozenset(), False, None)
    if not by_name:
        raise ValueError("constrained tool calls need at least one tool")
    properties = {"name": ("string", tuple(n.encode() for n in by_name)), "arguments": ("by_name", by_name)}
    return ("object", properties, frozenset(properties), True, ("name", "arguments"))


@dataclass(frozen=True)
class ToolCallGrammar:
    """The turn grammar for one request's tools and tool choice, compiled against a tokenizer."""

    call: tuple | None  # None with tool_choice "none": no call to write
    tool_choice: str
    token_bytes: list[bytes]
    special: frozenset[int]
    call_open: int
    call_close: int
    stops: frozenset[int]
    by_first_byte: dict[int, list[int]]
    vocab_size: int
    calls_only: bool = False  # the turn is tool calls alone, opening with one (module docstring)
    max_calls: int = 0  # most calls in the turn; 0: no limit
    text_guard: tuple[bytes, ...] = (b"<|",)  # text never spells these (ToolCallFormat.text_guard)
    string_guard: tuple[bytes, ...] = (b"<|",)  # nor does a string inside a call
    guard_bytes: frozenset[int] = frozenset(b"<")  # the first bytes of the guarded strings
    masks: dict = field(default_factory=dict, compare=False)  # allowed_mask by state (TurnMatcher._state)

    @classmethod
    def build(
        cls,
        tokenizer,
        tools: list[dict],
        tool_choice: str = "auto",
        calls_only: bool = False,
        max_calls: int = 0,
        fmt=None,
    ) -> ToolCallGrammar:
        """The grammar over `tokenizer`'s chat format (`fmt`, default `formats.of(tokenizer)`)."""
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {tool_choice!r}")
        if calls_only and tool_choice == "none":
            raise ValueError('calls_only asks for tool calls, which tool_choice "none" forbids; use one or the other')
        fmt = fmt or formats.of(tokenizer)
        calls = fmt.tool_calls
        markers = []
        for marker in (calls.call_open, calls.call_close):
            if marker not in tokenizer.special:
                raise ValueError(
                    f"constrained tool calls need the call marker {marker!r} to be one token of the "
                    "checkpoint's tokenizer; it is not, so serve and run it without a tool grammar"
                )
            markers.append(tokenizer.special_id(marker))
        vocab = len(tokenizer)
        token_bytes = [tokenizer.token_bytes(i) for i in range(vocab)]
        text_tokens = getattr(tokenizer, "text_tokens", set()) - {calls.call_open, calls.call_close}
        # template tokens, and ids that stand for no text, never belong in a turn's text
        special = frozenset(i for t, i in tokenizer.special.items() if t not in text_tokens)
        special |= frozenset(i for i, data in enumerate(token_bytes) if not data)
        by_first: dict[int, list[int]] = {}
        for token, data in enumerate(token_bytes):
            if token not in special and data:
                by_first.setdefault(data[0], []).append(token)
        stops = frozenset(fmt.stop_ids(tokenizer))
        call = None if tool_choice == "none" else call_node(tools)
        guards = (*calls.text_guard, *calls.string_guard)
        return cls(
            call,
            tool_choice,
            token_bytes,
            special,
            markers[0],
            markers[1],
            stops,
            by_first,
            vocab,
            calls_only,
            max_calls,
            tuple(g.encode() for g in calls.text_guard),
            tuple(g.encode() for g in calls.string_guard),
            frozenset(g.encode()[0] for g in guards),
        )

    def start(self) -> TurnMatcher:
        return TurnMatcher(self)


class GrammarCache:
    """The grammars an engine compiled, by request (tools, tool choice, calls_only, max_calls), the `kept` most
    recently used; thread-safe."""

    def __init__(self, kept: int = 16):
        self.kept = kept
        self._grammars: dict[str, ToolCallGrammar] = {}  # most recent last
        self._lock = threading.Lock()

    def get(self, tokenizer, params) -> ToolCallGrammar:
        """The grammar for `params` (SamplingParams with tools or tool_choice "none") over `tokenizer`."""
        if tokenizer is None:
            raise ValueError(
                "constrained tool calls (SamplingParams.tools) need the engine's tokenizer; "
                "create the Engine with tokenizer="
            )
        key = json.dumps(
            [params.tools, params.tool_choice, params.calls_only, params.max_calls], sort_keys=True, default=str
        )
        with self._lock:
            grammar = self._grammars.pop(key, None)
        if grammar is None:
            grammar = ToolCallGrammar.build(
                tokenizer, params.tools or [], params.tool_choice, params.calls_only, params.max_calls
            )
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > self.kept:
                self._grammars.pop(next(iter(self._grammars)))
        return grammar


def constrained_sample(matcher: TurnMatcher, logits_V: torch.Tensor, token: int, resample) -> tuple[int, int]:
    """The token to keep for a row whose model sampled `token`: it, or a resample the grammar allows.
    `resample(logits_V)` draws one token from (masked) logits with the row's sampling parameters.
    Returns (token, refusals); a grammar with no token left (it cannot happen with a byte-level
    vocabulary) keeps the model's token, and the parser reports what is wrong with the call."""
    if matcher.allows(token):
        return token, 0
    logits_V = logits_V.clone()
    logits_V[token] = float("-inf")
    refused = 1
    mask = matcher.known_mask()  # a state met before: mask at once
    while mask is None and refused < MAX_REJECTIONS:
        candidate = resample(logits_V)
        if matcher.allows(candidate):
            return candidate, refused
        logits_V[candidate] = float("-inf")
        refused += 1
    mask = (mask if mask is not None else matcher.allowed_mask()).to(logits_V.device)
    if not mask.any():
        return token, refused
    logits_V[~mask] = float("-inf")
    if torch.isinf(logits_V).all():  # the model gives every allowed token zero probability
        logits_V[mask] = 0.0
    return resample(logits_V), refused
