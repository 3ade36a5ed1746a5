"""Inference-only forms of weights, kept next to the parameters they come from.

With gradients off (the engine, reference logprobs) some GEMMs run on a
different form of their weights: q/k/v or gate/up concatenated into one
matrix, the LM head prepacked in oneDNN's blocked layout, the experts packed
in the native kernel's tiles (`kernels.pack_experts`). `derived_weight` keeps
each form on its module as a plain attribute (not a parameter or buffer: the
checkpoint and the optimiser see only the parameters) and rebuilds it when a
weight is replaced or updated in place (`load_state_dict`, an optimiser step,
`Engine.update_weights`), keyed on each weight's storage and version counter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

T = TypeVar("T")


def derived_weight(owner: nn.Module, name: str, weights: tuple[torch.Tensor, ...], build: Callable[..., T]) -> T:
    """`build(*weights)`, an inference-only form of some weights (concatenated, prepacked), kept on `owner` as a
    plain attribute (not a parameter or buffer: the checkpoint keeps the weights themselves) and rebuilt when
    any of them is replaced or updated in place (load_state_dict, an optimiser step: versions)."""
    if any(w.is_inference() for w in weights):  # made under inference_mode: no version counter to key on
        return build(*weights)
    key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
    cache = owner.__dict__.setdefault("_derived_weights", {})
    if name not in cache or cache[name][0] != key:
        with torch.inference_mode(False), torch.no_grad():
            cache[name] = (key, build(*(w.detach() for w in weights)))
    return cache[name][1]


def _cat(*weights: torch.Tensor) -> torch.Tensor:
    return torch.cat(weights, dim=0)


def fused_weight(owner: nn.Module, weights: tuple[torch.Tensor, ...], packed: bool = False) -> torch.Tensor:
    """The weights concatenated along the output dim, for one GEMM instead of several at inference
    (`derived_weight`). `packed=True`: in oneDNN's blocked layout for `inference_linear`."""
    if packed:
        return derived_weight(owner, "onednn", weights, lambda *w: _pack(_cat(*w)))
    return derived_weight(owner, "fused", weights, _cat)


# oneDNN's prepacked fp32 GEMM (what inductor's CPU freezing uses): on this 2-core x86 machine ~2-4x MKL's
# `F.linear` for the LM head at decode sizes (weights cold in cache), equal for the small projections
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
_PACK_BATCH_HINT = 32  # oneDNN picks its blocking for this many rows; any row count works


def _pack(w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), _PACK_BATCH_HINT)


def inference_linear(owner: nn.Module, x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`F.linear(x, cat(weights))` with gradients off: through oneDNN with the weight prepacked once per weight
    version where it can (fp32 on CPU), else plain `F.linear`. Matches `F.linear` to float rounding (~1e-6)."""
    if _ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and weights[0].dtype == torch.float32:
        return torch.ops.mkldnn._linear_pointwise(x, fused_weight(owner, weights, packed=True), None, "none",
                                                  [], "")
    return F.linear(x, weights[0] if len(weights) == 1 else fused_weight(owner, weights))
