"""Inference fast paths: the math of transformer.py and moe.py, computed faster with gradients off.

`Transformer.forward(..., fast=fast)` calls `blocks` and `lm_head` here
instead of its own `blocks` and `lm_head`: the engine and the trainer's
scoring forwards (proximal and reference logprobs, gradients off) pass this
module; training never does (it needs gradients, which these paths do not
keep). Every path computes the same function
as the math it replaces. "Bit-identical" below means the same bits in fp32;
"to float rounding" means the same sums in another order or blocking (~1e-6
relative), which the parity tests bound (tests/test_model_*.py).

- `attention`: q/k/v as one GEMM over `cat(wq, wk, wv)`, RoPE on the query and
  key heads together before the (free) transposes. Every output is the same
  dot product, but MKL may block the wider GEMM differently at some shapes
  (at d_model 192, 5 rows): to float rounding, bit-identical at most shapes.
  The RoPE part is bit-identical.
- `swiglu` (dense layers, shared experts): gate and up as one GEMM over
  `cat(gate, up)`; to float rounding like `attention` (SiLU of a strided half
  can also take another vector path: at hidden sizes under 64 it does).
- `route`: the router without losses in one native call
  (`kernels.decode_layer`, csrc/decode_layer.cpp: the scores through ATen,
  top-k and the renormalisation in a loop) where it is built, fp32 on CPU,
  not replayed and not counting load. Combine weights bit-identical; the
  experts equal except at exact ties of two scores.
- `experts`: the cheapest dispatch for the slot count S on CPU: the native
  kernel (`kernels.moe_experts`, csrc/moe_experts.cpp) up to `KERNEL_SLOTS`;
  without it each slot's expert weights gathered up to `GATHER_SLOTS`, a
  padded `bmm` over the experts while the padding stays small, else
  `MoE.experts`. To float rounding; a token's result does not depend on the
  other tokens of the batch.
- `lm_head`: the head through oneDNN on a copy of its weight prepacked in
  oneDNN's blocked layout (fp32 on CPU), 2-4x MKL's `F.linear` at decode
  sizes. To float rounding (~1e-6); it comes after the last router, so the
  engine routes exactly as the trainer does.
- `blocks`: a decode step over the engine's slot cache (one new token per
  row, `inference_mode`, fp32 on CPU, the kernel built) runs each block's
  attention half as one native call (`decode_attention`: norm, fused q/k/v,
  q/k norm (Qwen3), RoPE, the cache writes, the attention, the output projection, the residual,
  the feed-forward's norm) instead of ~60 small ATen calls. To float
  rounding. Otherwise `Transformer.blocks` with `block` below.

Under `torch.inference_mode()` the router losses are not computed (aux and z
read 0); under `no_grad` alone they are. Where a path does not apply (a GPU,
bf16, no compiler, `CODEFLEET_KERNELS=0`) the math runs.

The concatenated and prepacked weights are inference-only forms
(`derived_weight`): kept on their module as a plain attribute (not a
parameter or buffer: the checkpoint and the optimiser see only the
parameters) and rebuilt when a weight is replaced or updated in place
(`load_state_dict`, an optimiser step), keyed on each weight's storage and
version counter. `Engine.update_weights` builds them for the new weights
before it swaps those in (`model.weight_swap`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from codefleet.model import kernels
from codefleet.model.moe import MoE, MoEOutput, Router, Routing, SwiGLU
from codefleet.model.rope import apply_rope_signed

T = TypeVar("T")

# the experts' dispatch on CPU (`experts`), measured at the tiny config's shapes
KERNEL_SLOTS = 4096  # up to this many slots the native kernel when built: faster than the PyTorch paths from 32
# to 4096 slots here (1.7x at 64, 1.1x at 4096; the weights cold in cache)
GATHER_SLOTS = 4  # up to this many slots: gather each slot's expert weights
PAD_WASTE = 1.5  # else padded bmm while its rows (experts x busiest count) are <= PAD_WASTE x slots
PAD_WASTE_SMALL = 4.0  # ... or <= PAD_WASTE_SMALL x slots for up to SMALL_SLOTS slots
SMALL_SLOTS = 256


# ---- the blocks ----------------------------------------------------------------------------------------------


def blocks(
    model,
    x_BTD: torch.Tensor,
    positions_BT: torch.Tensor,
    cache,
    routing_replay: list[torch.Tensor] | None,
    routed: list[torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`Transformer.blocks` with gradients off: a native decode step where it applies, else each block by
    `block`."""
    x_native_BTD = _native_decode(model, x_BTD, cache, routing_replay, routed)
    if x_native_BTD is not None:  # it runs under inference_mode only: no router losses
        no_loss = x_BTD.new_zeros((), dtype=torch.float32)
        return x_native_BTD, no_loss, no_loss
    return model.blocks(x_BTD, positions_BT, cache, routing_replay, routed, run_block=block)


def block(
    blk: nn.Module,
    x_BTD: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    cache=None,
    replay_NK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, MoEOutput | None]:
    """`Block.forward` through `attention` and `moe` / `swiglu`."""
    B, T, D = x_BTD.shape
    x_BTD = x_BTD + attention(blk.attn, blk.attn_norm(x_BTD), cos, sin, cache)
    h_ND = blk.ffn_norm(x_BTD).reshape(B * T, D)
    if not blk.is_moe:
        return x_BTD + swiglu(blk.ffn, h_ND).view(B, T, D), None
    out = moe(blk.ffn, h_ND, replay_NK)
    return x_BTD + out.y_ND.view(B, T, D), out


def attention(attn: nn.Module, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
    """`Attention.forward` with one q/k/v GEMM, RoPE on the query and key heads in one call."""
    B, T, _ = x_BTD.shape
    H, Hkv, Dh = attn.n_heads, attn.n_kv_heads, attn.head_dim
    w_qkv = fused_weight(attn, (attn.wq.weight, attn.wk.weight, attn.wv.weight))
    qkv_BTHD = F.linear(x_BTD, w_qkv).view(B, T, H + 2 * Hkv, Dh)
    qk_BTHD = qkv_BTHD[:, :, : H + Hkv]
    if attn.q_norm is not None:
        qk_BTHD = torch.cat([attn.q_norm(qk_BTHD[:, :, :H]), attn.k_norm(qk_BTHD[:, :, H:])], dim=2)
    qk_BTHD = apply_rope_signed(qk_BTHD, cos, sin)
    q_BHTD = qk_BTHD[:, :, :H].transpose(1, 2)
    k_BHTD = qk_BTHD[:, :, H:].transpose(1, 2)
    v_BHTD = qkv_BTHD[:, :, H + Hkv :].transpose(1, 2)
    return attn.attend(q_BHTD, k_BHTD, v_BHTD, cache)


def swiglu(ffn: SwiGLU, x_ND: torch.Tensor) -> torch.Tensor:
    """`SwiGLU.forward` with gate and up as one GEMM."""
    gate, up = F.linear(x_ND, fused_weight(ffn, (ffn.gate.weight, ffn.up.weight))).chunk(2, dim=-1)
    return ffn.down(F.silu(gate) * up)


def lm_head(head: nn.Linear, h_BTD: torch.Tensor) -> torch.Tensor:
    """`head(h_BTD)` through `inference_linear` (to float rounding, ~1e-6)."""
    return inference_linear(head, h_BTD, (head.weight,))


# ---- the MoE layer -------------------------------------------------------------------------------------------


def moe(layer: MoE, x_ND: torch.Tensor, replay_NK: torch.Tensor | None = None) -> MoEOutput:
    """`MoE.forward` through `route`, `experts` and `swiglu`; under `inference_mode` without router losses
    (`aux_loss`/`z_loss` None)."""
    r = route(layer.router, x_ND, replay_NK, losses=not torch.is_inference_mode_enabled())
    y_ND = experts(layer, x_ND, r.experts_NK, r.weights_NK)
    if layer.shared is not None:
        y_ND = y_ND + swiglu(layer.shared, x_ND)
    return MoEOutput(y_ND, r.experts_NK, r.aux_loss, r.z_loss)


def route(router: Router, x_ND: torch.Tensor, replay_NK: torch.Tensor | None = None, losses: bool = True) -> Routing:
    """`router(x_ND, replay_NK, losses)`, in one native call where that applies (see the module docstring)."""
    native = not (losses or router.counts_load()) and replay_NK is None
    if native and x_ND.device.type == "cpu" and x_ND.dtype == router.weight_ED.dtype == torch.float32:
        ops = kernels.decode_layer()
        if ops is not None:
            cfg = router.config
            experts_NK, weights_NK = ops[1](
                x_ND.contiguous(),
                router.weight_ED,
                router.expert_bias_E if cfg.balance == "bias" else None,
                cfg.router_score == "sigmoid",
                cfg.router_renorm,
                cfg.top_k,
            )
            return Routing(experts_NK, weights_NK)
    return router(x_ND, replay_NK, losses=losses)


def experts(layer: MoE, x_ND: torch.Tensor, experts_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
    """`layer.experts` without autograd, by the cheapest dispatch for the number of slots S (on CPU):

    - S <= `KERNEL_SLOTS` and the native kernel built: `kernels.moe_experts`, one call (sorting by expert, the
      experts over their real rows only, SwiGLU in the epilogue, the weighted sum).
    - S <= `GATHER_SLOTS` (decoding one or two sequences): gather each slot's expert weights and run one
      batched matrix-vector product per slot; reads S experts' weights, not all of them.
    - a padded `bmm` over this shard's experts, [E, busiest expert's count, D], while the padding stays
      small: at decode sizes it is ~2x faster than `_grouped_mm`, which runs one small GEMM per expert.
    - otherwise (prefill, training-sized batches, other devices) `layer.experts` (the native training kernel
      or the grouped path).

    Slots are not sorted: a slot's row in the padded batch is its rank among the slots of its expert.
    """
    e0, e1 = layer.expert_range
    if x_ND.device.type == "cpu" and x_ND.dtype == torch.float32 and experts_NK.numel() <= KERNEL_SLOTS:
        fused = kernels.moe_experts()
        if fused is not None:
            gate_up, down = derived_weight(
                layer, "kernel", (layer.w_gate_up_EDG, layer.w_down_EFD), kernels.pack_experts
            )
            return fused(x_ND.contiguous(), experts_NK.contiguous(), weights_NK.contiguous(), gate_up, down, e0)
    n_local = e1 - e0
    K = experts_NK.shape[1]
    expert_S = experts_NK.reshape(-1) - e0  # local numbering
    w_S = weights_NK.reshape(-1)
    slot_S = torch.arange(expert_S.numel(), device=x_ND.device)
    if (e0, e1) != (0, layer.config.n_experts):  # only the slots routed to this shard
        mine_S = ((expert_S >= 0) & (expert_S < n_local)).nonzero()[:, 0]
        slot_S, expert_S, w_S = mine_S, expert_S[mine_S], w_S[mine_S]
    S = expert_S.numel()
    if x_ND.device.type != "cpu" or S > SMALL_SLOTS * PAD_WASTE_SMALL:
        return layer.experts(x_ND, experts_NK, weights_NK)
    xs_SD = x_ND.index_select(0, slot_S // K)
    if S <= GATHER_SLOTS:
        h_S1G = torch.bmm(xs_SD[:, None], layer.w_gate_up_EDG[expert_S])
        ys_SD = torch.bmm(_swiglu(h_S1G), layer.w_down_EFD[expert_S])[:, 0]
    else:
        # running count of each expert over the slots: its last row is the load, and a slot's own entry
        # is 1 + its rank among its expert's slots (one compare and one cumsum; F.one_hot validates its
        # input with two reductions, bincount is one more pass)
        seen_SE = (expert_S[:, None] == torch.arange(n_local, device=x_ND.device)).cumsum(0)
        cap = int(seen_SE[-1].max())
        waste = PAD_WASTE_SMALL if S <= SMALL_SLOTS else PAD_WASTE
        if n_local * cap > waste * S:
            return layer.experts(x_ND, experts_NK, weights_NK)
        rank_S = seen_SE.gather(1, expert_S[:, None])[:, 0] - 1
        xs_ECD = x_ND.new_zeros(n_local, cap, x_ND.shape[1])
        xs_ECD[expert_S, rank_S] = xs_SD
        ys_ECD = torch.bmm(_swiglu(torch.bmm(xs_ECD, layer.w_gate_up_EDG)), layer.w_down_EFD)
        ys_SD = ys_ECD[expert_S, rank_S]
    if K == 2 and 2 * x_ND.shape[0] == S:  # every slot is here, in token order: y = w0 * y0 + w1 * y1
        # the same sums as the index_add below (0 + a + b == a + b), without the zeros and the scatter
        return (ys_SD * w_S[:, None]).view(-1, 2, x_ND.shape[1]).sum(1)
    return torch.zeros_like(x_ND).index_add_(0, slot_S // K, ys_SD * w_S[:, None])


def _swiglu(h_XG: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused [..., 2F] gate/up pre-activations."""
    gate, up = h_XG.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


# ---- the native decode step (csrc/decode_layer.cpp) ----------------------------------------------------------


def _native_decode(
    model, x_BTD: torch.Tensor, cache, routing_replay: list[torch.Tensor] | None, routed: list[torch.Tensor] | None
) -> torch.Tensor | None:
    """The residual stream after every block of `model` for a decode step (`x_BTD` is `[B, 1, D]`), appending
    each MoE layer's experts `[B, 1, top_k]` to `routed` if given; None where the native path does not apply.
    Each block's attention half is one `decode_attention` call; the feed-forward is `moe` / `swiglu`."""
    rows = getattr(cache, "decode_rows", None)  # the slot cache's; a cache with only `attend` takes the Python path
    if rows is None or not torch.is_inference_mode_enabled():
        return None
    if x_BTD.device.type != "cpu" or x_BTD.dtype != torch.float32 or cache.k.dtype != torch.float32:
        return None
    ops = kernels.decode_layer()
    if ops is None:
        return None
    decode_attention = ops[0]
    cfg = model.config
    slots_B, positions_B = rows
    B = x_BTD.shape[0]
    rope = model.rotary_table(cache.max_len, x_BTD.device)  # [P, 2, 1, head_dim]: cos, signed sin
    x_BD = x_BTD.view(B, cfg.d_model)
    moe_i = 0
    for blk in model.layers:
        attn = blk.attn
        w_qkv = fused_weight(attn, (attn.wq.weight, attn.wk.weight, attn.wv.weight))
        x_BD, h_BD = decode_attention(
            x_BD,
            blk.attn_norm.weight,
            w_qkv,
            attn.wo.weight,
            blk.ffn_norm.weight,
            rope,
            cache.k,
            cache.v,
            attn.layer,
            slots_B,
            positions_B,
            attn.n_heads,
            cfg.norm_eps,
            *_qk_norms(attn),
        )
        if blk.is_moe:
            out = moe(blk.ffn, h_BD, None if routing_replay is None else routing_replay[moe_i].reshape(B, cfg.top_k))
            ffn_BD = out.y_ND
            if routed is not None:
                routed.append(out.experts_NK.view(B, 1, cfg.top_k))
            moe_i += 1
        else:
            ffn_BD = swiglu(blk.ffn, h_BD)
        x_BD = x_BD + ffn_BD
    return x_BD.view(B, 1, cfg.d_model)


def _qk_norms(attn: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if attn.q_norm is None:
        return None, None
    return attn.q_norm.weight, attn.k_norm.weight


# ---- inference-only forms of weights -------------------------------------------------------------------------


def derived_weight(owner: nn.Module, name: str, weights: tuple[torch.Tensor, ...], build: Callable[..., T]) -> T:
    """`build(*weights)`, an inference-only form of some weights (concatenated, prepacked), kept on `owner` as a
    plain attribute (not a parameter or buffer: the checkpoint keeps the weights themselves) and rebuilt when
    any of them is replaced or updated in place (load_state_dict, an optimiser step: versions)."""
    if any(w.is_inference() for w in weights):  # made under inference_mode: no version counter to key on
        return build(*weights)
    key = weights_key(weights)
    cache = owner.__dict__.setdefault("_derived_weights", {})
    if name not in cache or cache[name][0] != key:
        with torch.inference_mode(False), torch.no_grad():
            cache[name] = (key, build(*(w.detach() for w in weights)), weights, build)  # weight_swap rebuilds
    return cache[name][1]


def weights_key(weights: tuple[torch.Tensor, ...]) -> tuple:
    """What a derived form is valid for: the weights' storage and in-place versions."""
    return tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)


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
        return torch.ops.mkldnn._linear_pointwise(x, fused_weight(owner, weights, packed=True), None, "none", [], "")
    return F.linear(x, weights[0] if len(weights) == 1 else fused_weight(owner, weights))
