"""`ModelConfig`: the one typed config of the mixture-of-experts transformer.

Every size of the model is a field here; `transformer.Transformer(config)`
builds it. Presets:

- `ModelConfig.tiny()`: ~11M parameters (~4.4M active per token), trains in
  minutes on 2 CPU cores; the default everywhere.
- `ModelConfig.small()`, `ModelConfig.medium()`: documented larger shapes
  (docs/models/codefleet-moe.md) for a GPU.

`vocab_size` is a placeholder until the tokenizer is known: build the config
with `dataclasses.replace(cfg, vocab_size=tokenizer.vocab_size)`.

The MoE fields (see `moe.py`):

- `n_experts` routed experts, `top_k` of them per token, each a SwiGLU with
  hidden size `d_expert`; `n_shared_experts` always-on experts of hidden
  `d_shared` each (0 = none).
- `router_score`: "softmax" (Switch / Qwen-MoE) or "sigmoid" (DeepSeek-V3);
  `router_renorm`: rescale the top-k weights to sum to 1.
- `balance`: "aux" (Switch auxiliary loss scaled by `aux_loss_coef`), "bias"
  (auxiliary-loss-free: a per-expert bias added to the scores for selection
  only, moved by `bias_update_rate` toward uniform load by
  `Transformer.update_router_bias()`), or "none". `z_loss_coef` scales the
  router z-loss in every mode.
- `first_dense_layers`: that many leading layers use a dense SwiGLU of hidden
  `d_dense` instead of MoE (DeepSeek-style); `dense_layers` lists more dense
  layers anywhere (Qwen3-MoE's `mlp_only_layers`). A dense model (Qwen3,
  Llama) has `first_dense_layers == n_layers`: its MoE fields are unused.

Attention and positions: `qk_norm` adds an RMSNorm over each query and key
head before RoPE (Qwen3); `rope_scaling` is None or Llama 3's frequency
scaling `{"rope_type": "llama3", "factor", "low_freq_factor",
"high_freq_factor", "original_max_position_embeddings"}` (`rope.py`).

`architecture` names the layout the checkpoint is written in: "codefleet"
(codefleet's own), or the Hugging Face class it was loaded from
("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "LlamaForCausalLM"), in which
case `checkpoint.save` writes a Hugging Face directory (`hf.py`) and
`hf_extra` holds the keys of its config.json that codefleet does not use
(token ids, `model_type`, ...), written back unchanged.

`copy`: how the model copies tokens from its context (`copy_config.CopyConfig`):
`prev_tokens` previous-token embeddings in each token's input (2 by
default) and the optional copy head, a pointer-generator output (off by
default; `codefleet train` turns it on) with its `scope`, `match` and
`blocked`. `CopyConfig(prev_tokens=0)` is the plain Llama/Qwen model.

`from_dict`/`from_json` take exactly the fields `to_dict` writes (`copy` as
a nested object): a field unknown or missing is one error naming them.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

from codefleet.model.copy_config import CopyConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    vocab_size: int = 4096
    d_model: int = 192
    n_layers: int = 4
    n_heads: int = 6
    n_kv_heads: int = 2
    head_dim: int = 32
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    # mixture of experts
    n_experts: int = 16
    top_k: int = 2
    d_expert: int = 192
    n_shared_experts: int = 0
    d_shared: int = 192
    router_score: str = "softmax"  # "softmax" | "sigmoid"
    router_renorm: bool = True
    balance: str = "aux"  # "aux" | "bias" | "none"
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    bias_update_rate: float = 0.001
    first_dense_layers: int = 0
    d_dense: int = 512
    dense_layers: list[int] = dataclasses.field(default_factory=list)
    qk_norm: bool = False
    rope_scaling: dict | None = None
    tie_embeddings: bool = False
    architecture: str = "codefleet"
    hf_extra: dict = dataclasses.field(default_factory=dict)
    copy: CopyConfig = dataclasses.field(default_factory=CopyConfig)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        sizes = [
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "max_seq_len",
            "n_experts",
            "top_k",
            "d_expert",
            "d_shared",
            "d_dense",
        ]
        bad = [f"{name}={getattr(self, name)!r}" for name in sizes if not _positive_int(getattr(self, name))]
        if not (_positive_int(self.n_shared_experts) or self.n_shared_experts == 0):
            bad.append(f"n_shared_experts={self.n_shared_experts!r}")
        if bad:  # checked first: the checks below divide by some of them
            raise ValueError(
                f"ModelConfig: sizes must be positive integers (n_shared_experts may be 0), got "
                f"{', '.join(bad)}; fix config.json or the overrides"
            )
        if not isinstance(self.copy, CopyConfig):
            raise TypeError(
                f"ModelConfig: copy must be a codefleet.model.copy_config.CopyConfig, got {type(self.copy).__name__}"
            )
        checks = [
            (self.router_score in ("softmax", "sigmoid"), "router_score must be 'softmax' or 'sigmoid'"),
            (self.balance in ("aux", "bias", "none"), "balance must be 'aux', 'bias' or 'none'"),
            (self.dtype in _DTYPES, f"dtype must be one of {sorted(_DTYPES)}"),
            (self.n_heads % self.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads (GQA groups)"),
            (1 <= self.top_k <= self.n_experts, "top_k must be between 1 and n_experts"),
            (self.head_dim % 2 == 0, "head_dim must be even (rotary embeddings rotate pairs)"),
            (0 <= self.first_dense_layers <= self.n_layers, "first_dense_layers must be in [0, n_layers]"),
            (
                all(isinstance(i, int) and 0 <= i < self.n_layers for i in self.dense_layers),
                "dense_layers must list layer indices in [0, n_layers)",
            ),
            (
                self.rope_scaling is None
                or (isinstance(self.rope_scaling, dict) and self.rope_scaling.get("rope_type") == "llama3"),
                "rope_scaling must be None or {'rope_type': 'llama3', ...}",
            ),
            (all(0 <= t < self.vocab_size for t in self.copy.blocked), "copy.blocked holds ids outside the vocab"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"ModelConfig: {msg}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def is_moe(self, layer: int) -> bool:
        """Whether layer `layer`'s feed-forward is the MoE (else a dense SwiGLU of hidden `d_dense`)."""
        return layer >= self.first_dense_layers and layer not in self.dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.n_layers))

    # presets -------------------------------------------------------------

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """~11M parameters (~4.4M active): 4 layers, d_model 192, 16 experts top-2 of hidden 192, vocab 4096."""
        return cls(**overrides)

    @classmethod
    def small(cls, **overrides: Any) -> ModelConfig:
        """~1.7B total / ~0.31B active: 16 layers, d_model 1024, 64 experts top-6 + 1 shared, 1 dense layer."""
        base = {
            "vocab_size": 32768,
            "d_model": 1024,
            "n_layers": 16,
            "n_heads": 16,
            "n_kv_heads": 4,
            "head_dim": 64,
            "n_experts": 64,
            "top_k": 6,
            "d_expert": 512,
            "n_shared_experts": 1,
            "d_shared": 1024,
            "router_score": "sigmoid",
            "balance": "bias",
            "first_dense_layers": 1,
            "d_dense": 4096,
            "dtype": "bfloat16",
        }
        return cls(**{**base, **overrides})

    @classmethod
    def medium(cls, **overrides: Any) -> ModelConfig:
        """~14.7B total / ~1.7B active: 24 layers, d_model 2048, 128 experts top-8 + 1 shared, 1 dense layer."""
        base = {
            "vocab_size": 65536,
            "d_model": 2048,
            "n_layers": 24,
            "n_heads": 16,
            "n_kv_heads": 4,
            "head_dim": 128,
            "n_experts": 128,
            "top_k": 8,
            "d_expert": 768,
            "n_shared_experts": 1,
            "d_shared": 1536,
            "router_score": "sigmoid",
            "balance": "bias",
            "first_dense_layers": 1,
            "d_dense": 8192,
            "dtype": "bfloat16",
        }
        return cls(**{**base, **overrides})

    # serialisation -------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The config `to_dict` wrote; a field unknown or missing (here or in `copy`) is a ValueError."""
        fields = _exact_fields(cls, d, "")
        return cls(**{**fields, "copy": CopyConfig(**_exact_fields(CopyConfig, fields["copy"], "copy."))})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(json.loads(text))


def _exact_fields(cls: type, d: object, prefix: str) -> dict[str, Any]:
    """`d` if it is a dict with exactly the fields of dataclass `cls`, else one ValueError naming the difference."""
    if not isinstance(d, dict):
        raise ValueError(
            f"ModelConfig: {prefix.rstrip('.') or 'the config'} must be a JSON object of "
            f"{cls.__name__} fields, not {type(d).__name__}"
        )
    names = {f.name for f in dataclasses.fields(cls)}
    unknown, missing = sorted(set(d) - names), sorted(names - set(d))
    if unknown or missing:
        problems = [f"unknown field(s) {[prefix + n for n in unknown]}"] if unknown else []
        problems += [f"missing field(s) {[prefix + n for n in missing]}"] if missing else []
        raise ValueError(
            f"ModelConfig: {' and '.join(problems)}; the config was written by another codefleet "
            "version or edited by hand (to_dict writes every field)"
        )
    return d


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
