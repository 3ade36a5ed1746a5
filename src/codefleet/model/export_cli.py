"""`codefleet export CKPT --hf OUT`: a checkpoint as a Hugging Face model directory.

    codefleet export runs/demo/checkpoints/rl/latest --hf exported/
    python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('exported')"
    vllm serve exported/                                  # or any OpenAI-compatible server that reads HF dirs

OUT gets the weights as safetensors shards (`--max-shard-mb`) with their
index, a config.json of the architecture the model maps to
(`hf_architectures.export_architecture`: its own Hugging Face class for a model that came
from one; Qwen3-MoE or Mixtral for codefleet's MoE, Qwen3 or Llama for a
dense one), the tokenizer, the chat template and generation_config.json.

A checkpoint that came from a Hugging Face directory keeps its own tokenizer
files and template. Codefleet's own models get codefleet's tokenizer and its
chat template written in Jinja (`CODEFLEET_TEMPLATE`, which renders what
`codefleet_template.render` renders in the "full" prompt style), with `<|end|>` as the end
of a turn. A model that has no Hugging Face architecture (the copy head, the
previous-token embeddings, shared experts, a sigmoid router) is refused with
the reason and the settings that train one that exports.

OUT is the user's to name (it may itself be a link), but nothing in it is
reached through one: every file goes in through codefleet.store.safe_files,
so a config.json, tokenizer file or weights shard planted in OUT as a link is
refused (a stale shard that is a link is removed as a link), never written
through.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from codefleet.chat.codefleet_template import BOS, END, EOS
from codefleet.chat.tokenizer import Tokenizer, default_tokenizer, is_hf_dir
from codefleet.model import checkpoint, hf, hf_architectures
from codefleet.store import safe_files

# codefleet's chat template (chat/codefleet_template.py) as transformers renders templates (trim_blocks,
# lstrip_blocks): the tools block after the leading system messages, each tool call as its JSON with "<|" escaped
# inside strings
CODEFLEET_TEMPLATE = (
    "{%- macro text(content) -%}{%- if content is string -%}{{ content }}{%- elif content is iterable -%}"
    "{%- for part in content -%}{{ part.text if part.text is defined else '' }}{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- macro tools_block() -%}<|tools|>{%- for tool in tools or [] -%}"
    "{{ (tool.function if tool.function is defined else tool) | tojson }}{{ '\\n' if not loop.last }}"
    "{%- endfor -%}<|end|>{%- endmacro -%}"
    "{{- bos_token -}}{%- set ns = namespace(tools_done=not tools) -%}"
    "{%- for message in messages -%}"
    "{%- if message.role != 'system' and not ns.tools_done -%}{{ tools_block() }}{%- set ns.tools_done = true -%}"
    "{%- endif -%}"
    "<|{{ message.role }}|>{{ text(message.content) }}"
    "{%- if message.role == 'assistant' -%}{%- for call in message.tool_calls or [] -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{%- set args = f.arguments if f.arguments is string and f.arguments | trim else "
    "(f.arguments | tojson if f.arguments is mapping else '{}') -%}"
    "<|tool_call|>{{ ('{\"name\": ' ~ (f.name | tojson) ~ ', \"arguments\": ' ~ args ~ '}')"
    " | replace('<|', '<\\\\u007c') }}"
    "<|/tool_call|>{%- endfor -%}{%- endif -%}<|end|>"
    "{%- endfor -%}"
    "{%- if not ns.tools_done -%}{{ tools_block() }}{%- endif -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def register(subparsers) -> None:
    export = subparsers.add_parser(
        "export",
        help="write a checkpoint as a Hugging Face model directory (transformers, vLLM)",
        description="Write checkpoint CKPT into OUT as a Hugging Face model directory: safetensors shards, "
        "config.json, tokenizer, chat template and generation config, which transformers' from_pretrained, vLLM "
        "and other OpenAI-compatible servers load as they are.",
    )
    export.add_argument("checkpoint", metavar="CKPT", help="checkpoint directory (codefleet's or Hugging Face's)")
    export.add_argument(
        "--hf", required=True, metavar="OUT", help="directory to write (created; its old weights files are replaced)"
    )
    export.add_argument(
        "--max-shard-mb",
        type=int,
        default=hf.MAX_SHARD_BYTES // 2**20,
        help=f"largest safetensors shard in MiB (default {hf.MAX_SHARD_BYTES // 2**20})",
    )
    export.set_defaults(func=run)


def export(src: str, out: str, max_shard_bytes: int = hf.MAX_SHARD_BYTES) -> str:
    """Write checkpoint `src` into `out` as a Hugging Face directory; the architecture written."""
    config = checkpoint.check(src)
    architecture = hf_architectures.export_architecture(config)  # refuses before anything is read or written
    model = checkpoint.load(src)
    hf.save(model, out, max_shard_bytes=max_shard_bytes, root=out)  # OUT may be the user's link; nothing in it
    if is_hf_dir(src):
        hf.copy_text_files(src, out, root=out)
    else:
        write_codefleet_text_files(
            out, Tokenizer.load(src) if os.path.isfile(os.path.join(src, "tokenizer.json")) else default_tokenizer()
        )
    return architecture


def write_codefleet_text_files(out: str, tokenizer: Tokenizer) -> None:
    """codefleet's tokenizer, its chat template and stop tokens, as Hugging Face tokenizer files (no link in
    `out` followed)."""
    tokenizer.save(out, root=out)
    end, eos = (tokenizer.special_id(t) for t in (END, EOS))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": END,
        "pad_token": EOS,
        "chat_template": CODEFLEET_TEMPLATE,
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }
    generation = {"bos_token_id": tokenizer.special_id(BOS), "eos_token_id": [end, eos], "pad_token_id": eos}
    for name, body in (("tokenizer_config.json", config), ("generation_config.json", generation)):
        safe_files.write_file_beneath(out, name, json.dumps(body, indent=2, sort_keys=True), mode=0o644)


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.checkpoint):
        print(f"codefleet export: checkpoint directory {args.checkpoint!r} does not exist", file=sys.stderr)
        return 2
    if args.max_shard_mb < 1:
        print(f"codefleet export: --max-shard-mb must be at least 1, got {args.max_shard_mb}", file=sys.stderr)
        return 2
    if os.path.abspath(args.hf) == os.path.abspath(args.checkpoint):
        print("codefleet export: --hf must be another directory than the checkpoint", file=sys.stderr)
        return 2
    try:
        architecture = export(args.checkpoint, args.hf, args.max_shard_mb * 2**20)
    except (OSError, ValueError) as e:
        print(f"codefleet export: {e}", file=sys.stderr)
        return 2
    print(f"codefleet export: {args.checkpoint} -> {args.hf} ({architecture})")
    return 0
