"""Supervised fine-tuning on expert trajectories: cross-entropy on the assistant's tokens only.

A conversation is encoded by its checkpoint's chat format
(`formats.of(tokenizer).encode_chat_with_mask`) into `(ids, mask)`, mask 1
on the tokens the assistant wrote. `pad_batch` turns a list of them
into a right-padded batch for next-token prediction:

    tokens_BT   = ids[:-1]   (inputs)
    targets_BT  = ids[1:]    (what each position predicts)
    loss_mask_BT = mask[1:]  (a target counts when the assistant wrote it)
    positions_BT = 0..T-1

Right padding needs no attention mask: attention is causal, so padding after
a row's last token never changes that row's real positions, and padding has
loss mask 0. `sft_loss` is the token mean over every masked target of the
batch; `sft_step_loss` runs the model and adds its MoE router losses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from codefleet.rl.losses import add_moe_losses, masked_reduce


@dataclass
class SFTBatch:
    tokens_BT: torch.Tensor  # int64 inputs
    targets_BT: torch.Tensor  # int64, tokens shifted left by one
    loss_mask_BT: torch.Tensor  # float 0/1 on the targets
    positions_BT: torch.Tensor  # int64 0..T-1


def pad_batch(examples: list[tuple[list[int], list[int]]], pad_id: int = 0) -> SFTBatch:
    """A right-padded next-token batch from (ids, mask) pairs (mask 1 where the assistant wrote the token)."""
    if not examples:
        raise ValueError("pad_batch needs at least one (ids, mask) example")
    for ids, mask in examples:
        if len(ids) != len(mask) or len(ids) < 2:
            raise ValueError(f"each example needs ids and mask of the same length >= 2, got {len(ids)} and {len(mask)}")
    B, T = len(examples), max(len(ids) for ids, _ in examples) - 1
    tokens_BT = torch.full((B, T), pad_id, dtype=torch.long)
    targets_BT = torch.full((B, T), pad_id, dtype=torch.long)
    loss_mask_BT = torch.zeros(B, T)
    for b, (ids, mask) in enumerate(examples):
        n = len(ids) - 1
        tokens_BT[b, :n] = torch.tensor(ids[:-1])
        targets_BT[b, :n] = torch.tensor(ids[1:])
        loss_mask_BT[b, :n] = torch.tensor(mask[1:], dtype=torch.float32)
    positions_BT = torch.arange(T).expand(B, T).contiguous()
    return SFTBatch(tokens_BT, targets_BT, loss_mask_BT, positions_BT)


def sft_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, loss_mask_BT: torch.Tensor) -> torch.Tensor:
    """Token-mean cross-entropy (fp32) over the targets where loss_mask is 1."""
    ce_BT = F.cross_entropy(logits_BTV.float().flatten(0, 1), targets_BT.flatten(), reduction="none").view_as(
        targets_BT
    )
    return masked_reduce(ce_BT, loss_mask_BT, "token_mean")


def sft_step_loss(model, batch: SFTBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Forward the batch; the loss to backpropagate (cross-entropy + router losses) and metrics."""
    out = model(
        batch.tokens_BT,
        positions_BT=batch.positions_BT,
        targets_BT=batch.targets_BT,
        turn_mask_BT=batch.loss_mask_BT > 0,
    )
    ce = masked_reduce(-out.target_logprobs_BT, batch.loss_mask_BT, "token_mean")
    loss = add_moe_losses(ce, out)
    return loss, {
        "ce": float(ce.detach()),
        "aux_loss": float(out.aux_loss.detach()),
        "z_loss": float(out.z_loss.detach()),
        "tokens": int(batch.loss_mask_BT.sum()),
    }
