"""A decode step's transformer blocks through the native kernels (csrc/decode_layer.cpp).

In a decode step (one new token per row, over the engine's slot KV cache) the
tiny model's GEMMs are small, and a block's ~60 other ATen calls from Python
(norms, RoPE, the cache writes, the attention, the router) cost about as much
as its arithmetic. `decode_blocks` runs each block as two native calls: the
attention half with the feed-forward's norm (`decode_attention`: norm, fused
q/k/v GEMM, RoPE from the model's table, the cache writes, each row's
attention over its own history, the output projection and the residual), then
the feed-forward module itself, whose router takes the native `moe_route` and
whose experts the native `moe_experts` (moe.py).

The math is the Python path's (`Transformer.forward` with `cache.attend`):
the GEMMs are the same MKL calls; norms, softmax and the attention's sums run
in another order, so results agree to float rounding (tests/test_model_kernels.py
holds the two equal, the engine tests hold the engine to the trainer's forward).
Where it does not apply (no kernel, not fp32 on CPU, a prefill, outside
`torch.inference_mode()`, where the router's losses are computed)
`decode_blocks` returns None and the caller runs its own loop.
"""

from __future__ import annotations

import torch

from codefleet.model import kernels
from codefleet.model.weights import fused_weight


def decode_blocks(model, x_BTD: torch.Tensor, cache, routing_replay: list[torch.Tensor] | None,
                  routed: list[torch.Tensor] | None) -> torch.Tensor | None:
    """The residual stream after every block of `model` for a decode step (`x_BTD` is `[B, 1, D]`), appending
    each MoE layer's experts `[B, 1, top_k]` to `routed` if given; None where the native path does not apply."""
    rows = getattr(cache, "decode_rows", None)  # the slot cache's; a cache with only `attend` takes the Python path
    if rows is None or not torch.is_inference_mode_enabled():
        return None
    if x_BTD.device.type != "cpu" or x_BTD.dtype != torch.float32 or cache.k.dtype != torch.float32:
        return None
    ops = kernels.decode_layer()
    if ops is None:
        return None
    attention = ops[0]
    cfg = model.config
    slots_B, positions_B = rows
    B = x_BTD.shape[0]
    rope = model._rope(cache.max_len, x_BTD.device)  # [P, 2, 1, head_dim]: cos, signed sin
    x_BD = x_BTD.view(B, cfg.d_model)
    moe_i = 0
    for block in model.layers:
        attn = block.attn
        w_qkv = fused_weight(attn, (attn.wq.weight, attn.wk.weight, attn.wv.weight))
        x_BD, h_BD = attention(x_BD, block.attn_norm.weight, w_qkv, attn.wo.weight, block.ffn_norm.weight, rope,
                               cache.k, cache.v, attn.layer, slots_B, positions_B, attn.n_heads, cfg.norm_eps)
        if block.is_moe:
            out = block.ffn(h_BD, None if routing_replay is None else routing_replay[moe_i].reshape(B, cfg.top_k))
            ffn_BD = out.y_ND
            if routed is not None:
                routed.append(out.experts_NK.view(B, 1, cfg.top_k))
            moe_i += 1
        else:
            ffn_BD = block.ffn(h_BD)
        x_BD = x_BD + ffn_BD
    return x_BD.view(B, 1, cfg.d_model)
