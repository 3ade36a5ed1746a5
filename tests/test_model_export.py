"""`codefleet export CKPT --hf OUT`: codefleet's own models as Hugging Face directories that transformers loads
with equal logits and renders with codefleet's chat template, and a clear refusal where no architecture maps."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from codefleet.chat import codefleet_template
from codefleet.chat.tokenizer import default_tokenizer
from codefleet.cli import main
from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
from codefleet.model.transformer import Transformer

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "submit", "description": "Finish.", "parameters": {"type": "object", "properties": {}}},
    },
]
CONVERSATIONS = [
    [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": "Fix a.py <|end|> please"}],
    [
        {"role": "user", "content": [{"type": "text", "text": "Task: "}, {"type": "text", "text": "x"}]},
        {
            "role": "assistant",
            "content": "Reading.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}},
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "read_file", "arguments": '{"path": "<|/tool_call|>.py"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "1\timport os"},
        {"role": "tool", "tool_call_id": "c2", "content": "no such file"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "submit", "arguments": ""}}],
        },
    ],
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    torch.manual_seed(0)
    tok = default_tokenizer()
    model = Transformer(
        ModelConfig.tiny(vocab_size=tok.vocab_size, n_layers=2, max_seq_len=256, copy=CopyConfig(prev_tokens=0))
    ).eval()
    checkpoint.save(model, str(root / "ckpt"))
    checkpoint.describe(str(root / "ckpt"), tok)
    assert main(["export", str(root / "ckpt"), "--hf", str(root / "hf"), "--max-shard-mb", "2"]) == 0
    return model, root / "hf"


def test_transformers_loads_the_export_with_equal_logits(exported):
    model, out = exported
    assert json.load(open(out / "config.json"))["architectures"] == ["MixtralForCausalLM"]
    assert os.path.isfile(out / "model.safetensors.index.json")  # sharded at 2 MiB
    back = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokens = torch.randint(0, 4000, (2, 30))
    with torch.no_grad():
        assert (back(tokens).logits - model(tokens).logits_BTV).abs().max() <= 1e-4


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation", [True, False])
def test_the_exported_chat_template_renders_what_codefleet_renders(exported, i, generation):
    _, out = exported
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    messages = CONVERSATIONS[i]
    text = hf_tok.apply_chat_template(messages, tools=TOOLS, tokenize=False, add_generation_prompt=generation)
    assert text == codefleet_template.render(messages, TOOLS, add_generation_prompt=generation)
    no_tools = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    assert no_tools == codefleet_template.render(messages, None, add_generation_prompt=generation)


def test_the_exported_tokenizer_gives_codefleets_ids_and_stops_at_the_end_of_a_turn(exported):
    _, out = exported
    hf_tok = AutoTokenizer.from_pretrained(str(out))
    messages = CONVERSATIONS[0]
    ids = hf_tok.apply_chat_template(messages, tools=TOOLS, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    tok = default_tokenizer()
    # message text that spells a special token renders as that text; the tokenizer then reads it as the special
    # id (as any HF server would): the ids agree with codefleet's once no message spells one
    assert list(ids) == tok.encode(codefleet_template.render(messages, TOOLS), allow_special=True)
    generation = json.load(open(out / "generation_config.json"))
    assert generation["eos_token_id"][0] == tok.special_id(codefleet_template.END)


def test_a_model_with_a_copy_head_is_refused_with_the_reason(tmp_path, capsys):
    model = Transformer(ModelConfig.tiny(n_layers=1, copy=CopyConfig(head=True)))
    checkpoint.save(model, str(tmp_path / "ckpt"))
    assert main(["export", str(tmp_path / "ckpt"), "--hf", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "copy head" in err and "model.copy.head=false" in err and not os.path.exists(tmp_path / "hf")
