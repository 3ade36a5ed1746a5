"""Byte-level BPE tokenizer, trained locally on codefleet's own corpus.

    tok = default_tokenizer()                 # the shipped assets/tokenizer.json
    ids = tok.encode("def f(x):\\n\\treturn x")   # plain text: never yields a special id
    assert tok.decode(ids) == "def f(x):\\n\\treturn x"
    tok.end_id, tok.assistant_id, tok.vocab_size

Design:

- HF `tokenizers` does the work: a BPE model over GPT-2's byte-level
  alphabet (all 256 bytes are in the vocabulary, so there is no unknown
  token and any UTF-8 text round-trips exactly), the GPT-2 split regex, no
  normalizer, no post-processor (the chat template adds `<|bos|>`).
- Special tokens (`SPECIAL_TOKENS`, ids 0..15) are added by the trainer and
  are single ids. `encode(text)` treats its input as plain text: a string
  that spells "<|end|>" becomes ordinary byte tokens, so user text or a tool
  result cannot forge a role or a tool call. Only `encode(text,
  allow_special=True)` (template text you wrote yourself) or
  `special_id(...)` produce special ids.
- Decoding maps every id to its bytes ourselves (`token_bytes`,
  `decode_bytes`), so decoding is exact, works on any id sequence (a stream
  cut mid-character decodes with U+FFFD in `decode`, exactly in
  `decode_bytes`), and needs no HF decoder quirks.
- A Hugging Face checkpoint brings its own tokenizer: `Tokenizer.load(dir)`
  on a directory with a `tokenizer_config.json` gives an `HFTokenizer`
  (any byte-level BPE `tokenizer.json`: Qwen, Llama 3, ...). Its added
  tokens are its special tokens, the same rules hold (plain text never
  yields one, `allow_special=True` matches them all), and it keeps the
  directory's tokenizer_config.json, chat_template.jinja and
  generation_config.json, which `save` writes back, so the chat template
  (`codefleet.chat.formats`) travels with it. `fit(vocab_size)` sizes
  it to a model whose embedding is larger (ids past its own decode to
  nothing) and refuses one that is smaller.
- Training is deterministic: the same texts in the same order give the same
  `tokenizer.json`, in any process (tests check it across hash seeds). The
  default tokenizer was trained once on codefleet's own corpus
  (`codefleet.recipe.corpus`) and is shipped in `assets/` with a
  `tokenizer.meta.json` recording the recipe and the corpus fingerprint;
  `python -m codefleet.recipe.corpus build` rebuilds it. Its vocabulary is
  frozen on purpose: model checkpoints depend on it, and it must not drift
  when someone edits the code the corpus is made of.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from codefleet.chat.codefleet_template import ASSISTANT, BOS, CALL_CLOSE, CALL_OPEN, END, EOS, SYSTEM, TOOL, TOOLS, USER
from codefleet.store import safe_files

DEFAULT_VOCAB_SIZE = 4096
DEFAULT_MIN_FREQUENCY = 2
TOKENIZER_FILE = "tokenizer.json"
# what a Hugging Face checkpoint keeps beside tokenizer.json for its tokenizer and chat template
HF_TOKENIZER_CONFIG, HF_CHAT_TEMPLATE, HF_CHAT_TEMPLATE_JSON, HF_GENERATION_CONFIG = (
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
HF_CONFIG = "config.json"  # a Hugging Face model directory's architecture (`is_hf_dir`)
HF_FILES = (
    HF_TOKENIZER_CONFIG,
    HF_CHAT_TEMPLATE,
    HF_CHAT_TEMPLATE_JSON,
    HF_GENERATION_CONFIG,
    "special_tokens_map.json",
)
META_FILE = "tokenizer.meta.json"
ASSETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets")

# Order fixes the ids (0..15). Reserved slots let later work add tokens without changing the vocabulary.
SPECIAL_TOKENS = [
    "<|pad|>",
    BOS,
    EOS,
    END,
    SYSTEM,
    USER,
    ASSISTANT,
    TOOL,
    TOOLS,
    CALL_OPEN,
    CALL_CLOSE,
    *[f"<|reserved_{i}|>" for i in range(5)],
]


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class Tokenizer:
    """A trained byte-level BPE tokenizer with codefleet's special tokens. Thread-safe."""

    def __init__(self, hf: tokenizers.Tokenizer):
        self.hf = hf  # matches special tokens in text (template text only)
        self._plain = tokenizers.Tokenizer.from_str(hf.to_str())
        self._plain.encode_special_tokens = True  # special-token strings are plain text here
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        missing = [t for t in SPECIAL_TOKENS if hf.token_to_id(t) is None]
        if missing:
            raise ValueError(
                f"tokenizer lacks the special tokens {missing}; train it with Tokenizer.train "
                "(or rebuild with `python -m codefleet.chat.tokenizer build`)"
            )
        self.special: dict[str, int] = {t: hf.token_to_id(t) for t in SPECIAL_TOKENS}
        self.pad_id, self.bos_id, self.eos_id, self.end_id = (self.special[t] for t in SPECIAL_TOKENS[:4])
        self.system_id, self.user_id, self.assistant_id, self.tool_id = (self.special[t] for t in SPECIAL_TOKENS[4:8])
        self.tools_id, self.call_open_id, self.call_close_id = (self.special[t] for t in SPECIAL_TOKENS[8:11])
        byte_of = _byte_decoder()
        special_ids = set(self.special.values())
        self._bytes: list[bytes] = []
        for i in range(self.vocab_size):
            token = hf.id_to_token(i)
            if i in special_ids:
                self._bytes.append(token.encode())
            else:
                self._bytes.append(bytes(byte_of[c] for c in token))
        # the longest token: a text of n characters (n bytes or more) is at least n / max_token_bytes tokens
        self.max_token_bytes: int = max(len(b) for b in self._bytes)

    # -- training and files --------------------------------------------------------------

    @classmethod
    def train(
        cls, texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = DEFAULT_MIN_FREQUENCY
    ) -> Tokenizer:
        """Train on `texts` (deterministic for the same texts in the same order)."""
        if vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (256 bytes plus "
                f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size}"
            )
        hf = tokenizers.Tokenizer(models.BPE())
        hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        hf.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            show_progress=False,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        hf.train_from_iterator(texts, trainer)
        return cls(hf)

    def save(self, directory: str, root: str | None = None) -> str:
        """Write `directory/tokenizer.json`; returns its path. `root`: the directory the user named (default:
        `directory`'s parent, so `directory` itself is never a link); nothing below it is reached through a
        link, and a link planted as one of the files is refused (codefleet.store.safe_files)."""
        return self._save_file(directory, root, TOKENIZER_FILE, self.to_json())

    @staticmethod
    def _save_file(directory: str, root: str | None, name: str, text: str) -> str:
        directory = os.path.abspath(directory)
        path = os.path.join(directory, name)
        safe_files.write_file_beneath(
            os.path.abspath(root) if root else os.path.dirname(directory), path, text, mode=0o644
        )
        return path

    def to_json(self) -> str:
        return self.hf.to_str(pretty=False)

    @classmethod
    def load(cls, path: str) -> Tokenizer:
        """From a directory holding tokenizer.json, or the file itself. A directory that also holds a
        tokenizer_config.json is a Hugging Face checkpoint's: its tokenizer is an HFTokenizer."""
        if os.path.isdir(path):
            if cls is Tokenizer and any(os.path.isfile(os.path.join(path, f)) for f in HF_FILES[:3]):
                return HFTokenizer.load(path)
            path = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"no tokenizer at {path}; save one with Tokenizer.save(dir) or use default_tokenizer()"
            )
        return cls(tokenizers.Tokenizer.from_file(path))

    # -- encoding and decoding -----------------------------------------------------------

    def encode(self, text: str, allow_special: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in it are plain text unless `allow_special`."""
        return (self.hf if allow_special else self._plain).encode(text, add_special_tokens=False).ids

    def encode_with_offsets(self, text: str, allow_special: bool = False) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode`, and each token's (start, end) character offsets in `text`."""
        encoding = (self.hf if allow_special else self._plain).encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets

    def encode_batch(self, texts: list[str], allow_special: bool = False) -> list[list[int]]:
        batch = (self.hf if allow_special else self._plain).encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in batch]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a special token: its string)."""
        return self._bytes[token_id]

    def ids_containing(self, chars: str) -> list[int]:
        """Ids of the tokens whose bytes hold any of the ASCII `chars` (e.g. the copy head's `CopyConfig.blocked`)."""
        wanted = set(chars.encode("ascii"))
        return [i for i, b in enumerate(self._bytes) if wanted.intersection(b)]

    def decode_bytes(self, ids: Iterable[int], skip_special: bool = False) -> bytes:
        table = self._bytes
        if skip_special:
            special = set(self.special.values())
            return b"".join(table[i] for i in ids if i not in special)
        return b"".join(table[i] for i in ids)

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text of `ids`; special tokens spelled out unless `skip_special`. Bytes that end mid-character
        decode as U+FFFD (use decode_bytes to stream exactly)."""
        return self.decode_bytes(ids, skip_special).decode("utf-8", errors="replace")

    def special_id(self, token: str) -> int:
        try:
            return self.special[token]
        except KeyError:
            raise KeyError(f"{token!r} is not a special token; they are {', '.join(SPECIAL_TOKENS)}") from None

    def __len__(self) -> int:
        return self.vocab_size

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


class HFTokenizer(Tokenizer):
    """A Hugging Face checkpoint's own byte-level BPE tokenizer, with its tokenizer files (module docstring).

    `special` maps every added token (special or not in tokenizer.json: Qwen's `<tool_call>` is not) to its
    id; `files` holds the text of the checkpoint's other tokenizer files by name."""

    chat_format = None  # its formats.TemplateFormat, once built (formats.of)

    def __init__(self, hf: tokenizers.Tokenizer, files: dict[str, str] | None = None, source: str = ""):
        self.source = source or "tokenizer.json"
        data = json.loads(hf.to_str())
        if (data.get("decoder") or {}).get("type") != "ByteLevel":
            raise ValueError(
                f"{self.source} is not a byte-level BPE tokenizer (its decoder is "
                f"{(data.get('decoder') or {}).get('type')!r}); codefleet runs byte-level ones "
                "(Qwen, Llama 3 and the like)"
            )
        self.hf = hf
        for token in data.get("added_tokens") or []:  # plain text matches none of them, special or not
            token["special"] = True
        self._plain = tokenizers.Tokenizer.from_str(json.dumps(data))
        self._plain.encode_special_tokens = True
        self.files = dict(files or {})
        added = hf.get_added_tokens_decoder()
        self.special = {token.content: i for i, token in sorted(added.items())}
        self.text_tokens = {token.content for token in added.values() if not token.special}  # <think>, ...
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        self.own_vocab_size = self.vocab_size  # ids from here on (fit) stand for no text
        byte_of = _byte_decoder()
        self._bytes = []
        for i in range(self.vocab_size):
            token = hf.id_to_token(i)
            if i in added:
                self._bytes.append(added[i].content.encode())
            elif token is None:  # a hole in the vocabulary
                self._bytes.append(b"")
            else:
                self._bytes.append(bytes(byte_of[c] for c in token if c in byte_of))
        self.max_token_bytes = max(len(b) for b in self._bytes)

    @classmethod
    def load(cls, path: str) -> HFTokenizer:
        """From a Hugging Face checkpoint directory (tokenizer.json and its other tokenizer files)."""
        file = os.path.join(path, TOKENIZER_FILE)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"no tokenizer at {file}; a Hugging Face checkpoint needs its tokenizer.json")
        files = {}
        for name in HF_FILES:
            if os.path.isfile(os.path.join(path, name)):
                with open(os.path.join(path, name), encoding="utf-8") as f:
                    files[name] = f.read()
        return cls(tokenizers.Tokenizer.from_file(file), files, source=file)

    def save(self, directory: str, root: str | None = None) -> str:
        """Write tokenizer.json and the other tokenizer files (chat template included); returns tokenizer.json's
        path. `root`: as for `Tokenizer.save`."""
        path = super().save(directory, root)
        for name, text in self.files.items():
            self._save_file(directory, root, name, text)
        return path

    def config(self, name: str) -> dict:
        """One of the JSON files kept (`HF_TOKENIZER_CONFIG`, `HF_GENERATION_CONFIG`, ...), {} if absent."""
        text = self.files.get(name)
        if text is None:
            return {}
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} beside {self.source} is not valid JSON ({e}); fix or remove it") from None
        return value if isinstance(value, dict) else {}

    def fit(self, vocab_size: int) -> HFTokenizer:
        """Size the tokenizer to a model's embedding of `vocab_size` rows: refused if the tokenizer has more
        tokens (the model could not read them); the ids past the tokenizer's own stand for no text."""
        if self.own_vocab_size > vocab_size:
            raise ValueError(
                f"{self.source} has {self.own_vocab_size} tokens but the model's embedding has "
                f"{vocab_size} rows; use the tokenizer the model was trained with"
            )
        self._bytes = self._bytes[: self.own_vocab_size] + [b""] * (vocab_size - self.own_vocab_size)
        self.vocab_size = vocab_size
        return self

    def __repr__(self) -> str:
        return f"HFTokenizer({self.source!r}, vocab_size={self.vocab_size})"


def is_hf_dir(path: str) -> bool:
    """Whether `path` holds a Hugging Face model directory (its config.json names `architectures` or a
    `model_type`), rather than a codefleet checkpoint: its tokenizer and chat template are
    its own (`formats.for_checkpoint`)."""
    try:
        with open(os.path.join(path, HF_CONFIG)) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return (
        isinstance(config, dict) and ("architectures" in config or "model_type" in config) and "d_model" not in config
    )


# -- the default tokenizer -----------------------------------------------------------------


@functools.cache
def default_tokenizer() -> Tokenizer:
    """The shipped tokenizer (assets/tokenizer.json)."""
    if not os.path.isfile(os.path.join(ASSETS_DIR, TOKENIZER_FILE)):
        raise FileNotFoundError(
            f"the default tokenizer {os.path.join(ASSETS_DIR, TOKENIZER_FILE)} is missing: "
            "reinstall codefleet, or rebuild it with `python -m codefleet.recipe.corpus build`"
        )
    return Tokenizer.load(ASSETS_DIR)


def write(directory: str, tok: Tokenizer, meta: dict) -> None:
    """Write `tok` and its recipe `meta` into `directory`, replacing both files at once. Both are made in a
    sibling temporary directory first; that, `directory` and their files are reached without following a link
    below `directory`'s parent (a link planted at the temporary name, whose name is predictable, is removed)."""
    directory = os.path.abspath(directory)
    parent, tmp = os.path.dirname(directory), f"{directory}.tmp{os.getpid()}"
    safe_files.remove_beneath(parent, tmp)
    tok.save(tmp)
    safe_files.write_file_beneath(
        parent, os.path.join(tmp, META_FILE), json.dumps(meta, indent=2, sort_keys=True) + "\n", mode=0o644
    )
    safe_files.makedirs_beneath(parent, directory)
    for name in (TOKENIZER_FILE, META_FILE):
        safe_files.replace_beneath(parent, os.path.join(tmp, name), os.path.join(directory, name))
    safe_files.remove_beneath(parent, tmp)
