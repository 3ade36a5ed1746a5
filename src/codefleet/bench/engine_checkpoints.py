"""The random checkpoints `codefleet bench engine` runs on when it is given none (`--shape`), built by
transformers so that both codefleet and HF load a directory a user could have downloaded.

- `build_tiny_qwen3_moe`: `ModelConfig.tiny()`'s shapes (layers, hidden size, heads, kv heads, head dim, experts,
  top-k, expert hidden size, vocabulary) as a Qwen3-MoE with q/k norm, fp32, codefleet's tokenizer.
- `SHAPES` (`build_shape`): models a user would run, random fp32 weights: `qwen3-0.6b` (Qwen3-0.6B's dense
  shape) and `moe-1b` (a Qwen3-MoE of 1.06B total, 0.36B active). `bench gpu` builds them too.

transformers is imported only when a checkpoint is built (it is in the `bench` extra).
"""

from __future__ import annotations

import json
import os
import shutil

import torch

from codefleet.bench.tiny_hf import make_tiny_hf
from codefleet.chat.tokenizer import ASSETS_DIR, TOKENIZER_FILE
from codefleet.model.config import ModelConfig

TOKENIZER_SIZE = 4096  # codefleet's own tokenizer (chat/assets), ModelConfig.tiny()'s vocabulary
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)  # in its special tokens


def build_tiny_qwen3_moe(path: str, **shapes) -> str:
    """A random Qwen3-MoE with `ModelConfig.tiny()`'s shapes (or those `shapes` override: ModelConfig field
    names), fp32, saved by transformers into `path` as a Hugging Face directory; returns `path`."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # optional: the `bench` extra (pyproject.toml)

    config = ModelConfig.tiny(**shapes)
    hf_config = Qwen3MoeConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.d_model,
        num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads,
        num_key_value_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        num_experts=config.n_experts,
        num_experts_per_tok=config.top_k,
        moe_intermediate_size=config.d_expert,
        intermediate_size=config.d_expert,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=config.max_seq_len,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf_config).eval().save_pretrained(path)  # fp32: torch's default dtype
    if config.vocab_size == TOKENIZER_SIZE:  # codefleet's tokenizer fits: a directory vLLM can load (its tokenizer)
        shutil.copy(os.path.join(ASSETS_DIR, TOKENIZER_FILE), path)
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "model_max_length": config.max_seq_len,
                    "chat_template": TINY_CHAT_TEMPLATE,
                },
                f,
            )
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": 3, "pad_token_id": 0}, f)  # <|end|>, <|pad|>: the bench stops on neither
    return path


# Shapes a user would run, random weights built by transformers (`make_tiny_hf`: Qwen's tokenizer layout), fp32;
# both with Qwen3-0.6B's attention (16 query / 8 KV heads of 128) and vocabulary (151936, embeddings tied).
SHAPES = {
    "qwen3-0.6b": (
        "qwen3",
        dict(
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
        ),
    ),
    # ~1.06B total, ~0.36B active: 16 layers, 32 experts top-4 of hidden 512
    "moe-1b": (
        "qwen3_moe",
        dict(
            hidden_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            num_experts=32,
            num_experts_per_tok=4,
            moe_intermediate_size=512,
            intermediate_size=3072,
            norm_topk_prob=True,
        ),
    ),
}


def build_shape(shape: str, path: str) -> str:
    """A random checkpoint of `shape` (a key of SHAPES) saved by transformers into `path`; returns `path`."""
    arch, sizes = SHAPES[shape]
    return make_tiny_hf(path, arch=arch, max_shard_size="2GB", vocab_size=151936, tie_word_embeddings=True, **sizes)
