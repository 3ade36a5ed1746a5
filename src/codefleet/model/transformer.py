"""The decoder-only mixture-of-experts transformer.

    tokens_BT -> embed (+ previous tokens' embeddings)
              -> n_layers x [x + attn(norm(x)); x + ffn(norm(x))] -> norm -> lm_head -> logits_BTV
                                                                       (-> copy head: log of a mixture)

- RMSNorm (pre-norm), rotary position embeddings on explicit `positions_BT`
  (the engine passes each row's own positions; training uses 0..T-1),
  rotate-half convention as in Llama/Qwen. cos and sin come from a table
  computed once per model (`rope_table`, indexed by position; no per-step
  trigonometry), with the rotate-half sign folded into sin.
- With gradients off (engine, reference logprobs) the q/k/v projections run as
  one GEMM over an inference-only concatenation of `wq`/`wk`/`wv` (rebuilt
  when a weight changes; the parameters and the checkpoint format are those of
  training). Both are bit-identical to the unfused computation in fp32. The
  LM head, a decode step's largest GEMM, runs on a oneDNN-prepacked copy of
  its weight (`weights.inference_linear`; equal to float rounding, ~1e-6). It comes
  after the last router, so the engine routes exactly as the trainer does.
- A decode step over the engine's slot cache (one new token per row, under
  `inference_mode`, fp32 on CPU) runs each block as native calls when the
  kernels are built (`decode.decode_blocks`, csrc/decode_layer.cpp): the same
  math to float rounding, without ~60 small ATen calls per layer.
- Grouped-query attention: `n_heads` query heads share `n_kv_heads` key/value
  heads. Without a cache it is causal `scaled_dot_product_attention` over the
  given tokens (training, scoring). With a cache, `cache.attend(layer, q_BHTD,
  k_BHTD, v_BHTD)` stores the new keys/values and attends over each row's
  history (the engine's `cache.py` owns masking and storage); k/v carry
  `n_kv_heads` heads there.
- Feed-forward: the first `first_dense_layers` layers are a dense SwiGLU, the
  rest are `moe.MoE`.
- Copying from the context (`config.copy`, `copying.py`): previous-token
  embeddings in the input (`prev_tokens`; a forward that continues a sequence
  passes the tokens before its first one as `prev_BK`) and the optional copy
  head, whose logits are the log of a pointer-generator mixture (with scope
  "prompt", training passes the turns' mask `turn_mask_BT`).

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyHead, PrevTokenEmbeddings
from codefleet.model.decode import decode_blocks
from codefleet.model.moe import MoE, SwiGLU
from codefleet.model.weights import fused_weight, inference_linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # one fused kernel, bit-identical to the expression below in fp32 (tests/test_model_transformer.py)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope_cos_sin(positions_BT: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, 1, T, head_dim] for rotate-half rotary embeddings at the given positions."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions_BT.device, dtype=torch.float32) / head_dim)
    angles_BTd = positions_BT.float()[..., None] * inv_freq
    angles_BTD = torch.cat([angles_BTd, angles_BTd], dim=-1)
    return angles_BTD.cos()[:, None], angles_BTD.sin()[:, None]


def rope_table(n_positions: int, head_dim: int, theta: float, device) -> torch.Tensor:
    """[n_positions, 2, head_dim] fp32: cos and the rotate-half-signed sin (`-sin` on the first half) of
    positions 0..n-1, the same angles as `rope_cos_sin`. With the sign folded in,
    `x * cos + roll(x, half) * sin_signed` equals `x * cos + cat(-x2, x1) * sin` exactly."""
    cos, sin = rope_cos_sin(torch.arange(n_positions, device=device)[None], head_dim, theta)
    sin = sin[0, 0].clone()
    sin[:, : head_dim // 2].neg_()
    return torch.stack([cos[0, 0], sin], dim=1)


def apply_rope(x_BHTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x_BHTD.shape[-1] // 2
    x1, x2 = x_BHTD[..., :half], x_BHTD[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x_BHTD.float() * cos + rotated.float() * sin).to(x_BHTD.dtype)


def _apply_rope_signed(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """`apply_rope` with the table's signed sin: x * cos + [x2, x1] * [-sin, sin] (fewer ops per call)."""
    rotated = x.roll(x.shape[-1] // 2, dims=-1)
    if x.dtype == torch.float32:
        return x * cos + rotated * sin_signed
    return (x.float() * cos + rotated.float() * sin_signed).to(x.dtype)


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

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """`cos`/`sin` as `rope_cos_sin` returns them ([B, 1, T, head_dim])."""
        half = sin.shape[-1] // 2
        sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        return self.forward_rope(x_BTD, cos.transpose(1, 2), sin_signed.transpose(1, 2), cache)

    def forward_rope(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache=None) -> torch.Tensor:
        """`cos`/`sin`: [B or 1, T, 1, head_dim] rows of the model's rotary table (`sin` signed: `rope_table`)."""
        B, T, _ = x_BTD.shape
        H, Hkv, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        if torch.is_grad_enabled():  # training: separate projections, autograd sees the parameters
            cos_, sin_ = cos.transpose(1, 2), sin.transpose(1, 2)
            q_BHTD = _apply_rope_signed(self.wq(x_BTD).view(B, T, H, Dh).transpose(1, 2), cos_, sin_)
            k_BHTD = _apply_rope_signed(self.wk(x_BTD).view(B, T, Hkv, Dh).transpose(1, 2), cos_, sin_)
            v_BHTD = self.wv(x_BTD).view(B, T, Hkv, Dh).transpose(1, 2)
        else:  # one fused projection; RoPE on the query and key heads together, before the (free) transposes
            w_qkv = fused_weight(self, (self.wq.weight, self.wk.weight, self.wv.weight))
            qkv_BTHD = F.linear(x_BTD, w_qkv).view(B, T, H + 2 * Hkv, Dh)
            qk_BTHD = _apply_rope_signed(qkv_BTHD[:, :, : H + Hkv], cos, sin)
            q_BHTD = qk_BTHD[:, :, :H].transpose(1, 2)
            k_BHTD = qk_BTHD[:, :, H:].transpose(1, 2)
            v_BHTD = qkv_BTHD[:, :, H + Hkv:].transpose(1, 2)
        if cache is not None:
            out_BHTD = cache.attend(self.layer, q_BHTD, k_BHTD, v_BHTD)
        else:
            out_BHTD = F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, is_causal=True,
                                                      enable_gqa=H != Hkv)
        return self.wo(out_BHTD.transpose(1, 2).reshape(B, T, H * Dh))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, layer)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.is_moe = layer >= config.first_dense_layers
        self.ffn = MoE(config) if self.is_moe else SwiGLU(config.d_model, config.d_dense)


@dataclass
class ModelOutput:
    logits_BTV: torch.Tensor | None  # None when the forward was given targets_BT
    routed_experts: list[torch.Tensor] | None
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    target_logprobs_BT: torch.Tensor | None = None  # log p(targets_BT), when given


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
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

    def forward(self, tokens_BT: torch.Tensor, positions_BT: torch.Tensor | None = None, cache=None,
                routing_replay: list[torch.Tensor] | None = None, return_routing: bool = False,
                logits_at_B: torch.Tensor | None = None, prev_BK: torch.Tensor | None = None,
                targets_BT: torch.Tensor | None = None, turn_mask_BT: torch.Tensor | None = None) -> ModelOutput:
        """`logits_at_B`: compute the logits only at that position of each row (`logits_BTV` is then
        [B, 1, V]); the engine's prefill needs only each prompt's last token, not a [B, T, V] head.
        `prev_BK`: the `prev_tokens` token ids before each row's first token, oldest first (`vocab_size`
        where the sequence has none); None when every row starts its sequence.
        `targets_BT`: return `target_logprobs_BT`, log p of each target (what training needs), instead of
        `logits_BTV`; with a copy head this skips the `[B, T, V]` copy distribution (no cache).
        `turn_mask_BT`: True where the target is a token the model wrote in a turn (the loss mask); a forward
        without a cache needs it when the copy head's scope is "prompt" (the copy head of those positions sees
        only the tokens before their turn, as the engine's did)."""
        cfg = self.config
        B, T = tokens_BT.shape
        if positions_BT is None:
            positions_BT = torch.arange(T, device=tokens_BT.device).expand(B, T)
        if routing_replay is not None and len(routing_replay) != cfg.n_moe_layers:
            raise ValueError(f"routing_replay has {len(routing_replay)} entries; this model has "
                             f"{cfg.n_moe_layers} MoE layers (one [B, T, top_k] tensor each)")
        if (prev_BK is None and cache is not None and cfg.copy.prev_tokens
                and bool((positions_BT[:, 0] > 0).any())):
            raise ValueError("this forward continues cached sequences, so it needs prev_BK: the model's input "
                             f"includes each token's {cfg.copy.prev_tokens} predecessors (config.copy.prev_tokens)")
        x_BTD = self.embed_input(tokens_BT, prev_BK)
        routed: list[torch.Tensor] | None = [] if return_routing else None
        x_native_BTD = decode_blocks(self, x_BTD, cache, routing_replay, routed)
        if x_native_BTD is not None:  # a decode step, each block in native calls (model/decode.py)
            no_loss = x_BTD.new_zeros((), dtype=torch.float32)  # it runs under inference_mode only
            x_BTD, aux, z = x_native_BTD, no_loss, no_loss
        else:
            x_BTD, aux, z = self._blocks(x_BTD, positions_BT, cache, routing_replay, routed)
        if self.copy is not None:  # the copy head's keys: every position's final hidden state
            h_all_BTD = self.norm(x_BTD)
            h_BTD = h_all_BTD
            if logits_at_B is not None:
                h_BTD = h_all_BTD[torch.arange(B, device=x_BTD.device), logits_at_B][:, None]
        else:
            if logits_at_B is not None:
                x_BTD = x_BTD[torch.arange(B, device=x_BTD.device), logits_at_B][:, None]
            h_BTD = self.norm(x_BTD)
        if torch.is_grad_enabled():
            logits_BTV = self.lm_head(h_BTD)
        else:  # the engine, reference logprobs: the LM head is the largest GEMM of a decode step
            logits_BTV = inference_linear(self.lm_head, h_BTD, (self.lm_head.weight,))
        if targets_BT is not None:
            if cache is not None or logits_at_B is not None:
                raise ValueError("targets_BT is for a full forward over whole sequences (training), not with "
                                 "a cache or logits_at_B")
            if self.copy is not None:
                logp_BT = self.copy.target_logprobs(logits_BTV, h_BTD, tokens_BT, targets_BT, turn_mask_BT)
            else:
                logp_BT = token_logprobs(logits_BTV, targets_BT)
            return ModelOutput(None, routed, aux, z, logp_BT)
        if self.copy is not None:
            logits_BTV = self.copy(logits_BTV, h_BTD, h_all_BTD, tokens_BT, cache, logits_at_B, turn_mask_BT)
        return ModelOutput(logits_BTV, routed, aux, z)

    def _blocks(self, x_BTD: torch.Tensor, positions_BT: torch.Tensor, cache, routing_replay, routed: list | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every block over `x_BTD`; the residual stream after them and the summed aux and z losses (0 under
        inference_mode). Appends each MoE layer's experts `[B, T, top_k]` to `routed` if given."""
        cfg = self.config
        B, T, _ = x_BTD.shape
        n = int(positions_BT.max()) + 1 if positions_BT.device.type == "cpu" else cfg.max_seq_len
        cs_BT2_1D = self._rope(n, x_BTD.device)[positions_BT]
        cos, sin = cs_BT2_1D[:, :, 0], cs_BT2_1D[:, :, 1]  # [B, T, 1, head_dim]
        aux = z = x_BTD.new_zeros((), dtype=torch.float32)
        moe_i = 0
        for block in self.layers:
            x_BTD = x_BTD + block.attn.forward_rope(block.attn_norm(x_BTD), cos, sin, cache)
            h_ND = block.ffn_norm(x_BTD).reshape(B * T, cfg.d_model)
            if block.is_moe:
                replay_NK = None if routing_replay is None else routing_replay[moe_i].reshape(B * T, cfg.top_k)
                out = block.ffn(h_ND, replay_NK)
                ffn_ND = out.y_ND
                if out.aux_loss is not None:  # None under inference_mode
                    aux, z = aux + out.aux_loss, z + out.z_loss
                if routed is not None:
                    routed.append(out.experts_NK.view(B, T, cfg.top_k))
                moe_i += 1
            else:
                ffn_ND = block.ffn(h_ND)
            x_BTD = x_BTD + ffn_ND.view(B, T, cfg.d_model)
        return x_BTD, aux, z

    def embed_input(self, tokens_BT: torch.Tensor, prev_BK: torch.Tensor | None = None) -> torch.Tensor:
        """The first layer's input: each token's embedding plus those of the `prev_tokens` tokens before it."""
        x_BTD = self.embed(tokens_BT)
        if self.embed_prev is None:
            return x_BTD
        return self.embed_prev(x_BTD, tokens_BT, prev_BK)

    def _rope(self, n_positions: int, device) -> torch.Tensor:
        """The rotary table [P, 2, 1, head_dim] (cos, signed sin) for P >= n_positions positions, computed once
        (a plain attribute, not a buffer: not in the checkpoint, never cast to a low-precision dtype)."""
        tab = getattr(self, "_rope_tab", None)
        if tab is None or tab.shape[0] < n_positions or tab.device != torch.device(device):
            n = max(n_positions, self.config.max_seq_len, 0 if tab is None else tab.shape[0])
            with torch.inference_mode(False), torch.no_grad():
                tab = rope_table(n, self.config.head_dim, self.config.rope_theta, device)[:, :, None]
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


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log p(targets) under the logits, in fp32: [B, T]."""
    return torch.log_softmax(logits_BTV.float(), dim=-1).gather(-1, targets_BT.unsqueeze(-1)).squeeze(-1)
