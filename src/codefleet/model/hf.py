"""Hugging Face checkpoint directories in and out: Qwen3, Qwen3-MoE and Llama on codefleet's transformer.

    config = hf.check("Qwen3-30B-A3B/")        # config.json + every shard header checked, no weights read
    model = hf.load_model("Qwen3-30B-A3B/")    # a codefleet Transformer with the checkpoint's weights
    hf.save(model, "out/")                     # sharded safetensors + config.json that transformers loads

`checkpoint.load` / `checkpoint.check` / `checkpoint.save` come here for a
directory whose config.json is a Hugging Face one (`chat.tokenizer.is_hf_dir`) and for a
model whose `config.architecture` is a Hugging Face class, so every command
that takes a checkpoint takes these directories too.

Which architectures (Qwen3, Qwen3-MoE, Llama; Mixtral on export) and how
their config.json maps onto `ModelConfig` and back is `hf_architectures.py`;
this module moves the weights.

Loading (`load_model`) checks everything first (`check`: the index, every
shard's header, every tensor's name and shape against the config), so a bad
directory fails before any weight is read and nothing is half-loaded. The
model is then built without memory (`meta`) and each tensor is read from its
shard straight into the parameter it belongs to (`read_tensor`: positioned
reads, not a memory map whose touched pages would stay in the process's
RSS), converted or transposed through a buffer of one tensor where needed:
the peak RSS above the process's baseline is the model plus its largest
tensor (`codefleet bench engine --checkpoint DIR` prints `load_peak_rss_mb`).
The weights keep the checkpoint's dtype unless `dtype=` says otherwise;
on CPU, bf16 weights are computed in bf16 (`dtype="float32"` upcasts them,
which the native CPU kernels need; they run only in fp32).

Expert weights: Hugging Face stores each expert's `gate_proj` [F, D],
`up_proj` [F, D] and `down_proj` [D, F]; codefleet stacks them as
`w_gate_up_EDG` [E, D, 2F] (gate then up) and `w_down_EFD` [E, F, D].
`save` writes them back per expert, so an exported directory is the layout
transformers, vLLM and any other server read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass

import torch
from safetensors.torch import save as safetensors_bytes

from codefleet.model.config import ModelConfig
from codefleet.model.hf_architectures import CONFIG_FILE, export_architecture, hf_config, model_config, read_config
from codefleet.model.safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointError,
    TensorInfo,
    read_tensor,
    tensor_index,
)
from codefleet.model.transformer import Transformer
from codefleet.store import safe_files

# the files beside the weights that describe the text side; `copy_text_files` carries them to a new checkpoint
TEXT_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
MAX_SHARD_BYTES = 2 * 1024**3


# ---- names: codefleet parameter <-> Hugging Face tensors ------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """One Hugging Face tensor and where it lives in a codefleet parameter: `param[index]` (index None: the
    whole parameter), transposed when `transpose`."""

    hf_name: str
    param: str
    index: tuple | None = None
    transpose: bool = False


def pieces(config: ModelConfig) -> list[Piece]:
    """Every Hugging Face tensor of `config`'s model and where it goes (the `lm_head` only when untied)."""
    out = [Piece("model.embed_tokens.weight", "embed.weight"), Piece("model.norm.weight", "norm.weight")]
    if not config.tie_embeddings:
        out.append(Piece("lm_head.weight", "lm_head.weight"))
    expert_names = (
        ("w1", "w3", "w2") if config.architecture == "MixtralForCausalLM" else ("gate_proj", "up_proj", "down_proj")
    )
    F = config.d_expert
    for i in range(config.n_layers):
        hf, cf = f"model.layers.{i}.", f"layers.{i}."
        out += [
            Piece(hf + "input_layernorm.weight", cf + "attn_norm.weight"),
            Piece(hf + "post_attention_layernorm.weight", cf + "ffn_norm.weight"),
        ]
        out += [Piece(f"{hf}self_attn.{h}_proj.weight", f"{cf}attn.w{h}.weight") for h in "qkvo"]
        if config.qk_norm:
            out += [Piece(f"{hf}self_attn.{h}_norm.weight", f"{cf}attn.{h}_norm.weight") for h in "qk"]
        if not config.is_moe(i):
            out += [Piece(f"{hf}mlp.{p}_proj.weight", f"{cf}ffn.{p}.weight") for p in ("gate", "up", "down")]
            continue
        if config.architecture == "MixtralForCausalLM":
            moe, experts = f"{hf}block_sparse_moe.", f"{hf}block_sparse_moe.experts."
        else:
            moe, experts = f"{hf}mlp.", f"{hf}mlp.experts."
        out.append(Piece(moe + "gate.weight", cf + "ffn.router.weight_ED"))
        gate, up, down = expert_names
        for e in range(config.n_experts):
            out += [
                Piece(f"{experts}{e}.{gate}.weight", cf + "ffn.w_gate_up_EDG", (e, slice(None), slice(0, F)), True),
                Piece(f"{experts}{e}.{up}.weight", cf + "ffn.w_gate_up_EDG", (e, slice(None), slice(F, 2 * F)), True),
                Piece(f"{experts}{e}.{down}.weight", cf + "ffn.w_down_EFD", (e,), True),
            ]
    return out


def _hf_shape(piece: Piece, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape the Hugging Face tensor of `piece` must have, given the codefleet parameters' shapes."""
    shape = shapes[piece.param]
    if piece.index is not None:
        shape = tuple(torch.empty(shape, device="meta")[piece.index].shape)
    return tuple(reversed(shape)) if piece.transpose else shape


# ---- load ----------------------------------------------------------------------------------------------------


def check(path: str, dtype: str | None = None) -> ModelConfig:
    """The model config of the directory once every tensor it needs is known to be there with the right shape,
    without reading weights. Raises CheckpointError naming the file."""
    config = model_config(read_config(path), path, dtype)
    _plan(path, config)
    return config


def _plan(path: str, config: ModelConfig) -> list[tuple[Piece, TensorInfo]]:
    tensors = tensor_index(path)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(config, init_weights=False).state_dict().items()}
    plan = []
    for piece in pieces(config):
        info = tensors.get(piece.hf_name)
        if info is None:
            raise CheckpointError(
                f"{path!r} lacks tensor {piece.hf_name!r} that its config.json "
                f"({config.architecture}) needs; the weights and the config come from different "
                "models, or a shard is missing from the index"
            )
        want = _hf_shape(piece, shapes)
        if info.shape != want:
            raise CheckpointError(
                f"{info.file} holds {piece.hf_name} of shape {list(info.shape)} but config.json "
                f"makes it {list(want)}; the weights and the config come from different models"
            )
        plan.append((piece, info))
    used = {p.hf_name for p in pieces(config)} | {"lm_head.weight"}  # a tied checkpoint may store the head too
    unused = sorted(n for n in tensors if n not in used and not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise CheckpointError(
            f"{tensors[unused[0]].file} holds {len(unused)} tensor(s) {config.architecture} does "
            f"not have, e.g. {unused[0]!r}; config.json does not describe these weights"
        )
    return plan


def load_model(path: str, device: str | torch.device = "cpu", dtype: str | None = None) -> Transformer:
    """The Hugging Face model in `path` as a codefleet Transformer on `device`, in the checkpoint's dtype (or
    `dtype`). Everything is checked before any weight is read (`check`)."""
    config = model_config(read_config(path), path, dtype)
    plan = _plan(path, config)
    with torch.device("meta"):
        model = Transformer(config, init_weights=False)
    _materialize(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for piece, info in plan:
            dest = params[piece.param]
            if piece.index is not None:
                dest = dest[piece.index]
            if piece.transpose:
                dest = dest.t()
            if dest.is_contiguous() and dest.dtype == info.dtype:
                read_tensor(info, dest)
            else:
                dest.copy_(read_tensor(info))
    return model.to(device)


def _materialize(model: torch.nn.Module) -> None:
    """Give a model built on the meta device CPU memory: uninitialised parameters (the loader fills each; tied ones
    stay one tensor) and zero buffers (the routers' selection bias and load count, as a fresh model's). Unlike
    `to_empty`, no meta-tensor op runs (one imports sympy: ~0.5 s and ~35 MB)."""
    made: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype), p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype)


# ---- save ----------------------------------------------------------------------------------------------------


def save(
    model: Transformer,
    path: str,
    config: ModelConfig | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    root: str | None = None,
) -> None:
    """Write `model` into `path` as a Hugging Face directory: config.json and the weights in safetensors shards
    of at most `max_shard_bytes` with their index (one model.safetensors when they fit in one shard).

    `root`: the directory the user named (default: `path`'s parent, so `path` itself is never a link); nothing
    below it is reached through a link (codefleet.store.safe_files): a planted config.json or index link is
    refused, a stale shard that is a link is removed as a link. Each file is encoded in memory
    (safetensors' bytes API, one shard at a time) and written atomically through safe_files, never by path."""
    config = config or model.config
    architecture = export_architecture(config)
    if config.n_moe_layers and config.balance == "bias":
        raise CheckpointError("a selection bias cannot be exported")
    exported = dataclasses.replace(config, architecture=architecture)
    state = model.state_dict()
    tensors = {}
    for piece in pieces(exported):
        t = state[piece.param]
        if piece.index is not None:
            t = t[piece.index]
        tensors[piece.hf_name] = (t.t() if piece.transpose else t).detach().to("cpu").contiguous()
    path = os.path.abspath(path)
    root = os.path.abspath(root) if root else os.path.dirname(path)
    safe_files.makedirs_beneath(root, path)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    for stale in safe_files.listdir_beneath(root, path):  # a previous save's shards would confuse the index
        if stale.startswith("model") and stale.endswith((".safetensors", ".safetensors.index.json")):
            safe_files.remove_beneath(root, os.path.join(path, stale))

    def write(name: str, data: bytes | str) -> None:
        safe_files.write_file_beneath(root, os.path.join(path, name), data, mode=0o644)

    meta = {"format": "pt"}
    if len(shards) == 1:
        write(SINGLE_FILE, safetensors_bytes(shards[0], metadata=meta))
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            write(name, safetensors_bytes(shard, metadata=meta))
            weight_map.update(dict.fromkeys(shard, name))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        write(
            INDEX_FILE,
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True),
        )
    write(CONFIG_FILE, json.dumps(hf_config(exported, architecture), indent=2, sort_keys=True))


def copy_text_files(src: str, dst: str, root: str | None = None) -> list[str]:
    """Copy the tokenizer, chat template and generation config files of `src` (those of TEXT_FILES it has) into
    `dst`; the names copied. `root`: as for `save` (default `dst`'s parent): no link below it is followed in
    `dst`, a planted link as one of the files is refused."""
    copied = []
    dst = os.path.abspath(dst)
    root = os.path.abspath(root) if root else os.path.dirname(dst)
    for name in TEXT_FILES:
        if os.path.isfile(os.path.join(src, name)) and os.path.abspath(src) != dst:
            safe_files.write_file_beneath(
                root, os.path.join(dst, name), lambda f, name=name: _copy_into(os.path.join(src, name), f), mode=0o644
            )
            copied.append(name)
    return copied


def _copy_into(file: str, out) -> None:
    with open(file, "rb") as f:
        shutil.copyfileobj(f, out, 1 << 20)
