"""Mixture-of-experts feed-forward: token-choice top-k router, dropless grouped dispatch.

Shapes: N tokens, D model dim, E experts (E_local on this shard), K = top_k,
S = N*K token-slots, F expert hidden, G = 2F (gate and up fused).

Router (`Router`): logits_NE = x_ND @ W_ED^T; scores are softmax or sigmoid of
the logits; each token picks the K experts with the highest score (plus, with
`balance="bias"`, a per-expert bias used *only for the choice*, DeepSeek-V3's
auxiliary-loss-free balancing). The combine weights are the chosen experts'
scores, optionally renormalised to sum to one, so the router learns through
them. `update_bias()` moves the bias by `bias_update_rate * sign(mean load -
load)` from the load counted in training forwards since the last call, outside
autograd; the trainer calls `Transformer.update_router_bias()` after each
optimiser step. Losses (already scaled by their coefficients):

- aux (Switch): `aux_loss_coef * E * sum_e f_e * P_e`, f_e = share of the S
  slots routed to e, P_e = mean over tokens of e's score normalised per token;
  exactly `aux_loss_coef` at a uniform load.
- z (ST-MoE): `z_loss_coef * mean_n logsumexp(logits_n)^2`.

Routing replay (R3): `forward(x, replay_NK=experts)` uses the given experts
instead of the top-k but still takes the combine weights from the router's
scores for those experts, so the trainer reproduces exactly what the engine
computed and the router still gets gradients.

Dispatch is dropless (no capacity, no token ever dropped): the S slots are
sorted by expert (a stable argsort), each expert's rows are contiguous, and
the experts run as grouped matrix products (`torch._grouped_mm`, one call for
all experts; a padded `bmm` where it is unavailable). `_ExpertsFn` is a custom
autograd function: it writes its own backward (the combine-weight gradient
comes from the down projection's input gradient, no [S, D] output is kept,
SiLU's derivative is one fused kernel) instead of autograd's generic graph.
On CPU the sorted slots are processed in a few tiles of whole experts
(~`tile_slots` slots each) so the intermediates stay in cache and under
glibc's mmap threshold (a fresh 32 MB tensor costs ~10 ms of page faults on
every call); the number of tiles depends on S, not on E, and on GPU there is
one tile.

Training on CPU in fp32 takes the native kernels instead when they are built
(`_NativeExpertsFn`, `kernels.moe_train`, csrc/moe_train.cpp): the same math
with one expert per core from gather to output, the products single-threaded
on data still in cache; `codefleet bench moe` at 64 experts top-8 went from
0.75-0.77x to 0.89-1.03x (median 0.98x) a dense SwiGLU of equal active parameters
(docs/benchmarks.md). Without them (GPUs, no compiler) `_ExpertsFn` runs.

Where the caller passes the inference fast path (the engine, reference logprobs) the layer runs through
`fast.moe` instead (codefleet.inference.fast): the router in one native call where it
can, the experts by the cheapest dispatch for the slot count (a native
kernel, gathered weights, a padded `bmm`, or `MoE.experts` below), the
shared expert's gate and up as one GEMM.

Expert parallelism seam: `MoE(config, expert_range=(e0, e1))` holds only the
weights of experts e0..e1-1 ([E_local, D, G] and [E_local, F, D]) and computes
only the slots routed to them (a contiguous block of the sorted slots); the
router is replicated. Its output is this shard's partial sum: the caller sums
the shards (all-reduce, or an all-to-all of the sorted slots at scale). The
shared expert, if any, is computed by the shard that holds expert 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from codefleet.model import kernels
from codefleet.model.config import ModelConfig


class SwiGLU(nn.Module):
    """Dense feed-forward `down(silu(gate(x)) * up(x))`, used for dense layers and shared experts."""

    def __init__(self, d_model: int, d_hidden: int):
        super().__init__()
        self.gate = nn.Linear(d_model, d_hidden, bias=False)
        self.up = nn.Linear(d_model, d_hidden, bias=False)
        self.down = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x_ND: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x_ND)) * self.up(x_ND))


@dataclass
class Routing:
    experts_NK: torch.Tensor  # int64 expert ids (global numbering)
    weights_NK: torch.Tensor  # combine weights, differentiable
    aux_loss: torch.Tensor | None = None  # None when the router was asked for no losses
    z_loss: torch.Tensor | None = None


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight_ED = nn.Parameter(torch.empty(config.n_experts, config.d_model))
        # bias for selection only (balance="bias"); persistent: it changes which experts run
        self.register_buffer("expert_bias_E", torch.zeros(config.n_experts, dtype=torch.float32))
        # slots per expert counted in training forwards since the last update_bias()
        self.register_buffer("load_E", torch.zeros(config.n_experts, dtype=torch.float32), persistent=False)

    def forward(self, x_ND: torch.Tensor, replay_NK: torch.Tensor | None = None, losses: bool = True) -> Routing:
        """Choose the experts of every token; `losses=False` skips the aux/z losses (left None)."""
        cfg = self.config
        count = self.counts_load()
        logits_NE = F.linear(x_ND, self.weight_ED)
        if logits_NE.dtype != torch.float32:
            logits_NE = logits_NE.float()
        if cfg.router_score == "softmax":
            scores_NE = logits_NE.softmax(-1)
        else:
            scores_NE = logits_NE.sigmoid()
        if replay_NK is None:
            with torch.no_grad():
                select_NE = scores_NE + self.expert_bias_E if cfg.balance == "bias" else scores_NE
                experts_NK = select_NE.topk(cfg.top_k, dim=-1).indices
        else:
            if replay_NK.shape != (x_ND.shape[0], cfg.top_k):
                raise ValueError(
                    f"routing_replay has shape {tuple(replay_NK.shape)}, expected "
                    f"{(x_ND.shape[0], cfg.top_k)} (tokens, top_k)"
                )
            experts_NK = replay_NK.to(device=x_ND.device, dtype=torch.long)
        weights_NK = scores_NE.gather(1, experts_NK)
        if cfg.router_renorm:
            weights_NK = weights_NK / (weights_NK.sum(-1, keepdim=True) + 1e-20)
        routing = Routing(experts_NK, weights_NK if weights_NK.dtype == x_ND.dtype else weights_NK.to(x_ND.dtype))
        if not (losses or count):
            return routing
        counts_E = torch.bincount(experts_NK.reshape(-1), minlength=cfg.n_experts)
        if count:
            self.load_E += counts_E.float()
        if losses:
            zero = logits_NE.new_zeros(())
            routing.aux_loss = routing.z_loss = zero
            if cfg.balance == "aux" and cfg.aux_loss_coef > 0:
                f_E = counts_E.float() / experts_NK.numel()
                probs_NE = scores_NE if cfg.router_score == "softmax" else scores_NE / scores_NE.sum(-1, keepdim=True)
                routing.aux_loss = cfg.aux_loss_coef * cfg.n_experts * (f_E * probs_NE.mean(0)).sum()
            if cfg.z_loss_coef > 0:
                routing.z_loss = cfg.z_loss_coef * torch.logsumexp(logits_NE, -1).square().mean()
        return routing

    def counts_load(self) -> bool:
        """Whether a forward now counts the experts' load for `update_bias` (training with balance="bias")."""
        return self.training and self.config.balance == "bias"

    @torch.no_grad()
    def update_bias(self) -> None:
        """Move each expert's selection bias toward a uniform load (DeepSeek-V3), then reset the count."""
        if self.load_E.sum() == 0:
            return
        self.expert_bias_E += self.config.bias_update_rate * torch.sign(self.load_E.mean() - self.load_E)
        self.load_E.zero_()


# ---- grouped matrix products -------------------------------------------------


def _gmm_padded(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm` semantics with padded bmm: a [S, K] x b [E, K, N] -> [S, N] per group of rows,
    or a [K, S] x b [S, N] -> [E, K, N] per group of columns (weight gradients)."""
    n_groups = offs.numel()
    ends = offs.long()
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    sizes = ends - starts
    total = int(ends[-1]) if n_groups else 0
    cap = max(int(sizes.max()) if n_groups else 0, 1)
    rows = torch.arange(total, device=a.device)
    group = torch.repeat_interleave(torch.arange(n_groups, device=a.device), sizes)
    pos = rows - starts[group]
    if b.dim() == 3:
        pad = a.new_zeros(n_groups, cap, a.shape[1])
        pad[group, pos] = a[:total]
        out = torch.bmm(pad, b)[group, pos]
        return torch.cat([out, out.new_zeros(a.shape[0] - total, out.shape[1])])
    pad_a = a.new_zeros(n_groups, cap, a.shape[0])
    pad_a[group, pos] = a.t()[:total]
    pad_b = b.new_zeros(n_groups, cap, b.shape[1])
    pad_b[group, pos] = b[:total]
    return torch.bmm(pad_a.transpose(1, 2), pad_b)


_GMM_OK: dict[tuple, bool] = {}  # (device type, dtype) -> torch's grouped kernel runs there


def _gmm_aligned(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch._grouped_mm wants 16-byte aligned pointers and strides (and output rows)."""
    es = a.element_size()
    return (
        all(st * es % 16 == 0 for t in (a, b) for st in t.stride() if st != 1)
        and b.shape[-1] * es % 16 == 0
        and a.data_ptr() % 16 == 0
        and b.data_ptr() % 16 == 0
    )


def _gmm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Grouped matmul: torch's kernel where this device/dtype/layout supports it, else padded bmm."""
    key = (a.device.type, a.dtype)
    if _GMM_OK.get(key, hasattr(torch, "_grouped_mm")) and _gmm_aligned(a, b):
        try:
            out = torch._grouped_mm(a, b, offs=offs)
            _GMM_OK[key] = True
            return out
        except (RuntimeError, NotImplementedError):
            if _GMM_OK.get(key):  # worked before on this device/dtype: a real error
                raise
            _GMM_OK[key] = False
    return _gmm_padded(a, b, offs)


# ---- the experts ---------------------------------------------------------------


def _tiles(counts_E: list[int], tile_slots: int) -> list[tuple[int, int, int, int]]:
    """Split experts (in order) into ranges of about `tile_slots` slots: (e0, e1, s0, s1)."""
    tiles, e0, s0, acc = [], 0, 0, 0
    for e, c in enumerate(counts_E):
        acc += c
        if acc >= tile_slots or e == len(counts_E) - 1:
            tiles.append((e0, e + 1, s0, s0 + acc))
            e0, s0, acc = e + 1, s0 + acc, 0
    return tiles


def _grouped_forward(x_ND, w_S, w_gate_up_EDG, w_down_EFD, tok_S, counts_E, tiles, keep: bool):
    """The experts over slots sorted by expert, tile by tile; with `keep`, what the backward needs per tile."""
    Fh = w_down_EFD.shape[1]
    y_ND = torch.zeros_like(x_ND)
    saved = []
    for e0, e1, s0, s1 in tiles:
        if s1 == s0:
            continue
        offs = counts_E[e0:e1].cumsum(0, dtype=torch.int32)
        tok = tok_S[s0:s1]
        xs_SD = x_ND.index_select(0, tok)
        h_SG = _gmm(xs_SD, w_gate_up_EDG[e0:e1], offs)
        silu_SF = F.silu(h_SG[:, :Fh])
        a_SF = torch.mul(silu_SF, h_SG[:, Fh:]).mul_(w_S[s0:s1, None])
        y_ND.index_add_(0, tok, _gmm(a_SF, w_down_EFD[e0:e1], offs))
        if keep:
            saved += [xs_SD, h_SG, silu_SF]
    return y_ND, saved


class _ExpertsFn(torch.autograd.Function):
    """y_ND = sum over slots s of w_s * SwiGLU_{expert(s)}(x_{tok(s)}), slots sorted by expert.

    Saves per tile the gathered input xs_SD, the gate/up pre-activations h_SG and silu(gate) (what autograd
    would keep for the same math, minus the activation product, recomputed in one pass).
    """

    @staticmethod
    def forward(ctx, x_ND, w_S, w_gate_up_EDG, w_down_EFD, tok_S, counts_E, tiles):
        keep = any(ctx.needs_input_grad[:4])  # inference keeps nothing
        y_ND, saved = _grouped_forward(x_ND, w_S, w_gate_up_EDG, w_down_EFD, tok_S, counts_E, tiles, keep)
        ctx.save_for_backward(x_ND, w_S, w_gate_up_EDG, w_down_EFD, tok_S, counts_E, *saved)
        ctx.tiles = tiles
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        x_ND, w_S, w_gate_up_EDG, w_down_EFD, tok_S, counts_E, *saved = ctx.saved_tensors
        dy_ND = dy_ND.contiguous()
        Fh = w_down_EFD.shape[1]
        dx_ND = torch.zeros_like(x_ND)
        dw_S = torch.empty_like(w_S)
        dw_gate_up = torch.empty_like(w_gate_up_EDG)
        dw_down = torch.empty_like(w_down_EFD)
        i = 0
        for e0, e1, s0, s1 in ctx.tiles:
            if s1 == s0:  # experts nobody was routed to
                dw_gate_up[e0:e1] = 0
                dw_down[e0:e1] = 0
                continue
            xs_SD, h_SG, silu_SF = saved[i : i + 3]
            i += 3
            offs = counts_E[e0:e1].cumsum(0, dtype=torch.int32)
            tok = tok_S[s0:s1]
            w = w_S[s0:s1, None]
            g_SF, u_SF = h_SG[:, :Fh], h_SG[:, Fh:]
            dys_SD = dy_ND.index_select(0, tok)
            da_SF = _gmm(dys_SD, w_down_EFD[e0:e1].transpose(1, 2), offs)  # d(activation), before the weight
            a_SF = silu_SF * u_SF
            dw_S[s0:s1] = (da_SF * a_SF).sum(-1)
            dw_down[e0:e1] = _gmm(a_SF.mul_(w).t(), dys_SD, offs)
            da_SF.mul_(w)
            dh_SG = torch.empty_like(h_SG)
            torch.mul(da_SF, silu_SF, out=dh_SG[:, Fh:])
            torch.ops.aten.silu_backward.grad_input(da_SF.mul_(u_SF), g_SF, grad_input=dh_SG[:, :Fh])
            dw_gate_up[e0:e1] = _gmm(xs_SD.t(), dh_SG, offs)
            dx_ND.index_add_(0, tok, _gmm(dh_SG, w_gate_up_EDG[e0:e1].transpose(1, 2), offs))
        return dx_ND, dw_S, dw_gate_up, dw_down, None, None, None


class _NativeExpertsFn(torch.autograd.Function):
    """`_ExpertsFn` on CPU in fp32 through the native kernels (`kernels.moe_train`, csrc/moe_train.cpp), from the
    routing itself: the kernel sorts the slots, runs one task per expert on one core start to finish, and saves
    the gathered inputs and gate/up pre-activations in chunks of ~`chunk_slots` slots."""

    @staticmethod
    def forward(ctx, x_ND, weights_NK, w_gate_up_EDG, w_down_EFD, experts_NK, e0, chunk_slots):
        forward, _ = kernels.moe_train()
        y_ND, saved = forward(x_ND, experts_NK, weights_NK, w_gate_up_EDG, w_down_EFD, e0, chunk_slots)
        ctx.save_for_backward(x_ND, weights_NK, w_gate_up_EDG, w_down_EFD, experts_NK, *saved)
        ctx.e0, ctx.chunk_slots = e0, chunk_slots
        return y_ND

    @staticmethod
    def backward(ctx, dy_ND):
        _, backward = kernels.moe_train()
        x_ND, weights_NK, w_gate_up_EDG, w_down_EFD, experts_NK, *saved = ctx.saved_tensors
        grads = backward(
            dy_ND.contiguous(), x_ND, experts_NK, weights_NK, w_gate_up_EDG, w_down_EFD, ctx.e0, saved, ctx.chunk_slots
        )
        return *grads, None, None, None


@dataclass
class MoEOutput:
    y_ND: torch.Tensor
    experts_NK: torch.Tensor
    aux_loss: torch.Tensor | None  # None under torch.inference_mode()
    z_loss: torch.Tensor | None


class MoE(nn.Module):
    """Router + E stacked SwiGLU experts (+ optional shared experts). See the module docstring."""

    tile_slots: int = 2048  # CPU tiles (PyTorch path) and saved chunks (native kernel) in token-slots of whole experts

    def __init__(self, config: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__()
        self.config = config
        self.expert_range = expert_range or (0, config.n_experts)
        e0, e1 = self.expert_range
        if not 0 <= e0 < e1 <= config.n_experts:
            raise ValueError(f"expert_range {self.expert_range} must lie within [0, {config.n_experts}]")
        D, Fh = config.d_model, config.d_expert
        self.router = Router(config)
        self.w_gate_up_EDG = nn.Parameter(torch.empty(e1 - e0, D, 2 * Fh))
        self.w_down_EFD = nn.Parameter(torch.empty(e1 - e0, Fh, D))
        self.shared = None
        if config.n_shared_experts > 0 and e0 == 0:
            self.shared = SwiGLU(D, config.n_shared_experts * config.d_shared)

    def forward(self, x_ND: torch.Tensor, replay_NK: torch.Tensor | None = None) -> MoEOutput:
        """The router's choice and losses, then the chosen experts' weighted sum (+ the shared experts)."""
        r = self.router(x_ND, replay_NK)
        y_ND = self.experts(x_ND, r.experts_NK, r.weights_NK)
        if self.shared is not None:
            y_ND = y_ND + self.shared(x_ND)
        return MoEOutput(y_ND, r.experts_NK, r.aux_loss, r.z_loss)

    def experts(self, x_ND: torch.Tensor, experts_NK: torch.Tensor, weights_NK: torch.Tensor) -> torch.Tensor:
        """Dropless dispatch of every slot routed to this shard's experts; returns this shard's y_ND."""
        e0, e1 = self.expert_range
        if (
            x_ND.device.type == "cpu"
            and x_ND.dtype == torch.float32
            and self.w_gate_up_EDG.dtype == torch.float32
            and kernels.moe_train() is not None
        ):
            return _NativeExpertsFn.apply(
                x_ND.contiguous(),
                weights_NK.contiguous(),
                self.w_gate_up_EDG,
                self.w_down_EFD,
                experts_NK.contiguous(),
                e0,
                self.tile_slots,
            )
        K = experts_NK.shape[1]
        experts_S = experts_NK.reshape(-1)
        order_S = torch.argsort(experts_S, stable=True)
        counts_E = torch.bincount(experts_S, minlength=self.config.n_experts)
        local_E = counts_E[e0:e1]
        if (e0, e1) != (0, self.config.n_experts):
            start = int(counts_E[:e0].sum())
            order_S = order_S[start : start + int(local_E.sum())]
        tok_S = order_S // K
        w_S = weights_NK.reshape(-1)[order_S]
        if x_ND.device.type == "cpu":
            tiles = _tiles(local_E.tolist(), self.tile_slots)
        else:
            tiles = [(0, e1 - e0, 0, order_S.numel())]
        return _ExpertsFn.apply(x_ND.contiguous(), w_S, self.w_gate_up_EDG, self.w_down_EFD, tok_S, local_E, tiles)

    def update_bias(self) -> None:
        self.router.update_bias()
