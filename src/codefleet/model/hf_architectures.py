"""Which Hugging Face architectures codefleet computes, and their config.json <-> `ModelConfig`, both ways.

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

`export_architecture(config)` says which class a codefleet model is written
as (its Hugging Face class; a codefleet MoE without the copy head and the
previous-token embeddings as Qwen3-MoE when it has q/k norm, else as
Mixtral, whose routing is the same softmax top-k with renormalisation) or
why it cannot be; `hf_config` is the config.json it is written with. The
weights, in and out, are `hf.py`'s.
"""

from __future__ import annotations

import json
import os
from typing import Any

from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
from codefleet.model.safetensors_io import CheckpointError

CONFIG_FILE = "config.json"
SUPPORTED = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM")
EXPORTS = SUPPORTED + ("MixtralForCausalLM",)
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


# ---- config.json in -----------------------------------------------------------------------------------------


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


# ---- config.json out ----------------------------------------------------------------------------------------


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
