"""`ModelConfig`: the one typed config of the mixture-of-experts transformer.

Every size of the model is a field here; `transformer.Transformer(config)`
builds it. Presets:

- `ModelConfig.tiny()`: ~11M parameters (~4.4M active per token), trains in
  minutes on 2 CPU cores; the default everywhere.
- `ModelConfig.small()`, `ModelConfig.medium()`: documented larger shapes
  (docs/model.md) for a GPU.

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
  `d_dense` instead of MoE (DeepSeek-style).

`prev_tokens`: each token's input also sums learned embeddings of the
`prev_tokens` tokens before it (one table per offset; a short convolution over
token identities, like a token shift). Attention then finds "the position
after the previous occurrence of this token" in one layer, the lookup that
copies a name from the context, instead of first building a previous-token
head. The tiny model learns to copy unseen names in a fraction of the steps
(docs/model.md). 0 is the plain Llama/Qwen input; configs saved before the
field existed load as 0.

`copy_head`: the output is a pointer-generator mixture (See et al., 2017):
`p = (1 - g) softmax(lm_head(h_t)) + g sum_{s <= t: x_s = w} a_ts`, where `a`
is one extra attention of the last hidden state over the context's hidden
states and `g` a learned gate. Predicting a token that occurs in the context
then needs only the right attention, whose gradient comes straight from the
target: a model trained from scratch copies names from its task far sooner
(docs/model.md). The logits the model returns are `log p`, so sampling,
logprobs and losses are unchanged. Off by default (the plain Llama/Qwen
output); `codefleet train` turns it on (`model.copy_head`).

`copy_scope`: which positions the copy head may point at. "all": every
earlier position, the model's own output included. "prompt": only the tokens
before the current assistant turn (the prompt the engine was given), so the
pointer cannot follow its own output around a loop (`to X to X to X ...`,
seen in the tiny policy's transcripts); names are copied from the task and
tool results, where they come from. Training then needs the turns' mask
(`Transformer.forward(turn_mask_BT=...)`), the engine passes each request's
prompt length. Configs saved before the field existed load as "all".

`copy_match`: the copy head's score of context position s also adds
`w1 [x_{s-1} = x_t] + w2 [x_{s-1} = x_t and x_{s-2} = x_{t-1}]` (two
learned scalars): a position whose preceding tokens are the ones just
written is where a copy continues. A tiny model that learns this by
attention alone continues a copied name with the wrong piece
(`transitansit`, `fee_for` for `fee_for_balance`); exact matching makes
the continuation a lookup, as prompt-lookup decoding does. Off by default.

`copy_blocked`: token ids the copy head never points at (a query whose
context holds nothing else sees it all), so they come from the LM head
alone. `codefleet train` (`model.copy_words_only`) fills it with the tokens
that hold quotes, backticks, brackets, commas or colons: a copy that runs on
past a name's end (`app.py"}}` out of an earlier tool call) then stops
where the name does. Empty by default.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import torch

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
    tie_embeddings: bool = False
    prev_tokens: int = 2
    copy_head: bool = False
    copy_scope: str = "all"  # "all" | "prompt"
    copy_match: bool = False
    copy_blocked: list[int] = dataclasses.field(default_factory=list)
    dtype: str = "float32"

    def __post_init__(self) -> None:
        sizes = ["vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "max_seq_len", "n_experts",
                 "top_k", "d_expert", "d_shared", "d_dense"]
        bad = [f"{name}={getattr(self, name)!r}" for name in sizes if not _positive_int(getattr(self, name))]
        if not (_positive_int(self.n_shared_experts) or self.n_shared_experts == 0):
            bad.append(f"n_shared_experts={self.n_shared_experts!r}")
        if bad:  # checked first: the checks below divide by some of them
            raise ValueError(f"ModelConfig: sizes must be positive integers (n_shared_experts may be 0), got "
                             f"{', '.join(bad)}; fix config.json or the overrides")
        checks = [
            (self.router_score in ("softmax", "sigmoid"), "router_score must be 'softmax' or 'sigmoid'"),
            (self.balance in ("aux", "bias", "none"), "balance must be 'aux', 'bias' or 'none'"),
            (self.dtype in _DTYPES, f"dtype must be one of {sorted(_DTYPES)}"),
            (self.n_heads % self.n_kv_heads == 0, "n_heads must be a multiple of n_kv_heads (GQA groups)"),
            (1 <= self.top_k <= self.n_experts, "top_k must be between 1 and n_experts"),
            (self.head_dim % 2 == 0, "head_dim must be even (rotary embeddings rotate pairs)"),
            (0 <= self.first_dense_layers <= self.n_layers, "first_dense_layers must be in [0, n_layers]"),
            (0 <= self.prev_tokens <= 8, "prev_tokens must be in [0, 8]"),
            (self.copy_scope in ("all", "prompt"), "copy_scope must be 'all' or 'prompt'"),
            (all(0 <= t < self.vocab_size for t in self.copy_blocked), "copy_blocked holds ids outside the vocab"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(f"ModelConfig: {msg}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.first_dense_layers

    # presets -------------------------------------------------------------

    @classmethod
    def tiny(cls, **overrides: Any) -> ModelConfig:
        """~11M parameters (~4.4M active): 4 layers, d_model 192, 16 experts top-2 of hidden 192, vocab 4096."""
        return cls(**overrides)

    @classmethod
    def small(cls, **overrides: Any) -> ModelConfig:
        """~1.7B total / ~0.31B active: 16 layers, d_model 1024, 64 experts top-6 + 1 shared, 1 dense layer."""
        base = {"vocab_size": 32768, "d_model": 1024, "n_layers": 16, "n_heads": 16, "n_kv_heads": 4, "head_dim": 64,
                    "n_experts": 64, "top_k": 6, "d_expert": 512, "n_shared_experts": 1, "d_shared": 1024,
                    "router_score": "sigmoid", "balance": "bias", "first_dense_layers": 1, "d_dense": 4096, "dtype": "bfloat16"}
        return cls(**{**base, **overrides})

    @classmethod
    def medium(cls, **overrides: Any) -> ModelConfig:
        """~14.7B total / ~1.7B active: 24 layers, d_model 2048, 128 experts top-8 + 1 shared, 1 dense layer."""
        base = {"vocab_size": 65536, "d_model": 2048, "n_layers": 24, "n_heads": 16, "n_kv_heads": 4, "head_dim": 128,
                    "n_experts": 128, "top_k": 8, "d_expert": 768, "n_shared_experts": 1, "d_shared": 1536,
                    "router_score": "sigmoid", "balance": "bias", "first_dense_layers": 1, "d_dense": 8192, "dtype": "bfloat16"}
        return cls(**{**base, **overrides})

    # serialisation -------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"ModelConfig: unknown field(s) {unknown}; the checkpoint is from a newer codefleet "
                             "or was edited by hand")
        return cls(**{"prev_tokens": 0, **d})  # saved before the field existed: no previous-token embeddings

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        return cls.from_dict(json.loads(text))


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
