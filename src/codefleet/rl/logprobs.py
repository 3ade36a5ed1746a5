"""The trainer's view of a rollout: per-token logprobs under the model, with or without routing replay.

`forward_logprobs(model, tokens_BT, mask_BT)` runs the Transformer once and
returns `logprobs_BT[b, t] = log p(tokens[b, t] | tokens[b, :t])`, aligned
with the tokens (position 0 has no prediction and reads 0) and zeroed where
`mask_BT` is 0, so it lines up with the engine's per-token logprobs
(`Turn.logprobs`) and the loss mask without shifting. Rows are right-padded;
positions are 0..T-1.

Routing replay (R3): the engine records, for every token it processed, the
experts each MoE layer routed it to. `Turn.routed_experts[i]` is token i's
experts flattened layer-major, `[layer0 top_k..., layer1 top_k..., ...]`
(the engine's `Result.routed_experts[i]` is the same nested `[layer][top_k]`).
The model's `routing_replay` wants one `[B, T, top_k]` int64 tensor per MoE
layer, the experts of the token *at* position t (the routing computed when
that token is the input). `routing_replay_tensors` does that conversion:

    per_token[b][t] -> [L * K] (or [L][K])  ->  stacked [B, T, L, K]  ->  [x[:, :, l] for l in range(L)]

Positions a row lacks (padding, or tokens without a record) get experts
0..K-1: any valid choice, since their outputs are masked out and a token's
routing only changes that token's own output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LogprobOutput:
    logprobs_BT: torch.Tensor  # fp32, 0 at t = 0 and where mask is 0
    aux_loss: torch.Tensor
    z_loss: torch.Tensor


def routing_replay_tensors(
    per_token: list[list[list[int]] | list[list[list[int]]]], n_moe_layers: int, top_k: int, T: int | None = None
) -> list[torch.Tensor]:
    """Engine routing per row, per token (flat layer-major [L*K] or nested [L][K]) -> L tensors [B, T, K]."""
    B = len(per_token)
    T = T if T is not None else max((len(row) for row in per_token), default=0)
    routing_BTLK = torch.arange(top_k, dtype=torch.long).expand(B, T, n_moe_layers, top_k).clone()
    for b, row in enumerate(per_token):
        if len(row) > T:
            raise ValueError(f"row {b} has routing for {len(row)} tokens, more than T={T}")
        if row:
            r = torch.tensor(row, dtype=torch.long)
            if r.numel() != len(row) * n_moe_layers * top_k:
                raise ValueError(
                    f"row {b}: each token needs {n_moe_layers} MoE layers x top_k {top_k} experts, "
                    f"got {r.numel() // len(row)} per token"
                )
            routing_BTLK[b, : len(row)] = r.view(len(row), n_moe_layers, top_k)
    return [routing_BTLK[:, :, layer] for layer in range(n_moe_layers)]


def forward_logprobs(
    model,
    tokens_BT: torch.Tensor,
    mask_BT: torch.Tensor | None = None,
    routing_replay: list[torch.Tensor] | None = None,
    fast=None,
) -> LogprobOutput:
    """Logprob of each token given those before it (aligned with tokens_BT), and the model's router losses.
    `fast`: the inference fast path to score through with gradients off (`Transformer.forward`)."""
    B, T = tokens_BT.shape
    positions_BT = torch.arange(T, device=tokens_BT.device).expand(B, T)
    next_BT = torch.cat([tokens_BT[:, 1:], tokens_BT[:, :1]], dim=1)  # the last column is never used
    # position t predicts token t + 1: the model wrote that target where mask_BT[t + 1] is 1
    turn_mask_BT = None if mask_BT is None else F.pad(mask_BT[:, 1:] > 0, (0, 1))
    out = model(
        tokens_BT,
        positions_BT=positions_BT,
        routing_replay=routing_replay,
        targets_BT=next_BT,
        turn_mask_BT=turn_mask_BT,
        fast=fast,
    )
    first_B1 = torch.zeros(B, 1, device=tokens_BT.device)
    logprobs_BT = torch.cat([first_B1, out.target_logprobs_BT[:, :-1]], dim=1)
    if mask_BT is not None:
        logprobs_BT = logprobs_BT * mask_BT.to(logprobs_BT.dtype)
    return LogprobOutput(logprobs_BT, out.aux_loss, out.z_loss)
