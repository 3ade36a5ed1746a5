"""Chat formats: how a checkpoint turns OpenAI messages and tools into token ids, and its turns back into
tool calls. Codefleet's own models use codefleet's template (`codefleet_template.py`); a Hugging Face checkpoint uses
its own tokenizer and chat template.

    tokenizer, fmt = for_checkpoint("runs/ckpt")          # or a Hugging Face directory (Qwen3, Llama, ...)
    ids = fmt.encode_chat(tokenizer, messages, tools)     # the prompt, ready for the engine
    ids, mask = fmt.encode_chat_with_mask(tokenizer, messages, tools)   # SFT: 1 on the assistant's tokens
    turn = fmt.parse_tool_calls(result.text, "call_0_")   # tool_parser.ParsedTurn(content, tool_calls, errors)
    fmt = of(tokenizer)                                   # the format a loaded tokenizer belongs to

How the format is chosen (`for_checkpoint`): a directory with a `tokenizer_config.json` or a
`chat_template.jinja` is a Hugging Face checkpoint. Its tokenizer is its own `tokenizer.json`
(`tokenizer.HFTokenizer`), its template the `"chat_template"` of tokenizer_config.json (a string, or a list
of named templates: `"tool_use"` when the request has tools, else `"default"`, as transformers picks) or
chat_template.jinja, its stop tokens the token that ends an assistant turn in that template, then
generation_config.json's `eos_token_id` and tokenizer_config.json's `eos_token`. Its tool-call parser
(`tool_parser.PARSERS`: "codefleet", "hermes") is the one whose call marker the template writes,
unless the caller names one. A directory without those files is codefleet's: its `tokenizer.json`, or
the default tokenizer, and codefleet's template. `of(tokenizer)` gives the format of a tokenizer
loaded so, so code that is handed a tokenizer needs nothing else.

`TemplateFormat` renders the template exactly as transformers' `apply_chat_template(messages,
tools=tools, tokenize=False)` does (the same sandboxed Jinja environment: trim_blocks, lstrip_blocks,
loop controls, `tojson` without HTML escapes, `raise_exception`, `strftime_now`, the tokenizer's
`bos_token`/`eos_token`..., messages without None fields). Encoding keeps codefleet's rule that only
the template writes special tokens: every string of the messages and tools is marked before rendering,
and an added token spelled inside one (`<|im_end|>` in a tool result, say) is encoded as plain text.

Token-in, token-out (`continuation`): the ids of turn k+1's prompt are the ids of the episode so far
(turn k's sampled ids end with the turn's end token) followed by the encoding of what the template
renders after that end token: the rest of the assistant's turn closing (e.g. a newline), the tool
results as the template wraps them, and the next generation prompt. Where the template renders every
earlier turn the same in a longer conversation, the episode's ids equal the template's full encoding
of the conversation. Where it does not, they differ, and the trainer trains on the ids the engine saw:
a template that drops the `<think>` reasoning of assistant turns before the last user message (Qwen3's,
and the tiny checkpoints' of `bench.tiny_hf`) renders those turns without it once a new user message
follows, while the episode keeps the reasoning the model wrote and conditioned on. Tool results
(role "tool") do not start a new user query, so an agent episode of one task round-trips.

`encode_chat_with_mask` (SFT) marks with 1 the tokens of each assistant turn as the full render shows
it: what follows the template's generation prompt, through the token that ends the turn; the template's
text after that token (a newline) is 0, since the model never samples it.
"""

from __future__ import annotations

import functools
import json
import os
import re
from datetime import datetime
from typing import Protocol

from codefleet.chat import codefleet_template
from codefleet.chat.tokenizer import (
    HF_CHAT_TEMPLATE,
    HF_CHAT_TEMPLATE_JSON,
    HF_GENERATION_CONFIG,
    HF_TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    HFTokenizer,
    Tokenizer,
    default_tokenizer,
    is_hf_dir,
)
from codefleet.chat.tool_parser import PARSERS, ParsedTurn, ToolCallFormat, choose

ROLES = ("system", "user", "assistant", "tool")


class ChatFormat(Protocol):
    """What every consumer of a checkpoint's chat format uses (module docstring)."""

    name: str
    tool_calls: ToolCallFormat  # the call markers and parser (the tool grammar constrains between the markers)
    roles: tuple[str, ...]

    def render(
        self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> str: ...

    def encode_chat(
        self, tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
    ) -> list[int]: ...

    def encode_chat_with_mask(
        self, tokenizer, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False
    ) -> tuple[list[int], list[int]]: ...

    def continuation(self, tokenizer, messages: list[dict], n_done: int, tools: list[dict] | None) -> list[int]:
        """The ids that follow an episode whose ids cover `messages[:n_done]` (ending with an assistant turn's
        end token) to make the prompt for `messages`: the new messages and the generation prompt."""

    def least_tokens(self, tokenizer, messages: list[dict], tools: list[dict] | None = None) -> int:
        """A lower bound on len(encode_chat(...)), cheaper than encoding."""

    def stop_ids(self, tokenizer) -> list[int]:
        """The ids that end an assistant turn; the first is the one the template closes a turn with."""

    def parse_tool_calls(self, text: str, id_prefix: str = "call_") -> ParsedTurn: ...


# -- codefleet's own format ---------------------------------------------------------------


class CodefleetFormat:
    """codefleet's chat template and tool-call format (`codefleet_template.py`), unchanged."""

    name = "codefleet"
    tool_calls = PARSERS["codefleet"]
    roles = tuple(codefleet_template.ROLE_TOKENS)

    def render(self, messages, tools=None, add_generation_prompt=True) -> str:
        return codefleet_template.render(messages, tools, add_generation_prompt)

    def pieces(self, messages, tools=None, add_generation_prompt=True) -> list[codefleet_template.Piece]:
        return codefleet_template.pieces(messages, tools, add_generation_prompt)

    def encode_chat(self, tokenizer, messages, tools=None, add_generation_prompt=True) -> list[int]:
        return codefleet_template.encode_chat(tokenizer, messages, tools, add_generation_prompt)

    def encode_chat_with_mask(self, tokenizer, messages, tools=None, add_generation_prompt=False):
        return codefleet_template.encode_chat_with_mask(tokenizer, messages, tools, add_generation_prompt)

    def continuation(self, tokenizer, messages, n_done, tools) -> list[int]:
        done = len(codefleet_template.pieces(messages[:n_done], tools, add_generation_prompt=False))
        new: list[int] = []
        for piece in codefleet_template.pieces(messages, tools, add_generation_prompt=True)[done:]:
            new += [tokenizer.special_id(piece.text)] if piece.special else tokenizer.encode(piece.text)
        return new

    def least_tokens(self, tokenizer, messages, tools=None) -> int:
        longest = tokenizer.max_token_bytes
        return sum(1 if p.special else -(-len(p.text) // longest) for p in codefleet_template.pieces(messages, tools))

    def stop_ids(self, tokenizer) -> list[int]:
        return codefleet_template.stop_ids(tokenizer)

    def parse_tool_calls(self, text: str, id_prefix: str = "call_") -> ParsedTurn:
        return self.tool_calls.parse(text, id_prefix)


CODEFLEET = CodefleetFormat()


# -- a checkpoint's own Jinja chat template -----------------------------------------------

# Private-use characters around a special token spelled inside message text (encoded as plain text)
_MARK_OPEN, _MARK_CLOSE = "\U000f0000", "\U000f0001"
# a marked token, or a lone marker (the template cut a marked string): dropped, but it still splits the text
_MARKED = re.compile(f"{_MARK_OPEN}([^{_MARK_OPEN}{_MARK_CLOSE}]*){_MARK_CLOSE}|[{_MARK_OPEN}{_MARK_CLOSE}]")


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    """The template compiled in transformers' chat-template environment (utils/chat_template_utils.py)."""
    import jinja2  # a dependency of codefleet's Hugging Face support only
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # `{% generation %}...{% endgeneration %}` renders its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):  # no dunder attributes (CPython internals)
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for key in attrs:
                Namespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            Namespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot set {key!r} on a namespace")

    class Dict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception,
        strftime_now=lambda f: datetime.now().strftime(f),
        dict=Dict(),
        namespace=Namespace,
    )
    return env.from_string(template)


def _messages(messages: list[dict]) -> list[dict]:
    """The messages as transformers hands them to a template: no None fields, the reasoning under its names."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in ("reasoning_content", "thinking", "reasoning") if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _mark(value, pattern: re.Pattern):
    """`value` (messages, tools) with every special token spelled in its strings wrapped in markers."""
    if isinstance(value, str):
        value = value.replace(_MARK_OPEN, "").replace(_MARK_CLOSE, "")
        return pattern.sub(lambda m: f"{_MARK_OPEN}{m.group()}{_MARK_CLOSE}", value)
    if isinstance(value, dict):
        return {k: _mark(v, pattern) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_mark(v, pattern) for v in value]
    return value


def _blank(text: str) -> str:
    """`text` with marked spans blanked (same length): what is left is what the template wrote."""
    return _MARKED.sub(lambda m: "\0" * len(m.group()), text)


def _token_value(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class TemplateFormat:
    """A Hugging Face checkpoint's chat template and tool-call format (module docstring). Build it with
    `from_tokenizer`; it keeps text only, so it pickles with its tokenizer."""

    name = "template"
    roles = ROLES

    def __init__(
        self,
        templates: dict[str, str],
        template_kwargs: dict,
        stops: list[str],
        specials: list[str],
        tool_calls: ToolCallFormat,
        source: str,
    ):
        self.templates, self.template_kwargs, self.source = templates, template_kwargs, source
        self.stops = stops  # the turn's end token first
        self.tool_calls = tool_calls.with_stops(tuple(stops))
        longest_first = sorted(specials, key=len, reverse=True)
        self._specials = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")

    @classmethod
    def from_tokenizer(cls, tokenizer: HFTokenizer, tool_parser: str | None = None) -> TemplateFormat:
        config = tokenizer.config(HF_TOKENIZER_CONFIG)
        where = os.path.dirname(tokenizer.source) or "."
        raw = config.get("chat_template")
        if raw is None and HF_CHAT_TEMPLATE in tokenizer.files:
            raw = tokenizer.files[HF_CHAT_TEMPLATE]
        if raw is None and HF_CHAT_TEMPLATE_JSON in tokenizer.files:
            raw = tokenizer.config(HF_CHAT_TEMPLATE_JSON).get("chat_template")
        if isinstance(raw, list):  # named templates
            raw = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        if isinstance(raw, str):
            raw = {"default": raw}
        if not raw or not all(isinstance(t, str) for t in raw.values()):
            raise ValueError(
                f'{os.path.join(where, HF_TOKENIZER_CONFIG)} has no "chat_template" and there is no '
                f"{HF_CHAT_TEMPLATE} beside it: add the model's chat template (a Jinja string under "
                f'"chat_template", or a {HF_CHAT_TEMPLATE} file) to the checkpoint directory'
            )
        names = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
        kwargs = {n: _token_value(config.get(n)) for n in names if _token_value(config.get(n)) is not None}
        extra = config.get("additional_special_tokens")
        if isinstance(extra, list):
            kwargs["additional_special_tokens"] = [t for t in map(_token_value, extra) if t]
        candidates = []  # the stop tokens the checkpoint names
        eos_ids = tokenizer.config(HF_GENERATION_CONFIG).get("eos_token_id")
        for token_id in eos_ids if isinstance(eos_ids, list) else [eos_ids]:
            if isinstance(token_id, int) and 0 <= token_id < tokenizer.vocab_size:
                candidates.append(tokenizer.token_bytes(token_id).decode("utf-8", errors="replace"))
        if "eos_token" in kwargs:
            candidates.append(kwargs["eos_token"])
        candidates = [c for c in dict.fromkeys(candidates) if c in tokenizer.special]
        fmt = cls(raw, kwargs, candidates, list(tokenizer.special), choose("\n".join(raw.values()), tool_parser), where)
        end = fmt._turn_end(candidates)
        fmt.stops = [end] + [c for c in candidates if c != end]
        fmt.tool_calls = fmt.tool_calls.with_stops(tuple(fmt.stops))
        return fmt

    def _turn_end(self, candidates: list[str]) -> str:
        """The stop token that closes an assistant turn in this template (found by rendering one)."""
        said = "\U000f0002"
        text = self.render(
            [{"role": "user", "content": "?"}, {"role": "assistant", "content": said}], add_generation_prompt=False
        )
        after = text[text.find(said) + 1 :] if said in text else ""
        found = [(after.find(c), c) for c in candidates if c in after]
        if not found:
            raise ValueError(
                f"the chat template in {self.source} ends an assistant turn with none of the "
                f"checkpoint's stop tokens {candidates}; list its end-of-turn token in "
                f'{HF_GENERATION_CONFIG} ("eos_token_id")'
            )
        return min(found)[1]

    # -- rendering and encoding ----------------------------------------------------------

    def render(self, messages, tools=None, add_generation_prompt=True, marked: bool = False) -> str:
        """The conversation as the template writes it (`marked`: special tokens in message text marked)."""
        import jinja2  # a dependency of codefleet's Hugging Face support only

        messages = _messages(messages)
        if marked:  # the assistant's own text keeps its special tokens: the model writes them as such
            messages = [m if m.get("role") == "assistant" else _mark(m, self._specials) for m in messages]
            tools = _mark(tools, self._specials)
        name = "tool_use" if tools is not None and "tool_use" in self.templates else "default"
        if name not in self.templates:
            raise ValueError(
                f"the checkpoint in {self.source} has several chat templates and none is named "
                f'"default" ({sorted(self.templates)}); name one "default"'
            )
        try:
            return _compile(self.templates[name]).render(
                messages=messages,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.template_kwargs,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template in {self.source} refused the conversation: {e}") from None

    def _encode(self, tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Ids of marked template text, and each token's character span in `text`."""
        ids: list[int] = []
        spans: list[tuple[int, int]] = []
        pos = 0
        for m in [*_MARKED.finditer(text), None]:
            end = m.start() if m is not None else len(text)
            for piece, start, special in (
                (text[pos:end], pos, True),
                ((m.group(1) or "") if m else "", end + 1, False),
            ):
                if piece:
                    piece_ids, offsets = tokenizer.encode_with_offsets(piece, allow_special=special)
                    ids += piece_ids
                    spans += [(start + a, start + max(b, a + 1)) for a, b in offsets]
            pos = m.end() if m is not None else len(text)
        return ids, spans

    def _ends(self, text: str) -> list[int]:
        """Where each turn-end token the template wrote ends in marked `text`."""
        return [m.end() for m in re.finditer(re.escape(self.stops[0]), _blank(text))]

    def encode_chat(self, tokenizer, messages, tools=None, add_generation_prompt=True) -> list[int]:
        return self._encode(tokenizer, self.render(messages, tools, add_generation_prompt, marked=True))[0]

    def encode_chat_with_mask(self, tokenizer, messages, tools=None, add_generation_prompt=False):
        text = self.render(messages, tools, add_generation_prompt, marked=True)
        ends = self._ends(text)
        turns = []  # (start, end) of each assistant turn in text
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            if i == 0:
                turns.append((0, ends[0] if ends else len(text)))
                continue
            before = self.render(messages[:i], tools, add_generation_prompt=True, marked=True)
            before_ends = self._ends(before)
            k = len(before_ends)
            tail = before[before_ends[-1] :] if k else before
            base = ends[k - 1] if 0 < k <= len(ends) else 0
            if k > len(ends) or text[base : base + len(tail)] != tail:
                raise ValueError(
                    f"the chat template in {self.source} renders the conversation before assistant "
                    f"message {i} differently once the message follows; its tokens cannot be masked"
                )
            turns.append((base + len(tail), ends[k] if k < len(ends) else len(text)))
        ids, spans = self._encode(tokenizer, text)
        mask = [int(any(a < e and b > s for s, e in turns)) for a, b in spans]
        return ids, mask

    def continuation(self, tokenizer, messages, n_done, tools) -> list[int]:
        done = self._ends(self.render(messages[:n_done], tools, add_generation_prompt=False, marked=True))
        text = self.render(messages, tools, add_generation_prompt=True, marked=True)
        ends = self._ends(text)
        if not done or len(ends) < len(done):
            raise ValueError(
                f"the chat template in {self.source} does not close the assistant's turn with "
                f"{self.stops[0]} before the new messages"
            )
        return self._encode(tokenizer, text[ends[len(done) - 1] :])[0]

    def least_tokens(self, tokenizer, messages, tools=None) -> int:
        return -(-len(self.render(messages, tools)) // tokenizer.max_token_bytes)

    def stop_ids(self, tokenizer) -> list[int]:
        return [tokenizer.special_id(s) for s in self.stops]

    def parse_tool_calls(self, text: str, id_prefix: str = "call_") -> ParsedTurn:
        return self.tool_calls.parse(text, id_prefix)


# -- choosing a checkpoint's format -------------------------------------------------------


def is_hf(path: str) -> bool:
    """Whether the directory `path` is a Hugging Face checkpoint (its config.json, or a tokenizer_config.json or
    chat template beside its tokenizer), whose own tokenizer and chat template are used."""
    return is_hf_dir(path) or any(
        os.path.isfile(os.path.join(path, f)) for f in (HF_TOKENIZER_CONFIG, HF_CHAT_TEMPLATE, HF_CHAT_TEMPLATE_JSON)
    )


def of(tokenizer, tool_parser: str | None = None) -> ChatFormat:
    """The chat format a loaded tokenizer belongs to: its checkpoint's template for an HFTokenizer (built once,
    kept on it), codefleet's for codefleet's tokenizers."""
    if not isinstance(tokenizer, HFTokenizer):
        if tool_parser not in (None, "codefleet"):
            raise ValueError(f"codefleet's chat template writes codefleet tool calls, not {tool_parser!r}")
        return CODEFLEET
    fmt = tokenizer.chat_format
    if fmt is None or (tool_parser and fmt.tool_calls.name != tool_parser):
        fmt = tokenizer.chat_format = TemplateFormat.from_tokenizer(tokenizer, tool_parser)
    return fmt


def for_checkpoint(path: str, tool_parser: str | None = None) -> tuple[Tokenizer, ChatFormat]:
    """The tokenizer and chat format of the checkpoint directory `path` (module docstring); `tool_parser`
    overrides the tool-call parser the template implies (a key of tool_parser.PARSERS). A Hugging Face
    tokenizer is sized to config.json's `vocab_size` when it says one (`check_vocab`)."""
    if not is_hf(path):
        if os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
            tokenizer = Tokenizer.load(path)
        else:
            tokenizer = default_tokenizer()
        return tokenizer, of(tokenizer, tool_parser)
    tokenizer = HFTokenizer.load(path)
    fmt = of(tokenizer, tool_parser)
    config_file = os.path.join(path, "config.json")
    if os.path.isfile(config_file):
        with open(config_file) as f:
            vocab_size = json.load(f).get("vocab_size")
        if isinstance(vocab_size, int):
            check_vocab(tokenizer, vocab_size)
    return tokenizer, fmt


def check_vocab(tokenizer, vocab_size: int) -> None:
    """Refuse a tokenizer that a model with `vocab_size` embedding rows cannot serve: codefleet's must match
    it exactly, a checkpoint's own may be smaller (the rest of the ids then decode to nothing), never larger."""
    if isinstance(tokenizer, HFTokenizer):
        tokenizer.fit(vocab_size)
    elif tokenizer.vocab_size != vocab_size:  # larger: prompts fail; smaller: samples cannot decode
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is "
            f"{vocab_size}; save the checkpoint with the tokenizer it was trained with"
        )
