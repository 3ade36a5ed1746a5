"""Copying tokens from the context: previous-token embeddings and the copy head (`ModelConfig.copy`).

A coding policy mostly writes names it has read: a path from the task, a
function from a tool result. Two optional parts of the model make that
lookup direct instead of something a small model must first grow:

- `PrevTokenEmbeddings` (`CopyConfig.prev_tokens` = K > 0): the input at t is
  `embed(x_t) + sum_{i=1..K} embed_prev[i-1](x_{t-i})`, one table per offset
  with a row of its own (index `vocab_size`) for "before the sequence's
  start" (a short convolution over token identities, like a token shift).
  Attention then finds "the position after the previous occurrence of this
  token" in one layer, instead of first building a previous-token head.
- `CopyHead` (`CopyConfig.head`): the output is a pointer-generator mixture
  (See et al., 2017),
  `p(w) = (1 - g_t) softmax(lm_head(h_t))_w + g_t sum_{s <= t: x_s = w} a_ts`,
  where `a_t` is one attention of the last hidden state over the context's
  last hidden states (`head_dim` wide, no rotary embedding) and
  `g_t = sigmoid(gate(h_t))`. Its logits are `log p`, so sampling, logprobs
  and losses are unchanged. With a cache, `cache.copy_context` keeps each
  position's copy key and token.

docs/models/codefleet-moe.md says what each does, and docs/experiments/ what each measured.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from codefleet.model.copy_config import CopyConfig


class PrevTokenEmbeddings(nn.ModuleList):
    """One embedding table per offset i = 1..K, of `vocab_size + 1` rows (the last: before the sequence's start)."""

    def __init__(self, n_prev: int, vocab_size: int, d_model: int):
        super().__init__(nn.Embedding(vocab_size + 1, d_model) for _ in range(n_prev))
        self.vocab_size = vocab_size

    def forward(
        self, x_BTD: torch.Tensor, tokens_BT: torch.Tensor, prev_BK: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`x_BTD` plus, at each t, the embeddings of the K tokens before it. `prev_BK`: the K tokens before
        each row's first one, oldest first (`vocab_size` where there is none); None when the rows start their
        sequences."""
        K = len(self)
        B, T = tokens_BT.shape
        if prev_BK is None:
            prev_BK = tokens_BT.new_full((B, K), self.vocab_size)
        elif prev_BK.shape != (B, K):
            raise ValueError(
                f"prev_BK has shape {tuple(prev_BK.shape)}; this model needs the {K} tokens before "
                f"each of the {B} rows, [{B}, {K}]"
            )
        ids = torch.cat([prev_BK.to(tokens_BT.device), tokens_BT], dim=1)  # [B, K + T]
        for i, table in enumerate(self, 1):
            x_BTD = x_BTD + table(ids[:, K - i : K - i + T])
        return x_BTD


class CopyHead(nn.Module):
    """Pointer-generator output (`CopyConfig.head`): mixes the LM head's distribution with one attention of
    the last hidden state over the context's hidden states, whose weight on position s goes to token x_s.
    Returns the mixture's log-probabilities, which every consumer can treat as logits."""

    def __init__(self, config: CopyConfig, d_model: int, head_dim: int, vocab_size: int):
        super().__init__()
        self.scope = config.scope
        self.scale = head_dim**-0.5
        self.wq = nn.Linear(d_model, head_dim, bias=False)
        self.wk = nn.Linear(d_model, head_dim, bias=False)
        self.gate = nn.Linear(d_model, 1)
        # config.match: score bonus where the 1 (2) tokens before a context position equal the query's last
        self.match_w = nn.Parameter(torch.empty(2)) if config.match else None  # 2.0 (Transformer.reset_parameters)
        # config.blocked: tokens it never points at (unless a query's context holds nothing else)
        copyable_V = None
        if config.blocked:
            copyable_V = torch.ones(vocab_size, dtype=torch.bool)
            copyable_V[config.blocked] = False
        self.register_buffer("copyable_V", copyable_V, persistent=False)

    def forward(
        self,
        logits_BTV: torch.Tensor,
        hq_BTD: torch.Tensor,
        hk_BSD: torch.Tensor,
        tokens_BS: torch.Tensor,
        cache=None,
        at_B: torch.Tensor | None = None,
        turn_mask_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`hq_BTD`: the hidden states that predict (those of `logits_BTV`); `hk_BSD`, `tokens_BS`: every new
        position's hidden state and token. Without a cache the context is `tokens_BS` (causal; `at_B`: the one
        query position of each row; `turn_mask_BT`: the turns, for scope "prompt"); with one,
        `cache.copy_context` stores the new keys and tokens and returns each row's visible history."""
        end_BT = self.context_ends(turn_mask_BT, cache, at_B)
        attn_BTL, tokens_BL = self._attention(hq_BTD, hk_BSD, tokens_BS, cache, at_B, end_BT)
        B, T, V = logits_BTV.shape
        p_copy_BTV = attn_BTL.new_zeros(B, T, V).scatter_add_(
            2, tokens_BL[:, None, :].expand(B, T, tokens_BL.shape[1]), attn_BTL
        )
        gate_BT1 = self.gate(hq_BTD).float()
        return _mix(gate_BT1, torch.log_softmax(logits_BTV.float(), dim=-1), p_copy_BTV).to(logits_BTV.dtype)

    def target_logprobs(
        self,
        logits_BTV: torch.Tensor,
        h_BTD: torch.Tensor,
        tokens_BT: torch.Tensor,
        targets_BT: torch.Tensor,
        turn_mask_BT: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """log p(targets) under the mixture, `[B, T]` (fp32), without a `[B, T, V]` copy distribution: the
        copy share of a target is the attention on the positions that hold it (training: no cache)."""
        attn_BTS, _ = self._attention(h_BTD, h_BTD, tokens_BT, end_BT=self.context_ends(turn_mask_BT))
        p_copy_BT = (attn_BTS * (tokens_BT[:, None, :] == targets_BT[:, :, None])).sum(-1)
        generator_BT = torch.log_softmax(logits_BTV.float(), dim=-1).gather(-1, targets_BT[..., None])[..., 0]
        return _mix(self.gate(h_BTD).float()[..., 0], generator_BT, p_copy_BT)

    def context_ends(
        self, turn_mask_BT: torch.Tensor | None, cache=None, at_B: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """Where each query's context ends (exclusive) for scope "prompt" without a cache (`copy_ends`, at
        `at_B` if given: `[B, 1]`); None where every query sees its whole past (the cache keeps its own ends)."""
        if self.scope != "prompt" or cache is not None:
            return None
        if turn_mask_BT is None:
            raise ValueError(
                "this model's copy head points only before the current turn (copy scope 'prompt'): "
                "give turn_mask_BT, True where the target is a token the model wrote"
            )
        end_BT = copy_ends(turn_mask_BT)
        if at_B is not None:
            end_BT = end_BT[torch.arange(end_BT.shape[0], device=end_BT.device), at_B][:, None]
        return end_BT

    def _attention(
        self, hq_BTD, hk_BSD, tokens_BS, cache=None, at_B=None, end_BT=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The copy attention `[B, T, L]` (fp32) and the token at each of its `L` positions, `[B, L]`."""
        q_BTD, k_BSD = self.wq(hq_BTD), self.wk(hk_BSD)
        if cache is not None:
            k_BLD, tokens_BL, visible_BTL, query_pos_BT = cache.copy_context(k_BSD, tokens_BS, at_B)
        else:
            B, S = tokens_BS.shape
            positions_S = torch.arange(S, device=tokens_BS.device)
            query_pos_BT = positions_S.expand(B, S) if at_B is None else at_B[:, None]
            k_BLD, tokens_BL = k_BSD, tokens_BS
            visible_BTL = positions_S <= query_pos_BT[..., None]  # [B, T, S]
            if end_BT is not None:
                visible_BTL = visible_BTL & (positions_S < end_BT[..., None])
        if self.copyable_V is not None:
            only_BTL = visible_BTL & self.copyable_V[tokens_BL][:, None, :]
            visible_BTL = torch.where(only_BTL.any(-1, keepdim=True), only_BTL, visible_BTL)
        scores_BTL = torch.matmul(q_BTD, k_BLD.transpose(1, 2)).float() * self.scale
        if self.match_w is not None:
            scores_BTL = scores_BTL + self._match_bonus(tokens_BL, query_pos_BT)
        return torch.softmax(scores_BTL.masked_fill(~visible_BTL, float("-inf")), dim=-1), tokens_BL

    def _match_bonus(self, tokens_BL: torch.Tensor, query_pos_BT: torch.Tensor) -> torch.Tensor:
        """`[B, T, L]`: w1 where the token before position l is the query's token, + w2 where the one before
        that is the query's previous token too (config.match)."""
        L = tokens_BL.shape[1]
        before1_BL, before2_BL = (F.pad(tokens_BL, (k, 0), value=-1)[:, :L] for k in (1, 2))
        one_BTL = before1_BL[:, None, :] == tokens_BL.gather(1, query_pos_BT)[..., None]
        two_BTL = one_BTL & (before2_BL[:, None, :] == before1_BL.gather(1, query_pos_BT)[..., None])
        return self.match_w[0] * one_BTL + self.match_w[1] * two_BTL


def copy_ends(turn_mask_BT: torch.Tensor) -> torch.Tensor:
    """Where each query's copy context ends (exclusive), `[B, T]`, for scope "prompt".

    `turn_mask_BT` is True where position t's target is a token the model wrote (the loss mask). A run of such
    positions t0..t1 is one turn, generated from the prompt `tokens[:t0 + 1]`: its queries see positions
    `<= t0`. Any other query sees its whole past (`<= t`)."""
    mask = turn_mask_BT.bool()
    t_BT = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    continues = mask & F.pad(mask[:, :-1], (1, 0))  # inside a turn, not its first position
    return torch.where(continues, 0, t_BT).cummax(dim=1).values + 1


def _mix(gate: torch.Tensor, generator_logp: torch.Tensor, p_copy: torch.Tensor) -> torch.Tensor:
    """log((1 - g) p_generator + g p_copy) with g = sigmoid(gate); a copy share of 0 stays finite."""
    return torch.logaddexp(F.logsigmoid(-gate) + generator_logp, F.logsigmoid(gate) + p_copy.clamp_min(1e-30).log())
