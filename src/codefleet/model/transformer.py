"""The decoder-only mixture-of-experts transformer: the model's math.

    tokens_BT -> embed (+ previous tokens' embeddings)
              -> n_layers x [x + attn(norm(x)); x + ffn(norm(x))] -> norm -> lm_head -> logits_BTV
                                                                       (-> copy head: log of a mixture)

- RMSNorm (pre-norm), rotary position embeddings (`rope.py`) on explicit
  `positions_BT` (the engine passes each row's own positions; training uses
  0..T-1). cos and sin come from a table computed once per model
  (`rotary_table`, indexed by position).
- Grouped-query attention: `n_heads` query heads share `n_kv_heads` key/value
  heads. Without a cache it is causal `scaled_dot_product_attention` over the
  given tokens (training, scoring). With a cache, `cache.attend(layer, q_BHTD,
  k_BHTD, v_BHTD)` stores the new keys/values and attends over each row's
  history (the engine's `cache.py` owns masking and storage); k/v carry
  `n_kv_heads` heads there.
- Feed-forward: the layers `config.is_moe` says are `moe.MoE`, the others
  (the first `first_dense_layers` and `dense_layers`) a dense SwiGLU.
- Qwen3's q/k norm (`qk_norm`): an RMSNorm over each query and key head
  (weights of size head_dim) before RoPE.
- Copying from the context (`config.copy`, `copying.py`): previous-token
  embeddings in the input (`prev_tokens`; a forward that continues a sequence
  passes the tokens before its first one as `prev_BK`) and the optional copy
  head, whose logits are the log of a pointer-generator mixture (with scope
  "prompt", training passes the turns' mask `turn_mask_BT`).

Fast paths: the caller chooses how the blocks and the LM head run. `forward(..., fast=None)` runs the
code here (training always does); the engine and the trainer's scoring pass `fast=codefleet.inference.fast`,
whose `blocks` and `lm_head` compute this math with gradients off (fused projections, a prepacked LM head,
native kernels), bit-identical or equal to float rounding as fast.py says of each (`FastPath`).

`forward` returns `ModelOutput(logits_BTV, routed_experts, aux_loss, z_loss)`:
`routed_experts` is one `[B, T, top_k]` int64 tensor per MoE layer when
`return_routing=True` (else None); `routing_replay` takes the same list to
force those experts (R3); `aux_loss` and `z_loss` are already scaled by their
coefficients and summed over MoE layers, so a trainer adds them to its loss
(under `torch.inference_mode()` they are not computed and read 0).

`token_logprobs(logits_BTV, targets_BT)` is the logprob every consumer
(engine, trainer, parity tests) computes the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyHead, PrevTokenEmbeddings
from codefleet.model.moe import MoE, MoEOutput, SwiGLU
from codefleet.model.rope import apply_rope_signed, rope_table


class RMSNorm(nn.Module):
    """`x / sqrt(mean(x^2) + eps) * weight`, the mean in fp32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # torch's op for the same expression, bit-identical to it in fp32 (tests/test_model_transformer.py)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads, self.head_dim = config.n_heads, config.n_kv_heads, config.head_dim
        D = config.d_model
        self.wq = nn.Linear(D, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(D, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.n_heads * self.head_dim, D, bias=False)
        self.q_norm = self.k_norm = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.norm_eps)

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """`cos`/`sin`: [B or 1, T, 1, head_dim] rows of the model's rotary table (`sin` signed: `rope_table`)."""
        B, T, _ = x_BTD.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        cos_, sin_ = cos.transpose(1, 2), sin.transpose(1, 2)
        q_BTHD, k_BTHD = self.wq(x_BTD).view(B, T, H, Dh), self.wk(x_BTD).view(B, T, Hkv, Dh)
        if self.q_norm is not None:
            q_BTHD, k_BTHD = self.q_norm(q_BTHD), self.k_norm(k_BTHD)
        q_BHTD = apply_rope_signed(q_BTHD.transpose(1, 2), cos_, sin_)
        k_BHTD = apply_rope_signed(k_BTHD.transpose(1, 2), cos_, sin_)
        v_BHTD = self.wv(x_BTD).view(B, T, Hkv, Dh).transpose(1, 2)
        return self.attend(q_BHTD, k_BHTD, v_BHTD, cache)

    def attend(self, q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor, cache=None) -> torch.Tensor:
        """Each query over the keys up to its own position (these tokens', or with a cache each row's history
        too), then the output projection: `[B, T, D]`."""
        B, H, T, Dh = q_BHTD.shape
        if cache is not None:
            out_BHTD = cache.attend(self.layer, q_BHTD, k_BHTD, v_BHTD)
        else:
            out_BHTD = F.scaled_dot_product_attention(
                q_BHTD, k_BHTD, v_BHTD, is_causal=True, enable_gqa=self.n_kv_heads != H
            )
        return self.wo(out_BHTD.transpose(1, 2).reshape(B, T, H * Dh))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.is_moe = config.is_moe(layer)
        self.ffn = MoE(config) if self.is_moe else SwiGLU(config.d_model, config.d_dense)

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache=None,
        replay_NK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, MoEOutput | None]:
        """`x + attn(norm(x))`, then `+ ffn(norm(.))`; and the MoE layer's output (routing, losses), None for a
        dense layer."""
        B, T, D = x_BTD.shape
        x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), cos, sin, cache)
        h_ND = self.ffn_norm(x_BTD).reshape(B * T, D)
        if not self.is_moe:
            return x_BTD + self.ffn(h_ND).view(B, T, D), None
        out = self.ffn(h_ND, replay_NK)
        return x_BTD + out.y_ND.view(B, T, D), out


class FastPath(Protocol):
    """Another implementation of the blocks and the LM head, for gradients off (`codefleet.inference.fast`)."""

    def blocks(
        self,
        model: Transformer,
        x_BTD: torch.Tensor,
        positions_BT: torch.Tensor,
        cache,
        routing_replay: list[torch.Tensor] | None,
        routed: list[torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    def lm_head(self, head: nn.Linear, h_BTD: torch.Tensor) -> torch.Tensor: ...


@dataclass
class ModelOutput:
    logits_BTV: torch.Tensor | None  # None when the forward was given targets_BT
    routed_experts: list[torch.Tensor] | None
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    target_logprobs_BT: torch.Tensor | None = None  # log p(targets_BT), when given


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig, init_weights: bool = True):
        """`init_weights=False` leaves the parameters as allocated (a loader that fills every one of them)."""
        super().__init__()
        self.config = config
        # without init: no normal_ (on the meta device it imports torch._dynamo, ~1.5 s and ~70 MB)
        self.embed = nn.Embedding(
            config.vocab_size,
            config.d_model,
            _weight=None if init_weights else torch.empty(config.vocab_size, config.d_model),
        )
        self.embed_prev = None
        if config.copy.prev_tokens:
            self.embed_prev = PrevTokenEmbeddings(config.copy.prev_tokens, config.vocab_size, config.d_model)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.copy = None
        if config.copy.head:
            self.copy = CopyHead(config.copy, config.d_model, config.head_dim, config.vocab_size)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if init_weights:
            self.reset_parameters()
        self.to(config.torch_dtype)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Normal(0, 0.02) everywhere; residual output projections scaled by 1/sqrt(2 * n_layers); the copy
        head's match weights 2."""
        out_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("copy.match_w"):
                p.fill_(2.0)  # a prior that a copy continues where the context matches
            elif name.endswith(("wo.weight", "down.weight", "w_down_EFD")):
                p.normal_(0.0, out_std)
            else:
                p.normal_(0.0, 0.02)

    def forward(
        self,
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor | None = None,
        cache=None,
        routing_replay: list[torch.Tensor] | None = None,
        return_routing: bool = False,
        logits_at_B: torch.Tensor | None = None,
        prev_BK: torch.Tensor | None = None,
        targets_BT: torch.Tensor | None = None,
        turn_mask_BT: torch.Tensor | None = None,
        fast: FastPath | None = None,
    ) -> ModelOutput:
        """`logits_at_B`: compute the logits only at that position of each row (`logits_BTV` is then
        [B, 1, V]); the engine's prefill needs only each prompt's last token, not a [B, T, V] head.
        `prev_BK`: the `prev_tokens` token ids before each row's first token, oldest first (`vocab_size`
        where the sequence has none); None when every row starts its sequence.
        `targets_BT`: return `target_logprobs_BT`, log p of each target (what training needs), instead of
        `logits_BTV`; with a copy head this skips the `[B, T, V]` copy distribution (no cache).
        `turn_mask_BT`: True where the target is a token the model wrote in a turn (the loss mask); a forward
        without a cache needs it when the copy head's scope is "prompt" (the copy head of those positions sees
        only the tokens before their turn, as the engine's did).
        `fast`: run the blocks and the LM head through it (`codefleet.inference.fast`; gradients off), not the
        code here."""
        cfg = self.config
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = torch.arange(T, device=tokens_BT.device).expand(B, T)
        if routing_replay is not None and len(routing_replay) != cfg.n_moe_layers:
            raise ValueError(
                f"routing_replay has {len(routing_replay)} entries; this model has "
                f"{cfg.n_moe_layers} MoE layers (one [B, T, top_k] tensor each)"
            )
        if prev_BK is None and cache is not None and cfg.copy.prev_tokens and bool((positions_BT[:, 0] > 0).any()):
            raise ValueError(
                "this forward continues cached sequences, so it needs prev_BK: the model's input "
                f"includes each token's {cfg.copy.prev_tokens} predecessors (config.copy.prev_tokens)"
            )
        if fast is not None and torch.is_grad_enabled():
            raise ValueError(
                "the fast path computes without gradients; call the model under torch.no_grad() or "
                "torch.inference_mode(), or leave fast unset to train"
            )
        x_BTD = self.embed_input(tokens_BT, prev_BK)
        routed: list[torch.Tensor] | None = [] if return_routing else None
        if fast is not None:
            x_BTD, aux, z = fast.blocks(self, x_BTD, positions_BT, cache, routing_replay, routed)
        else:
            x_BTD, aux, z = self.blocks(x_BTD, positions_BT, cache, routing_replay, routed)
        if self.copy is None:
            h_BTD = self.norm(x_BTD if logits_at_B is None else _at(x_BTD, logits_at_B))
        else:  # the copy head's keys: every position's final hidden state
            h_all_BTD = self.norm(x_BTD)
            h_BTD = h_all_BTD if logits_at_B is None else _at(h_all_BTD, logits_at_B)
        logits_BTV = fast.lm_head(self.lm_head, h_BTD) if fast is not None else self.lm_head(h_BTD)
        if targets_BT is not None:
            if cache is not None or logits_at_B is not None:
                raise ValueError(
                    "targets_BT is for a full forward over whole sequences (training), not with a cache or logits_at_B"
                )
            if self.copy is None:
                logp_BT = token_logprobs(logits_BTV, targets_BT)
            else:
                logp_BT = self.copy.target_logprobs(logits_BTV, h_BTD, tokens_BT, targets_BT, turn_mask_BT)
            return ModelOutput(None, routed, aux, z, logp_BT)
        if self.copy is not None:
            logits_BTV = self.copy(logits_BTV, h_BTD, h_all_BTD, tokens_BT, cache, logits_at_B, turn_mask_BT)
        return ModelOutput(logits_BTV, routed, aux, z)

    def blocks(
        self,
        x_BTD: torch.Tensor,
        positions_BT: torch.Tensor,
        cache=None,
        routing_replay: list[torch.Tensor] | None = None,
        routed: list | None = None,
        run_block: Callable = Block.__call__,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every block over `x_BTD`; the residual stream after them and the summed aux and z losses (0 under
        inference_mode). Appends each MoE layer's experts `[B, T, top_k]` to `routed` if given.
        `run_block(block, x_BTD, cos, sin, cache, replay_NK)` runs one block (`inference.fast.block`)."""
        cfg = self.config
        B, T, _ = x_BTD.shape
        n = int(positions_BT.max()) + 1 if positions_BT.device.type == "cpu" else cfg.max_seq_len
        cs_BT2_1D = self.rotary_table(n, x_BTD.device)[positions_BT]
        cos, sin = cs_BT2_1D[:, :, 0], cs_BT2_1D[:, :, 1]  # [B, T, 1, head_dim]
        aux = z = x_BTD.new_zeros((), dtype=torch.float32)
        moe_i = 0
        for block in self.layers:
            replay_NK = None
            if block.is_moe and routing_replay is not None:
                replay_NK = routing_replay[moe_i].reshape(B * T, cfg.top_k)
            x_BTD, out = run_block(block, x_BTD, cos, sin, cache, replay_NK)
            if out is None:
                continue
            if out.aux_loss is not None:  # None under inference_mode
                aux, z = aux + out.aux_loss, z + out.z_loss
            if routed is not None:
                routed.append(out.experts_NK.view(B, T, cfg.top_k))
            moe_i += 1
        return x_BTD, aux, z

    def embed_input(self, tokens_BT: torch.Tensor, prev_BK: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input: each token's embedding plus those of the `prev_tokens` tokens before it."""
        x_BTD = self.embed(tokens_BT)
        if self.embed_prev is None:
            return x_BTD
        return self.embed_prev(x_BTD, tokens_BT, prev_BK)

    def rotary_table(self, n_positions: int, device) -> torch.Tensor:
        """The rotary table [P, 2, 1, head_dim] (cos, signed sin) for P >= n_positions positions, computed once
        (a plain attribute, not a buffer: not in the checkpoint, never cast to a low-precision dtype)."""
        tab = getattr(self, "_rope_tab", None)
        if tab is None or tab.shape[0] < n_positions or tab.device != torch.device(device):
            n = max(n_positions, self.config.max_seq_len, 0 if tab is None else tab.shape[0])
            with torch.inference_mode(False), torch.no_grad():
                tab = rope_table(n, self.config.head_dim, self.config.rope_theta, device, self.config.rope_scaling)[
                    :, :, None
                ]
            self._rope_tab = tab
        return tab

    def update_router_bias(self) -> None:
        """Auxiliary-loss-free balancing: call after each optimiser step (no-op unless balance == "bias")."""
        if self.config.balance == "bias":
            for block in self.layers:
                if block.is_moe:
                    block.ffn.update_bias()

    def n_params(self, active: bool = False) -> int:
        """Parameters (tied weights once); `active=True` counts only top_k of the routed experts per MoE layer."""
        total = sum(p.numel() for p in {id(p): p for p in self.parameters()}.values())
        if active:
            cfg = self.config
            per_expert = 3 * cfg.d_model * cfg.d_expert
            total -= cfg.n_moe_layers * (cfg.n_experts - cfg.top_k) * per_expert
        return total


def _at(x_BTD: torch.Tensor, at_B: torch.Tensor) -> torch.Tensor:
    """Row b's vector at position `at_B[b]`, `[B, 1, D]`."""
    return x_BTD[torch.arange(x_BTD.shape[0], device=x_BTD.device), at_B][:, None]


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log p(targets) under the logits, in fp32: [B, T]."""
    return torch.log_softmax(logits_BTV.float(), dim=-1).gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
