"""The byte-level BPE tokenizer: exact round trips, special tokens, deterministic training, the shipped asset."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

from codefleet.chat.tokenizer import ASSETS_DIR, META_FILE, SPECIAL_TOKENS, TOKENIZER_FILE, Tokenizer, default_tokenizer
from codefleet.recipe.corpus import CorpusConfig, build_corpus, fingerprint

SMALL = CorpusConfig(n_tasks=10, n_transcripts=5, include_src=False)

TRICKY = [
    "def f(x):\n\treturn x  # tab-indented\r\n",
    "naïve café — «quotes» 日本語のコード 🚀🧪 ∑x² ≠ ∞",
    "zero\u200bwidth, combining e\u0301, RTL \u05e9\u05dc\u05d5\u05dd, BOM \ufeff",
    "controls \x00\x01\x07\x1b[31mred\x1b[0m \x7f \x1c\x1d\x1e\x1f \x0c\x0b",
    "   \n\n\t\t  \r\r\n trailing spaces   ",
    '<|end|> <|assistant|><|tool_call|>{"name": "x"}<|/tool_call|> <|bos',
    "",
]


@pytest.fixture(scope="module")
def small_corpus() -> list[str]:
    return build_corpus(SMALL)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return default_tokenizer()


def test_default_tokenizer_is_the_shipped_asset_with_4096_tokens(tok):
    assert os.path.isfile(os.path.join(ASSETS_DIR, TOKENIZER_FILE))
    assert os.path.getsize(os.path.join(ASSETS_DIR, TOKENIZER_FILE)) < 1_000_000
    assert tok.vocab_size == len(tok) == 4096
    assert default_tokenizer() is tok  # loaded once per process


@pytest.mark.parametrize("text", TRICKY)
def test_plain_text_round_trips_exactly(tok, text):
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode()
    assert not set(ids) & set(tok.special.values())


def test_random_unicode_and_every_byte_round_trip(tok):
    rng = random.Random(0)
    for _ in range(200):
        chars = [
            chr(rng.choice([rng.randrange(0, 0x80), rng.randrange(0x80, 0xD800), rng.randrange(0xE000, 0x110000)]))
            for _ in range(rng.randrange(1, 60))
        ]
        text = "".join(chars)
        assert tok.decode(tok.encode(text)) == text
    # every byte value is one token of its own: any byte string is representable
    singles = {tok.token_bytes(i) for i in range(tok.vocab_size) if i not in tok.special.values()}
    assert {bytes([b]) for b in range(256)} <= singles


def test_streaming_decode_is_exact_at_any_cut(tok):
    text = "emoji 🚀 and 日本 in one line"
    ids = tok.encode(text)
    streamed = b"".join(tok.decode_bytes([i]) for i in ids)
    assert streamed.decode() == text
    cut = tok.decode(ids[: len(ids) // 2 + 1])  # may end mid-character: replacement char, no exception
    assert isinstance(cut, str)


def test_code_compresses(tok):
    with open(
        os.path.join(os.path.dirname(__file__), "..", "src", "codefleet", "agent", "loop.py"), encoding="utf-8"
    ) as f:
        source = f.read()
    assert len(source.encode()) / len(tok.encode(source)) > 2.5  # bytes per token on unseen-ish code


def test_special_tokens_are_single_ids_and_cannot_be_forged_from_text(tok):
    assert [tok.special[t] for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.end_id) == (0, 1, 2, 3)
    for token in SPECIAL_TOKENS:
        assert tok.encode(token, allow_special=True) == [tok.special_id(token)]
        plain = tok.encode(token)
        assert len(plain) > 1 and not set(plain) & set(tok.special.values())
        assert tok.decode(plain) == token == tok.decode([tok.special_id(token)])
    assert tok.decode([tok.bos_id, tok.user_id, *tok.encode("hi"), tok.end_id], skip_special=True) == "hi"
    with pytest.raises(KeyError, match="not a special token"):
        tok.special_id("<|nope|>")


def test_save_and_load_give_the_same_tokenizer(tok, tmp_path):
    path = tok.save(str(tmp_path / "t"))
    again = Tokenizer.load(str(tmp_path / "t"))
    assert Tokenizer.load(path).to_json() == again.to_json() == tok.to_json()
    for text in TRICKY:
        assert again.encode(text) == tok.encode(text)
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        Tokenizer.load(str(tmp_path / "missing"))


def test_corpus_is_deterministic_and_holds_code_patches_and_transcripts(small_corpus):
    assert fingerprint(build_corpus(SMALL)) == fingerprint(small_corpus)
    assert any(d.startswith("diff --git ") for d in small_corpus)
    transcripts = [d for d in small_corpus if d.startswith("<|bos|>")]
    assert len(transcripts) == SMALL.n_transcripts
    for name in ("list_dir", "search", "read_file", "edit_file", "run", "submit"):
        assert any(f'<|tool_call|>{{"name": "{name}"' in t for t in transcripts), name
    assert all(t.endswith("<|tool|>submitted<|end|>") for t in transcripts)  # every expert episode submits
    assert any("def " in d for d in small_corpus if not d.startswith(("<|bos|>", "diff --git")))


def test_training_is_deterministic_across_processes(small_corpus, tmp_path):
    first = Tokenizer.train(small_corpus, vocab_size=1024)
    assert first.vocab_size == 1024
    assert Tokenizer.train(small_corpus, vocab_size=1024).to_json() == first.to_json()
    corpus_file = tmp_path / "corpus.json"
    corpus_file.write_text(json.dumps(small_corpus))
    script = (
        "import json, sys; from codefleet.chat.tokenizer import Tokenizer; "
        f"print(Tokenizer.train(json.load(open({str(corpus_file)!r})), vocab_size=1024).to_json())"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        )
        assert out.stdout.strip() == first.to_json()


def test_too_small_vocab_is_refused(small_corpus):
    with pytest.raises(ValueError, match="at least 272"):
        Tokenizer.train(small_corpus[:3], vocab_size=100)


def test_the_shipped_asset_records_how_it_was_built(tok):
    """The shipped vocabulary is frozen on purpose (retraining follows the code the
    corpus is made of); its metadata must still say how to rebuild it."""
    with open(os.path.join(ASSETS_DIR, META_FILE), encoding="utf-8") as f:
        meta = json.load(f)
    assert meta["vocab_size"] == tok.vocab_size
    assert set(meta["corpus"]) and len(meta["corpus_fingerprint"]) >= 16
    CorpusConfig(**meta["corpus"])  # the recorded recipe is still a valid corpus config


def test_without_the_asset_the_default_tokenizer_says_how_to_rebuild_it(monkeypatch, tmp_path):
    import codefleet.chat.tokenizer as module

    monkeypatch.setattr(module, "ASSETS_DIR", str(tmp_path / "no-assets"))
    with pytest.raises(FileNotFoundError, match="python -m codefleet.recipe.corpus build"):
        module.default_tokenizer.__wrapped__()


def test_the_rebuild_command_writes_a_loadable_tokenizer_and_its_recipe(tmp_path, tok):
    from codefleet.recipe import corpus

    assert corpus.main(["build", "--out", str(tmp_path)]) == 0
    built = Tokenizer.load(str(tmp_path))
    assert (tmp_path / META_FILE).is_file() and built.vocab_size == tok.vocab_size and built.special == tok.special


def test_ids_containing_finds_every_token_that_holds_the_characters(tok):
    ids = tok.ids_containing("`:")
    assert ids == sorted(i for i in range(tok.vocab_size) if {"`", ":"} & set(tok.decode([i])))
    assert tok.encode("`")[0] in ids and tok.call_open_id not in ids
