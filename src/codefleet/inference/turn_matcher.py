"""The recognizer of the tool-call grammar (grammar.py): where one sequence stands in its turn.

`TurnMatcher` follows one sequence's sampled bytes with a small pushdown recognizer (a stack of frames:
values, strings, numbers, literals, objects, arrays) over the schema nodes `grammar.call_node` builds.
`allows(token)` asks without moving; `advance(token)` moves on; `allowed_mask()` gives every token the
grammar accepts next, computed once per state and kept on the grammar (`MASKS_KEPT`).
"""

from __future__ import annotations

import torch

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


class TurnMatcher:
    """Where one sequence stands in the turn grammar. `advance` moves it on by a sampled token;
    `allows` asks without moving (it works on a copy)."""

    __slots__ = ("grammar", "in_call", "stack", "calls", "tail", "done", "ws_run")

    def __init__(self, grammar):
        """`grammar`: the ToolCallGrammar (grammar.py) of the request, compiled against its tokenizer."""
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
