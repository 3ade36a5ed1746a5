"""Expert parallelism (EP) for the MoE layer: experts split across ranks, token-slots moved by all-to-all.

    ep_moe = ExpertParallelMoE.from_moe(moe, group)   # this rank keeps experts [r*E/W, (r+1)*E/W)
    out = ep_moe(x_ND, replay_NK)                     # the same MoEOutput as moe(x_ND, replay_NK)
    parallelize_experts(model, group)                 # every MoE layer of a Transformer, in place
                                                      # (rl.sharded's "fsdp2_ep" trainer does this)

Every rank holds its own tokens (the ranks are also data-parallel) and the
replicated router and shared experts; of the E routed experts it holds
E / W (W = ranks in `group`), rank r the block [r*E/W, (r+1)*E/W). A forward:

1. route locally: the router's top-k, or with routing replay (R3) exactly
   the given experts, as `MoE` does (it is the same `Router`);
2. dispatch: the S = N*K token-slots are sorted by expert (stable), hence by
   owning rank; the per-rank counts are exchanged (one all-to-all of W
   integers), then each slot's input row and global expert id travel to
   the owner (`all_to_all_single` with those split sizes);
3. compute: the owner runs its experts over the rows it received, each row
   one token-slot of weight 1, with `MoE.experts` (the same grouped kernels,
   dropless: no capacity, no slot dropped or padded);
4. combine: the results return by the reverse all-to-all into the sender's
   slot order; the sender multiplies by the router's combine weights, sums
   over the K slots of each token, and adds its shared experts.

Autograd: `_AllToAll`'s backward is the reverse all-to-all of the gradient
(split sizes swapped), so the gradient of each expert's weights on its owner
sums every rank's tokens, and each token's input gradient comes home. The
expert weights are therefore not replicated and need no gradient reduction
across the EP group; the router and the shared experts are replicated and
their gradients are reduced by the data parallelism around the layer
(FSDP2 in `rl.sharded`, or an all-reduce). The router's load counts
(`balance="bias"`) are per rank, summed by the trainer as for data parallelism.

Against the unsharded layer the only difference in the math is where the
combine weight is applied (after the down projection instead of before it):
equal to fp32 rounding (tests: 1e-5, forward and gradients, with and without
replay). Every rank must run the same number of forwards and backwards (the
all-to-alls are collectives), including a rank with no tokens.

The inference fast path (`codefleet.inference.fast`) reads the MoE weights
directly and would see only this rank's experts: score an EP model through
the model's own code (`rl.sharded` does); the engine never holds EP shards.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from codefleet.model.config import ModelConfig
from codefleet.model.moe import MoE, MoEOutput, SwiGLU


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows `in_splits[r]` of `x` (in rank order) go to rank r; the result stacks `out_splits[r]` rows from r."""
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """`_all_to_all` whose backward is the reverse all-to-all of the gradient."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.out_splits, ctx.in_splits, ctx.group = out_splits, in_splits, group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_to_all(dy, ctx.in_splits, ctx.out_splits, ctx.group), None, None, None


class ExpertParallelMoE(MoE):
    """`MoE` with this rank's block of experts and all-to-all dispatch. See the module docstring."""

    def __init__(self, config: ModelConfig, group=None):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        if config.n_experts % world:
            raise ValueError(
                f"expert parallelism over {world} ranks needs n_experts ({config.n_experts}) divisible "
                f"by {world}: choose an EP size that divides it"
            )
        per_rank = config.n_experts // world
        super().__init__(config, expert_range=(rank * per_rank, (rank + 1) * per_rank))
        self.group, self.world = group, world
        if config.n_shared_experts > 0 and self.shared is None:  # replicated on every rank, like the router
            self.shared = SwiGLU(config.d_model, config.n_shared_experts * config.d_shared)

    @classmethod
    @torch.no_grad()
    def from_moe(cls, moe: MoE, group=None) -> ExpertParallelMoE:
        """This rank's shard of an unsharded `MoE` (router and shared experts copied, its experts sliced)."""
        if moe.expert_range != (0, moe.config.n_experts):
            raise ValueError(f"from_moe needs an unsharded MoE, got expert_range {moe.expert_range}")
        ep = cls(moe.config, group).to(device=moe.w_down_EFD.device, dtype=moe.w_down_EFD.dtype)
        e0, e1 = ep.expert_range
        ep.router.load_state_dict(moe.router.state_dict())
        ep.w_gate_up_EDG.copy_(moe.w_gate_up_EDG[e0:e1])
        ep.w_down_EFD.copy_(moe.w_down_EFD[e0:e1])
        if moe.shared is not None:
            ep.shared.load_state_dict(moe.shared.state_dict())
        return ep.train(moe.training)

    def forward(self, x_ND: torch.Tensor, replay_NK: torch.Tensor | None = None) -> MoEOutput:
        N, D = x_ND.shape
        r = self.router(x_ND, replay_NK)
        K = r.experts_NK.shape[1]
        per_rank = self.w_down_EFD.shape[0]
        experts_S = r.experts_NK.reshape(-1)
        order_S = torch.argsort(experts_S, stable=True)  # by expert, hence by owning rank
        send_W = torch.bincount(experts_S // per_rank, minlength=self.world)
        recv_W = torch.empty_like(send_W)
        dist.all_to_all_single(recv_W, send_W, group=self.group)
        send, recv = send_W.tolist(), recv_W.tolist()
        x_RD = _AllToAll.apply(x_ND.index_select(0, order_S // K), recv, send, self.group)
        experts_R = _all_to_all(experts_S[order_S], recv, send, self.group)
        if experts_R.numel():
            y_RD = self.experts(x_RD, experts_R[:, None], torch.ones_like(x_RD[:, :1]))
        else:  # nothing routed here: still part of the graph, so the backward runs its all-to-all too
            y_RD = x_RD * 0
        y_sorted_SD = _AllToAll.apply(y_RD, send, recv, self.group)
        y_SD = y_sorted_SD[torch.argsort(order_S)]  # back to slot order
        y_ND = (y_SD.view(N, K, D) * r.weights_NK[:, :, None]).sum(1)
        if self.shared is not None:
            y_ND = y_ND + self.shared(x_ND)
        return MoEOutput(y_ND, r.experts_NK, r.aux_loss, r.z_loss)


def parallelize_experts(model: nn.Module, group=None) -> nn.Module:
    """Replace every MoE layer of a `Transformer` by its `ExpertParallelMoE` shard, in place; returns the model."""
    for block in model.layers:
        if block.is_moe and not isinstance(block.ffn, ExpertParallelMoE):
            block.ffn = ExpertParallelMoE.from_moe(block.ffn, group)
    return model
