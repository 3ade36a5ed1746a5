"""Rollouts as a training batch, and the RL loss of one batch under the model.

A `Sample` is one token sequence the policy is trained on: all the tokens of
an episode (prompt, the turns the engine sampled, tool results) with
`loss_mask` 1 on the tokens the policy sampled, the engine's logprob of each
token (`behave_logprobs`, read only where the mask is 1), optionally the
engine's routing of each token (`routed_experts[t]`, flat layer-major as in
`Turn.routed_experts`, or nested `[layer][top_k]`) and the episode's
advantage. `collate` right-pads samples into an `RLBatch`; `rl_loss` runs
`forward_logprobs` (replaying the engine's routing when asked and recorded)
and `losses.policy_loss`, and adds the MoE router losses.

Proximal and reference logprobs, when the loss needs them, come from
`forward_logprobs` under `torch.no_grad()` with the proximal / reference
weights, over the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from codefleet.rl.logprobs import forward_logprobs, routing_replay_tensors
from codefleet.rl.losses import LossConfig, add_moe_losses, policy_loss


@dataclass
class Sample:
    tokens: list[int]
    loss_mask: list[int]
    behave_logprobs: list[float]
    advantage: float
    routed_experts: list[list[int]] | None = None


@dataclass
class RLBatch:
    tokens_BT: torch.Tensor  # int64, right-padded with 0
    mask_BT: torch.Tensor  # float 0/1: the sampled tokens trained on
    behave_logprobs_BT: torch.Tensor  # fp32, 0 where mask is 0
    advantages_B: torch.Tensor  # fp32
    routing_replay: list[torch.Tensor] | None  # one [B, T, top_k] per MoE layer, when every sample has routing


def collate(samples: list[Sample], n_moe_layers: int | None = None, top_k: int | None = None) -> RLBatch:
    """Right-pad samples into a batch; routing is kept only when every sample has it and the MoE shape is given."""
    if not samples:
        raise ValueError("collate needs at least one sample")
    for i, s in enumerate(samples):
        if not (len(s.tokens) == len(s.loss_mask) == len(s.behave_logprobs)):
            raise ValueError(
                f"sample {i}: tokens, loss_mask and behave_logprobs must have the same length, got "
                f"{len(s.tokens)}, {len(s.loss_mask)}, {len(s.behave_logprobs)}"
            )
        if s.loss_mask and s.loss_mask[0]:
            raise ValueError(f"sample {i}: the first token has no prediction to train; its loss_mask must be 0")
    B, T = len(samples), max(len(s.tokens) for s in samples)
    tokens_BT = torch.zeros(B, T, dtype=torch.long)
    mask_BT = torch.zeros(B, T)
    behave_BT = torch.zeros(B, T)
    for b, s in enumerate(samples):
        n = len(s.tokens)
        tokens_BT[b, :n] = torch.tensor(s.tokens)
        mask_BT[b, :n] = torch.tensor(s.loss_mask, dtype=torch.float32)
        behave_BT[b, :n] = torch.tensor(s.behave_logprobs, dtype=torch.float32)
    behave_BT = behave_BT * mask_BT
    routing = None
    if n_moe_layers and top_k and all(s.routed_experts is not None for s in samples):
        routing = routing_replay_tensors([s.routed_experts for s in samples], n_moe_layers, top_k, T)
    advantages_B = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return RLBatch(tokens_BT, mask_BT, behave_BT, advantages_B, routing)


def rl_loss(
    model,
    batch: RLBatch,
    config: LossConfig | None = None,
    routing_replay: bool = False,
    prox_logprobs_BT: torch.Tensor | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss + router losses of a batch under the model, and metrics (policy metrics, aux_loss, z_loss)."""
    if routing_replay and batch.routing_replay is None:
        raise ValueError(
            "routing_replay=True but the batch has no routing: collate with n_moe_layers and top_k, "
            "from samples that carry the engine's routed_experts"
        )
    out = forward_logprobs(model, batch.tokens_BT, batch.mask_BT, batch.routing_replay if routing_replay else None)
    loss, metrics = policy_loss(
        out.logprobs_BT,
        batch.behave_logprobs_BT,
        batch.advantages_B,
        batch.mask_BT,
        config,
        prox_logprobs_BT=prox_logprobs_BT,
        ref_logprobs_BT=ref_logprobs_BT,
    )
    metrics.update(aux_loss=float(out.aux_loss.detach()), z_loss=float(out.z_loss.detach()))
    return add_moe_losses(loss, out), metrics
