"""Tiny Hugging Face checkpoints built locally, for tests and benchmarks: no model hub needed.

    path = make_tiny_hf("/tmp/tiny-qwen3-moe")                     # arch="qwen3_moe", float32, seed 0
    path = make_tiny_hf("/tmp/tiny-llama", arch="llama", hidden_size=128, num_hidden_layers=4)

The directory is what a real checkpoint of that family holds: config.json, the weights as sharded
safetensors with their index (written by transformers' `save_pretrained`, random weights from `seed`),
generation_config.json naming the stop tokens, tokenizer.json and tokenizer_config.json with a chat
template. The tokenizer is codefleet's own byte-level BPE (chat/assets/tokenizer.json) with Qwen's
added tokens appended (`ADDED_TOKENS`: `<|im_start|>`, `<|im_end|>`, `<|endoftext|>` special;
`<tool_call>`, `<think>`... not special, as in Qwen's tokenizer). The chat template (`CHAT_TEMPLATE`) is
written for codefleet in the Hermes/Qwen structure: a system turn with the tools' schemas in `<tools>`,
assistant tool calls as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`, tool results in a user
turn inside `<tool_response>`, and the `<think>` reasoning of assistant turns before the last user
message dropped (so a conversation with a second user message does not round-trip; see
`chat.formats`). The model's vocabulary is the tokenizer's rounded up to a multiple of 64, so the
embedding has rows no token uses, as real checkpoints do.

transformers is imported only when a checkpoint is built (it is in the `bench` extra).
"""

from __future__ import annotations

import json
import os

import tokenizers

from codefleet.chat.tokenizer import ASSETS_DIR, TOKENIZER_FILE

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
ADDED_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

CHAT_TEMPLATE = """\
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}
{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- macro text(content) -%}
{%- if content is string -%}{{ content }}{%- elif content -%}
{%- for part in content -%}{{ part.text }}{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools or messages[0].role == 'system' -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ text(messages[0].content) }}{% if tools %}{{ '\n\n' }}{% endif %}{% endif %}
{% if tools %}
# Tools

These functions can be called. Their JSON schemas are inside <tools></tools>:
<tools>
{% for tool in tools %}
{{ tool | tojson }}
{% endfor %}
</tools>

Call one by writing a JSON object with its name and arguments between <tool_call></tool_call> tags:
<tool_call>
{"name": <function name>, "arguments": <arguments as a JSON object>}
</tool_call>
{%- endif %}
<|im_end|>
{% endif %}
{%- for m in messages -%}
{%- if m.role == 'system' and loop.first -%}
{%- elif m.role == 'assistant' -%}
{%- set content = text(m.content) -%}
{%- if loop.index0 < ns.last_user and '</think>' in content -%}
{%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
{%- endif -%}
<|im_start|>assistant
{{ content }}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
{%- if content or not loop.first %}{{ '\\n' }}{% endif -%}
<tool_call>
{"name": {{ f.name | tojson }}, "arguments": {% if f.arguments is string %}{{ f.arguments }}
{%- else %}{{ f.arguments | tojson }}{% endif %}}
</tool_call>
{%- endfor -%}
<|im_end|>
{{ '' }}
{%- elif m.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}

<tool_response>
{{ text(m.content) }}
</tool_response>
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>
{% endif -%}
{%- else -%}
<|im_start|>{{ m.role }}
{{ text(m.content) }}<|im_end|>
{{ '' }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{{ '' }}
{%- endif -%}
"""

ARCHS = {  # arch -> (transformers config class, sizes of a tiny model)
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=4,
            num_experts_per_tok=2,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
    ),
    "llama": (
        "LlamaConfig",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        ),
    ),
}


def tiny_tokenizer() -> tokenizers.Tokenizer:
    """codefleet's tokenizer with Qwen's added tokens appended."""
    hf = tokenizers.Tokenizer.from_file(os.path.join(ASSETS_DIR, TOKENIZER_FILE))
    hf.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    hf.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    return hf


def write_tokenizer(path: str, chat_template: str | None = CHAT_TEMPLATE) -> int:
    """tokenizer.json, tokenizer_config.json (with `chat_template` unless None) and generation_config.json
    into `path`; returns the tokenizer's size."""
    os.makedirs(path, exist_ok=True)
    hf = tiny_tokenizer()
    hf.save(os.path.join(path, TOKENIZER_FILE))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    stops = [hf.token_to_id("<|im_end|>"), hf.token_to_id("<|endoftext|>")]
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": stops, "pad_token_id": hf.token_to_id("<|endoftext|>")}, f, indent=2)
    return hf.get_vocab_size(with_added_tokens=True)


def make_tiny_hf(
    path: str,
    arch: str = "qwen3_moe",
    dtype: str = "float32",
    seed: int = 0,
    max_shard_size: str = "400KB",
    **size_overrides,
) -> str:
    """Write a tiny random Hugging Face checkpoint of `arch` into `path` (module docstring); returns `path`.
    `size_overrides` are transformers config fields (hidden_size=..., num_hidden_layers=..., vocab_size=...)."""
    import torch
    import transformers  # the `bench` extra

    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, got {arch!r}")
    n_tokens = write_tokenizer(path)
    config_class, sizes = ARCHS[arch]
    sizes = {
        **sizes,
        "vocab_size": -(-n_tokens // 64) * 64,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        **size_overrides,
    }
    if sizes["vocab_size"] < n_tokens:
        raise ValueError(f"vocab_size {sizes['vocab_size']} is smaller than the tokenizer's {n_tokens} tokens")
    with open(os.path.join(path, TOKENIZER_FILE)) as f:
        vocab = tokenizers.Tokenizer.from_str(f.read())
    config = getattr(transformers, config_class)(
        **sizes, eos_token_id=vocab.token_to_id("<|im_end|>"), pad_token_id=vocab.token_to_id("<|endoftext|>")
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(path, max_shard_size=max_shard_size)
    write_tokenizer(path)  # save_pretrained may write its own generation_config.json: ours names both stops
    return path
