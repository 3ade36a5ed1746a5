"""Hugging Face checkpoint directories in and out: Qwen3, Qwen3-MoE and Llama on codefleet's transformer.

    config = hf.check("Qwen3-30B-A3B/")        # config.json + every shard header checked, no weights read
    model = hf.load_model("Qwen3-30B-A3B/")    # a codefleet Transformer with the checkpoint's weights
    hf.save(model, "out/")                     # sharded safetensors + config.json that transformers loads

`checkpoint.load` / `checkpoint.check` / `checkpoint.save` come here for a
directory whose config.json is a Hugging Face one (`chat.tokenizer.is_hf_dir`) and for a
model whose `config.architecture` is a Hugging Face class, so every command
that takes a checkpoint takes these directories too.

Architectures (`SUPPORTED`): `Qwen3ForCausalLM` (q/k RMSNorm, GQA, tied or
untied embeddings), `Qwen3MoeForCausalLM` (the same attention, softmax
top-k routing with `norm_topk_prob`, dense layers from `mlp_only_layers` and
`decoder_sparse_step`) and `LlamaForCausalLM` (including `rope_scaling` of
type "llama3"). They map onto `ModelConfig` (`model_config`) without the
previous-token embeddings and copy head of codefleet's own models. Anything
this code cannot compute exactly is refused with one error naming the key:
`rope_scaling` of another type (Qwen3's "yarn": remove it from config.json
to run at the original `max_position_embeddings`), attention or MLP biases,
sliding windows, an activation other than SiLU, `trust_remote_code` models.

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

`export_architecture(config)` says which class a codefleet model is written
as (its Hugging Face class; a codefleet MoE without the copy head and the
previous-token embeddings as Qwen3-MoE when it has q/k norm, else as
Mixtral, whose routing is the same softmax top-k with renormalisation) or
why it cannot be.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes

from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
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

CONFIG_FILE = "config.json"
SUPPORTED = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM")
EXPORTS = SUPPORTED + ("MixtralForCausalLM",)
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
_MODEL_TYPES = {
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "LlamaForCausalLM": "llama",
    "MixtralForCausalLM": "mixtral",
}
# the keys of config.json that `model_config` reads; everything else goes to ModelConfig.hf_extra
_READ_KEYS = {
    "architectures",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rms_norm_eps",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_local_experts",
    "num_experts_per_tok",
    "norm_topk_prob",
    "mlp_only_layers",
    "decoder_sparse_step",
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
    "router_aux_loss_coef",
    "hidden_act",
    "attention_bias",
    "mlp_bias",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "transformers_version",
    "auto_map",
    "output_router_logits",
    "use_cache",
    "attention_dropout",
}


# ---- the directory --------------------------------------------------------------------------------------------


def read_config(path: str) -> dict:
    config_file = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_file) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{config_file} not found: {path!r} is not a model directory") from None
    except ValueError as e:
        raise CheckpointError(f"{config_file} is not valid JSON ({e}); download or copy it again") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file} must hold a JSON object, not {type(config).__name__}")
    return config


def model_config(hf: dict, path: str = "", dtype: str | None = None) -> ModelConfig:
    """The `ModelConfig` of a Hugging Face config.json (`path` names it in errors); `dtype` overrides its
    `torch_dtype`. Raises CheckpointError for an architecture or setting codefleet cannot compute exactly."""
    where = os.path.join(path, CONFIG_FILE) if path else CONFIG_FILE
    archs = hf.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else None
    if hf.get("auto_map"):
        raise CheckpointError(
            f"{where} asks for trust_remote_code (auto_map): codefleet runs only the "
            f"architectures it implements itself, {', '.join(SUPPORTED)}"
        )
    if arch not in SUPPORTED:
        raise CheckpointError(f"{where} has architectures {archs!r}; codefleet supports {', '.join(SUPPORTED)}")

    def need(key: str) -> Any:
        if key not in hf:
            raise CheckpointError(f"{where} lacks {key!r}, which {arch} needs")
        return hf[key]

    def refuse(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{where}: {what}; codefleet computes {arch} only without it")

    refuse(hf.get("hidden_act", "silu") == "silu", f"hidden_act {hf.get('hidden_act')!r} is not 'silu'")
    refuse(not hf.get("attention_bias", False), "attention_bias is true")
    refuse(not hf.get("mlp_bias", False), "mlp_bias is true")
    refuse(not hf.get("use_sliding_window", False), "use_sliding_window is true")
    theta, scaling = _rope(hf, where)
    d_model, n_heads = need("hidden_size"), need("num_attention_heads")
    n_layers = need("num_hidden_layers")
    fields: dict[str, Any] = dict(
        vocab_size=need("vocab_size"),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or d_model // n_heads,
        max_seq_len=need("max_position_embeddings"),
        rope_theta=float(theta),
        rope_scaling=scaling,
        norm_eps=float(need("rms_norm_eps")),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qk_norm=arch != "LlamaForCausalLM",
        d_dense=need("intermediate_size"),
        architecture=arch,
        copy=CopyConfig(prev_tokens=0),
        dtype=_dtype_name(dtype or hf.get("dtype") or hf.get("torch_dtype"), where),
        hf_extra={k: v for k, v in hf.items() if k not in _READ_KEYS},
    )
    if arch == "Qwen3MoeForCausalLM":
        n_experts = hf.get("num_experts") or need("num_local_experts")
        step = hf.get("decoder_sparse_step", 1) or 1
        only = list(hf.get("mlp_only_layers") or [])
        fields.update(
            n_experts=n_experts,
            top_k=need("num_experts_per_tok"),
            d_expert=need("moe_intermediate_size"),
            router_score="softmax",
            router_renorm=bool(hf.get("norm_topk_prob", False)),
            balance="aux",
            aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            z_loss_coef=0.0,
            n_shared_experts=0,
            first_dense_layers=0,
            dense_layers=[i for i in range(n_layers) if i in only or (i + 1) % step != 0],
        )
    else:  # dense: every layer a SwiGLU of intermediate_size; the MoE fields are unused
        fields.update(
            n_experts=1, top_k=1, first_dense_layers=n_layers, balance="none", aux_loss_coef=0.0, z_loss_coef=0.0
        )
    try:
        return ModelConfig(**fields)
    except (ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: {e}") from None


def _rope(hf: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config layout: transformers 5's `rope_parameters`, or 4's
    `rope_theta` + `rope_scaling`."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        theta, scaling = params.get("rope_theta", hf.get("rope_theta", 10000.0)), dict(params)
    else:
        theta, scaling = hf.get("rope_theta", 10000.0), dict(hf.get("rope_scaling") or {})
    scaling.pop("rope_theta", None)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in scaling]
        if missing:
            raise CheckpointError(f"{where}: rope scaling 'llama3' lacks {missing}")
        return theta, {"rope_type": "llama3", **{k: scaling[k] for k in keys}}
    raise CheckpointError(
        f"{where}: rope scaling {kind!r} is not supported (only 'llama3'); remove rope_scaling "
        "from config.json to run the model at its original context length "
        "(max_position_embeddings)"
    )


def _dtype_name(value: object, where: str) -> str:
    names = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", None: "float32"}
    if value not in names:
        raise CheckpointError(f"{where}: dtype {value!r} is not one of float32, bfloat16, float16")
    return names[value]


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


def export_architecture(config: ModelConfig) -> str:
    """The Hugging Face class `config`'s model is written as; CheckpointError saying why when none fits."""
    if config.architecture in SUPPORTED:
        return config.architecture
    why = []
    if config.copy.head:
        why.append("it has a copy head (copy.head=true)")
    if config.copy.prev_tokens:
        why.append(f"its input adds {config.copy.prev_tokens} previous tokens' embeddings (copy.prev_tokens)")
    if config.n_moe_layers:
        if config.n_shared_experts:
            why.append("it has shared experts")
        if config.router_score != "softmax" or (not config.router_renorm and not config.qk_norm):
            why.append("its router is not a softmax top-k with renormalised weights")
        if not config.qk_norm and config.n_moe_layers != config.n_layers:
            why.append("it mixes dense and MoE layers without q/k norm")
        if config.balance == "bias":
            why.append("its routing uses a selection bias (balance='bias')")
    if config.rope_scaling is not None and config.qk_norm:
        why.append("Qwen3 has no llama3 rope scaling")
    if why:
        raise CheckpointError(
            "this codefleet model has no Hugging Face architecture: "
            + "; ".join(why)
            + ". Train with model.copy.head=false and model.copy.prev_tokens=0 to export it"
        )
    if not config.n_moe_layers:
        return "Qwen3ForCausalLM" if config.qk_norm else "LlamaForCausalLM"
    return "Qwen3MoeForCausalLM" if config.qk_norm else "MixtralForCausalLM"


def hf_config(config: ModelConfig, architecture: str) -> dict:
    """The config.json of `config`'s model written as `architecture`."""
    out: dict[str, Any] = {
        **config.hf_extra,
        "architectures": [architecture],
        "model_type": config.hf_extra.get("model_type", _MODEL_TYPES[architecture]),
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "torch_dtype": config.dtype,
        "intermediate_size": config.d_dense if config.n_moe_layers < config.n_layers else config.d_expert,
    }
    if architecture in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        key = "num_local_experts" if architecture == "MixtralForCausalLM" else "num_experts"
        out.update(
            {key: config.n_experts, "num_experts_per_tok": config.top_k, "router_aux_loss_coef": config.aux_loss_coef}
        )
    if architecture == "Qwen3MoeForCausalLM":
        out.update(
            intermediate_size=config.d_dense,
            moe_intermediate_size=config.d_expert,
            norm_topk_prob=config.router_renorm,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i in range(config.n_layers) if not config.is_moe(i)],
        )
    if architecture == "MixtralForCausalLM":
        out["intermediate_size"] = config.d_expert
    return out


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
