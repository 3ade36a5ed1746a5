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
except the added tokens a checkpoint marks as text (`<think>`). `tool_choice="required"` allows END only after a call, `"none"` allows no call (and
needs no tools). `calls_only` drops the text: the turn opens with a call at once and holds calls alone,

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
from dataclasses import dataclass, field

import torch

from codefleet.chat import formats
from codefleet.inference.sampling import TOOL_CHOICES

MAX_REJECTIONS = 4  # single resamples before the full mask
MASKS_KEPT = 4096  # full masks a grammar keeps, by matcher state
# Whitespace between a call's JSON tokens: at most this many bytes in a row. Unbounded, a model that wants a
# token the grammar refuses (an argument its tool does not take) writes spaces instead until its token limit.
MAX_WS_RUN = 2
_WS = frozenset(b" \t\n\r")
_DIGITS = frozenset(b"0123456789")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrt')

# schema nodes (tuples, shared by every matcher of a grammar)
ANY = ("any",)


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


class TurnMatcher:
    """Where one sequence stands in the turn grammar. `advance` moves it on by a sampled token;
    `allows` asks without moving (it works on a copy)."""

    __slots__ = ("grammar", "in_call", "stack", "calls", "tail", "done", "ws_run")

    def __init__(self, grammar: ToolCallGrammar):
        self.grammar = grammar
        self.in_call = False
        self.stack: list[list] = []  # frames of the call being written; empty and in_call: the call is complete
        self.calls = 0
        self.tail = b""  # the text's end that could begin a guarded string (ToolCallFormat.text_guard)
        self.done = False
        self.ws_run = 0  # whitespace bytes in a row between a call's JSON tokens

    def copy(self) -> TurnMatcher:
        other = TurnMatcher.__new__(TurnMatcher)
        other.grammar, other.in_call, other.calls = self.grammar, self.in_call, self.calls
        other.tail, other.done, other.ws_run = self.tail, self.done, self.ws_run
        other.stack = [list(frame) for frame in self.stack]
        return other

    def allows(self, token: int) -> bool:
        g = self.grammar
        if token in g.special:
            return self._special_ok(token)
        if self.done:
            return False
        data = g.token_bytes[token]
        if not self.in_call:  # text (the common case: no byte that may begin a guarded string; no copy)
            if g.calls_only:
                return False
            if not self.tail and g.guard_bytes.isdisjoint(data):
                return True
        return self.copy()._feed(data)

    def advance(self, token: int) -> None:
        """Move on by `token` (one the grammar allows; a refused one marks the turn done)."""
        g = self.grammar
        if token in g.special:
            if not self._special_ok(token):
                self.done = True
            elif token == g.call_open:
                self.in_call, self.stack = True, [["value", g.call]]
            elif token == g.call_close:
                self.in_call, self.calls = False, self.calls + 1
            else:
                self.done = True
            self.tail = b""
        elif self.done or not self._feed(g.token_bytes[token]):
            self.done = True

    def allowed_mask(self) -> torch.Tensor:
        """Bool [V]: the tokens `allows` would accept. Computed once per state (`_state`; a model that keeps
        wanting a refused token meets the same few states again), checking only tokens whose first byte can
        follow."""
        g = self.grammar
        key = self._state()
        mask = g.masks.get(key)
        if mask is None:
            mask = self._compute_mask()
            if len(g.masks) >= MASKS_KEPT:
                g.masks.clear()
            g.masks[key] = mask
        return mask

    def known_mask(self) -> torch.Tensor | None:
        """`allowed_mask` if this state's is already computed, else None."""
        return self.grammar.masks.get(self._state())

    def _state(self) -> tuple:
        """Everything the tokens allowed next depend on (schema nodes by identity: a grammar's are fixed)."""
        frames = tuple(tuple(id(x) if isinstance(x, tuple) else x for x in frame) for frame in self.stack)
        full = bool(self.grammar.max_calls) and self.calls >= self.grammar.max_calls
        return (self.in_call, self.tail, self.calls > 0, full, self.done, self.ws_run, frames)

    def _compute_mask(self) -> torch.Tensor:
        g = self.grammar
        allowed = [False] * g.vocab_size
        if not self.done:
            for token in g.special:
                allowed[token] = self._special_ok(token)
            for first, tokens in g.by_first_byte.items():
                head = self.copy()
                if not head._feed(bytes((first,))):
                    continue
                for token in tokens:
                    rest = g.token_bytes[token][1:]
                    allowed[token] = not rest or head.copy()._feed(rest)
        return torch.tensor(allowed, dtype=torch.bool)

    # -- the recognizer ------------------------------------------------------------------

    def _special_ok(self, token: int) -> bool:
        g = self.grammar
        if self.done:
            return False
        if token == g.call_open:
            return not self.in_call and g.tool_choice != "none" and not (g.max_calls and self.calls >= g.max_calls)
        if token == g.call_close:
            return self.in_call and not self.stack
        if token in g.stops:
            return not self.in_call and (self.calls > 0 or (g.tool_choice != "required" and not g.calls_only))
        return False  # role and other template tokens never belong in a turn

    def _feed(self, data: bytes) -> bool:
        for byte in data:
            if not self.in_call:
                if self.grammar.calls_only:
                    return False
                if self.tail or byte in self.grammar.guard_bytes:
                    tail = _guarded(self.tail, byte, self.grammar.text_guard)
                    if tail is None:  # the text would spell a marker
                        return False
                    self.tail = tail
            elif byte in _WS and (not self.stack or self.stack[-1][0] in ("value", "object", "array")):
                self.ws_run += 1  # between tokens (the frames take it; a complete call takes it before its marker)
                if self.ws_run > MAX_WS_RUN:
                    return False
            elif not self.stack:  # the call is complete: only whitespace before its closing marker
                return False
            else:
                self.ws_run = 0
                if not self._byte(byte):
                    return False
        return True

    def _byte(self, byte: int) -> bool:
        """Feed one byte of a call to the frame stack; False if the grammar refuses it."""
        stack = self.stack
        while stack:
            frame = stack[-1]
            kind = frame[0]
            if kind == "value":
                return self._start_value(frame, byte)
            if kind == "string":
                return self._string(frame, byte)
            if kind == "literal":
                rest = frame[1]
                if byte != rest[0]:
                    return False
                if len(rest) == 1:
                    self._finish(None)
                else:
                    frame[1] = rest[1:]
                return True
            if kind == "number":
                accepted = _number(frame, byte)
                if accepted is not None:
                    return accepted
                self._finish(None)  # a complete number ends at this byte, which its parent reads
                continue
            if kind == "object":
                return self._object(frame, byte)
            if kind == "array":
                return self._array(frame, byte)
            return False
        return False

    def _start_value(self, frame: list, byte: int) -> bool:
        if byte in _WS:
            return True
        node = frame[1]
        kind = node[0]
        if kind == "by_name":  # the arguments of the tool the call named
            node = node[1][frame[2]]
            kind = node[0]
        stack = self.stack
        if byte == 0x22 and kind in ("string", "any"):  # "
            stack[-1] = ["string", node[1] if kind == "string" else None, b"", 0, b"", False]
        elif (byte == 0x2D or byte in _DIGITS) and kind in ("integer", "number", "any"):
            stack[-1] = ["number", kind == "integer", 0]
            return _number(stack[-1], byte) is True
        elif byte == 0x7B and kind in ("object", "any"):  # {
            node = node if kind == "object" else ("object", {}, frozenset(), False, None)
            stack[-1] = ["object", node, frozenset(), "open", None, None]
        elif byte == 0x5B and kind in ("array", "any"):  # [
            stack[-1] = ["array", node[1] if kind == "array" else ANY, "open"]
        elif kind in ("boolean", "any") and byte in (0x74, 0x66):  # t, f
            stack[-1] = ["literal", b"rue" if byte == 0x74 else b"alse"]
        elif kind in ("null", "any") and byte == 0x6E:  # n
            stack[-1] = ["literal", b"ull"]
        else:
            return False
        return True

    def _string(self, frame: list, byte: int) -> bool:
        # frame: ["string", enum bytes or None, bytes so far (enum or key only), escape state, guard tail, is a key]
        escape = frame[3]
        if escape == 1:
            if byte == 0x75:  # \u
                frame[3] = 2
            elif byte in _ESCAPES:
                frame[3] = 0
            else:
                return False
            return True
        if escape >= 2:
            if byte not in _HEX:
                return False
            frame[3] = 0 if escape == 5 else escape + 1
            return True
        enum, keep = frame[1], frame[1] is not None or frame[5]
        if byte == 0x22:  # the closing quote
            if enum is not None and frame[2] not in enum:
                return False
            self._finish(frame[2] if keep else None)
            return True
        if byte < 0x20:  # raw control characters
            return False
        if frame[4] or byte in self.grammar.guard_bytes:
            tail = _guarded(frame[4], byte, self.grammar.string_guard)
            if tail is None:  # would spell a marker
                return False
            frame[4] = tail
        if byte == 0x5C:  # a backslash (a key keeps its escapes as written)
            if enum is not None:
                return False
            frame[3] = 1
            if keep:
                frame[2] += b"\\"
            return True
        if keep:
            so_far = frame[2] + bytes((byte,))
            if enum is not None and not any(e.startswith(so_far) for e in enum):
                return False
            frame[2] = so_far
        return True

    def _object(self, frame: list, byte: int) -> bool:
        # frame: ["object", node, keys seen, phase, current key, value of "name" (a call)]
        phase = frame[3]
        if byte in _WS and phase != "key":
            return True
        properties, required, seen = frame[1][1], frame[1][2], frame[2]
        if phase in ("open", "comma") and byte == 0x22:
            enum = _keys_left(frame[1], seen)
            if enum == ():
                return False
            frame[3] = "key"
            self.stack.append(["string", enum, b"", 0, b"", True])
            return True
        if byte == 0x7D and (phase == "next" or (phase == "open" and not seen)):  # }
            if not required <= seen:
                return False
            self._finish(None)
            return True
        if phase == "colon" and byte == 0x3A:  # :
            key = frame[4]
            node = properties.get(key, ANY)
            frame[3] = "value"
            value = ["value", node]
            if node[0] == "by_name":
                value.append(frame[5])
            self.stack.append(value)
            return True
        if phase == "next" and byte == 0x2C and _keys_left(frame[1], seen) != ():  # , (with a key left to write)
            frame[3] = "comma"
            return True
        return False

    def _array(self, frame: list, byte: int) -> bool:
        phase = frame[2]
        if byte in _WS:
            return True
        if byte == 0x5D and phase in ("open", "next"):  # ]
            self._finish(None)
            return True
        if phase == "next":
            if byte != 0x2C:
                return False
            frame[2] = "comma"
            return True
        frame[2] = "item"
        self.stack.append(["value", frame[1]])
        return self._byte(byte)

    def _finish(self, value: bytes | None) -> None:
        """Pop the finished frame and tell its parent (`value`: the bytes of a key or of an enum string)."""
        self.stack.pop()
        if not self.stack:
            return
        parent = self.stack[-1]
        if parent[0] == "object":
            if parent[3] == "key":
                key = (value or b"").decode("utf-8", errors="replace")
                parent[2] = parent[2] | {key}  # a new set: copies made by `allows` share the old one
                parent[4], parent[3] = key, "colon"
            else:
                if parent[4] == "name" and value is not None:
                    parent[5] = value.decode()
                parent[3] = "next"
        elif parent[0] == "array":
            parent[2] = "next"


def _guarded(tail: bytes, byte: int, guards: tuple[bytes, ...]) -> bytes | None:
    """Text ending in `tail` (a start of some guarded string) followed by `byte`: None if it now ends with a
    guarded string, else its longest end that still starts one."""
    text = tail + bytes((byte,))
    if any(text.endswith(g) for g in guards):
        return None
    for start in range(len(text)):
        if any(g.startswith(text[start:]) for g in guards):
            return text[start:]
    return b""


def _keys_left(node: tuple, seen: frozenset) -> tuple[bytes, ...] | None:
    """The keys an object may still write (in order, for the call: only the next one); None: any key."""
    _, properties, _, closed, order = node
    if not (closed or order):
        return None
    left = [k for k in (order or properties) if k not in seen]
    return tuple(k.encode() for k in (left[:1] if order else left))


def _number(frame: list, byte: int) -> bool | None:
    """Feed a byte to a number frame: True/False, or None when the number is complete and the byte is not its."""
    integer, phase = frame[1], frame[2]
    digit = byte in _DIGITS
    if phase == 0:  # start
        if byte == 0x2D:
            frame[2] = 1
        elif byte == 0x30:
            frame[2] = 2
        elif digit:
            frame[2] = 3
        else:
            return False
        return True
    if phase == 1:  # after "-"
        if not digit:
            return False
        frame[2] = 2 if byte == 0x30 else 3
        return True
    if phase in (2, 3):  # "0" / integer digits
        if digit and phase == 3:
            return True
        if not integer and byte == 0x2E:
            frame[2] = 4
            return True
        if not integer and byte in (0x65, 0x45):
            frame[2] = 6
            return True
        return False if digit else None
    if phase == 4:  # after "."
        if not digit:
            return False
        frame[2] = 5
        return True
    if phase == 5:  # fraction digits
        if digit:
            return True
        if byte in (0x65, 0x45):
            frame[2] = 6
            return True
        return None
    if phase == 6:  # after "e"
        if byte in (0x2B, 0x2D):
            frame[2] = 7
            return True
        if digit:
            frame[2] = 8
            return True
        return False
    if phase == 7:  # after the exponent's sign
        if not digit:
            return False
        frame[2] = 8
        return True
    return True if digit else None  # exponent digits


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
    def build(cls, tokenizer, tools: list[dict], tool_choice: str = "auto", calls_only: bool = False,
              max_calls: int = 0, fmt=None) -> ToolCallGrammar:
        """The grammar over `tokenizer`'s chat format (`fmt`, default `formats.of(tokenizer)`)."""
        if tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be one of {', '.join(TOOL_CHOICES)}, got {tool_choice!r}")
        if calls_only and tool_choice == "none":
            raise ValueError("calls_only asks for tool calls, which tool_choice \"none\" forbids; use one or the other")
        fmt = fmt or formats.of(tokenizer)
        calls = fmt.tool_calls
        markers = []
        for marker in (calls.call_open, calls.call_close):
            if marker not in tokenizer.special:
                raise ValueError(f"constrained tool calls need the call marker {marker!r} to be one token of the "
                                 "checkpoint's tokenizer; it is not, so serve and run it without a tool grammar")
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
        return cls(call, tool_choice, token_bytes, special, markers[0], markers[1], stops, by_first, vocab,
                   calls_only, max_calls, tuple(g.encode() for g in calls.text_guard),
                   tuple(g.encode() for g in calls.string_guard), frozenset(g.encode()[0] for g in guards))

    def start(self) -> TurnMatcher:
        return TurnMatcher(self)


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
