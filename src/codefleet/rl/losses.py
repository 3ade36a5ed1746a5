"""Policy-gradient losses for an MoE policy trained on (possibly stale) rollouts.

All tensors are per token, `[B, T]`, aligned with the sequence's tokens;
`mask_BT` is 1 on the tokens the policy is trained on (the completion tokens
the policy sampled) and 0 on prompts, tool outputs and padding. Advantages
are one per sequence `[B]` (broadcast over its tokens) or per token `[B, T]`.
Three logprobs can be involved:

- `logprobs_BT`: the policy being trained (with grad);
- `behave_logprobs_BT`: the engine's, from the (possibly stale) policy version
  that sampled each token (`Turn.logprobs`);
- `prox_logprobs_BT`: a proximal policy, the trainer's weights before this
  update recomputed on the rollout (no grad).

PPO-clip, per token, with clip-higher (DAPO): `r = exp(logp - old)`,
`-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`. "old" and the extra
importance weight `w` depend on `LossConfig.off_policy`:

- "none": old = behaviour logprobs, w = 1 (plain PPO; the engine's logprobs
  stand for pi_old).
- "decoupled" (AReaL, Hilton et al. 2022 "decoupled PPO"): old = proximal,
  w = exp(prox - behave); tokens with w > `is_cap` are masked out of the
  loss (AReaL's behaviour-weight cap).
- "tis" (Yao et al. 2025, truncated importance sampling): old = proximal,
  w = min(exp(prox - behave), is_cap); every token stays in, its weight
  truncated.

w is a constant (no grad). GSPO (`ratio_level="sequence"`, Zheng et al.
2025) replaces the token ratio by one per sequence,
`s = exp(mean over the sequence's tokens of (logp - old))`, clipped at the
sequence level (GSPO uses small bounds, e.g. 3e-4 / 4e-4): more stable for
MoE, whose per-token ratios are noisy when routing changes. GSPO supports
off_policy "none" only, with `behave_logprobs_BT` as old; pass the proximal
logprobs there to ratio against a proximal policy.

Reduction: "token_mean" averages over every masked token of the batch (long
sequences weigh more, DAPO); "seq_mean" averages each sequence's tokens
first, then the sequences (GRPO as published). GSPO losses are per sequence
and always averaged over sequences.

KL to a reference policy (`kl_coef > 0`, `ref_logprobs_BT`), per token,
reduced like the policy loss (per sequence, then over sequences, with GSPO)
and added times `kl_coef`. `kl_estimator="k3"`: `exp(ref - logp) - (ref -
logp) - 1` (>= 0, unbiased for KL(pi || ref) on the policy's own samples);
its gradient grows as exp(ref - logp), so one token the reference found
likely and the policy does not (a constrained or stale sample) can dominate
a step. `kl_estimator="k2"`: `(logp - ref)^2 / 2`, whose gradient
`(logp - ref) * grad logp` is linear in the log-ratio and, on the policy's
own samples, is the gradient of KL(pi || ref) in expectation.

`add_moe_losses(loss, model_output)` adds the model's router losses
(aux + z, already scaled by their coefficients in the model config).
"""

from __future__ import annotations

import torch

from codefleet.rl.loss_config import REDUCTIONS, LossConfig


def masked_reduce(x_BT: torch.Tensor, mask_BT: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mean of x over masked tokens: over all of them ("token_mean") or per sequence then over sequences ("seq_mean").
    Sequences without a masked token count as 0 in "seq_mean" but still count in the number of sequences."""
    mask_BT = mask_BT.to(x_BT.dtype)
    if reduction == "token_mean":
        return (x_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1)
    if reduction == "seq_mean":
        per_seq_B = (x_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
        return per_seq_B.mean()
    raise ValueError(f"unknown reduction {reduction!r}; choose one of {', '.join(REDUCTIONS)}")


def kl_k3(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1."""
    d_BT = ref_logprobs_BT - logprobs_BT
    return d_BT.exp() - d_BT - 1


def kl_k2(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """Per-token k2 estimate of KL(pi || ref): (logp - ref)^2 / 2."""
    return 0.5 * (logprobs_BT - ref_logprobs_BT) ** 2


def _clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float):
    """-min(r A, clip(r) A) and where the clipped term is active (its gradient is zero)."""
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    loss = -torch.minimum(ratio * adv, clipped * adv)
    high = (adv > 0) & (ratio > 1 + eps_high)
    low = (adv < 0) & (ratio < 1 - eps_low)
    return loss, high, low


def policy_loss(
    logprobs_BT: torch.Tensor,
    behave_logprobs_BT: torch.Tensor,
    advantages: torch.Tensor,
    mask_BT: torch.Tensor,
    config: LossConfig | None = None,
    prox_logprobs_BT: torch.Tensor | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of a batch and its metrics (floats): clip_frac, clip_high_frac, clip_low_frac,
    ratio_mean, pg_loss, entropy (the sampled tokens' mean -behave logprob), and when they apply is_weight_mean,
    is_dropped_frac, kl."""
    cfg = config or LossConfig()
    mask_BT = mask_BT.to(logprobs_BT.dtype)
    adv_BT = advantages[:, None].expand_as(logprobs_BT) if advantages.dim() == 1 else advantages
    adv_BT = adv_BT.to(logprobs_BT.dtype)
    # the mean surprisal of the sampled tokens under the policy that sampled them: the policy's entropy on its own
    # samples (unbiased when sampled unconstrained)
    metrics: dict[str, float] = {"entropy": float(masked_reduce(-behave_logprobs_BT.detach(), mask_BT, "token_mean"))}
    if cfg.ratio_level == "sequence":  # GSPO
        pg, pg_metrics = _sequence_level_loss(logprobs_BT, behave_logprobs_BT, adv_BT, mask_BT, cfg)
    else:
        pg, pg_metrics = _token_level_loss(logprobs_BT, behave_logprobs_BT, prox_logprobs_BT, adv_BT, mask_BT, cfg)
    metrics.update(pg_metrics)
    metrics["clip_frac"] = metrics["clip_high_frac"] + metrics["clip_low_frac"]
    metrics["pg_loss"] = float(pg.detach())
    loss = pg
    if ref_logprobs_BT is not None:
        kl = _kl_to_reference(logprobs_BT, ref_logprobs_BT, mask_BT, cfg)
        metrics["kl"] = float(kl.detach())
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl
    elif cfg.kl_coef > 0:
        raise ValueError("LossConfig.kl_coef > 0 needs ref_logprobs_BT (the reference policy's logprobs)")
    return loss, metrics


def _sequence_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Each sequence's mean of x over its masked tokens `[B]` (0 for a sequence without one)."""
    return (x_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)


def _over_sequences(x_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """The mean of a per-sequence `x_B` over the sequences that have a masked token."""
    has_B = mask_BT.sum(-1) > 0
    return (x_B * has_B).sum() / has_B.sum().clamp(min=1)


def _sequence_level_loss(
    logprobs_BT: torch.Tensor,
    behave_logprobs_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: one ratio per sequence (the exp of its tokens' mean log-ratio against the behaviour logprobs),
    clipped at the sequence level; the loss and its clip and ratio metrics, averaged over sequences."""
    ratio_B = _sequence_mean(logprobs_BT - behave_logprobs_BT.detach(), mask_BT).exp()
    adv_B = _sequence_mean(adv_BT, mask_BT)  # the sequence's advantage (constant over its tokens)
    loss_B, high_B, low_B = _clipped_objective(ratio_B, adv_B, cfg.eps_low, cfg.eps_high)
    metrics = dict(
        clip_high_frac=float(_over_sequences(high_B, mask_BT)),
        clip_low_frac=float(_over_sequences(low_B, mask_BT)),
        ratio_mean=float(_over_sequences(ratio_B.detach(), mask_BT)),
    )
    return _over_sequences(loss_B, mask_BT), metrics


def _token_level_loss(
    logprobs_BT: torch.Tensor,
    behave_logprobs_BT: torch.Tensor,
    prox_logprobs_BT: torch.Tensor | None,
    adv_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip per token against the old logprobs `LossConfig.off_policy` chooses, times its importance
    weight; the loss reduced by `cfg.reduction`, and its metrics."""
    old_BT, weight_BT, metrics = _old_logprobs_and_weight(behave_logprobs_BT, prox_logprobs_BT, mask_BT, cfg)
    ratio_BT = (logprobs_BT - old_BT.detach()).exp()
    loss_BT, high_BT, low_BT = _clipped_objective(ratio_BT, adv_BT, cfg.eps_low, cfg.eps_high)
    if weight_BT is not None:
        loss_BT = loss_BT * weight_BT
    metrics.update(
        clip_high_frac=_masked_frac(high_BT, mask_BT),
        clip_low_frac=_masked_frac(low_BT, mask_BT),
        ratio_mean=float((ratio_BT.detach() * mask_BT).sum() / mask_BT.sum().clamp(min=1)),
    )
    return masked_reduce(loss_BT, mask_BT, cfg.reduction), metrics


def _old_logprobs_and_weight(
    behave_logprobs_BT: torch.Tensor, prox_logprobs_BT: torch.Tensor | None, mask_BT: torch.Tensor, cfg: LossConfig
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """The logprobs the ratio is taken against, the importance weight of each token (None: 1) and the weight's
    metrics (is_dropped_frac for "decoupled", is_weight_mean), per `cfg.off_policy` (module docstring)."""
    if cfg.off_policy == "none":
        return behave_logprobs_BT, None, {}
    if prox_logprobs_BT is None:
        raise ValueError(
            f"off_policy={cfg.off_policy!r} needs prox_logprobs_BT (the trainer's logprobs "
            "before this update); use off_policy='none' to ratio against the engine's logprobs"
        )
    metrics: dict[str, float] = {}
    weight_BT = (prox_logprobs_BT - behave_logprobs_BT).detach().exp()
    if cfg.off_policy == "decoupled":
        keep_BT = weight_BT <= cfg.is_cap
        metrics["is_dropped_frac"] = _masked_frac(~keep_BT, mask_BT)
        weight_BT = torch.where(keep_BT, weight_BT, torch.zeros_like(weight_BT))
    else:
        weight_BT = weight_BT.clamp(max=cfg.is_cap)
    metrics["is_weight_mean"] = float((weight_BT * mask_BT).sum() / mask_BT.sum().clamp(min=1))
    return prox_logprobs_BT, weight_BT, metrics


def _masked_frac(where_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    """The share of the masked tokens where `where_BT` holds."""
    return float((where_BT.to(mask_BT.dtype) * mask_BT).sum() / mask_BT.sum().clamp(min=1))


def _kl_to_reference(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, mask_BT: torch.Tensor, cfg: LossConfig
) -> torch.Tensor:
    """The KL estimate `cfg.kl_estimator` to the reference policy, reduced like the policy loss."""
    kl_BT = (kl_k3 if cfg.kl_estimator == "k3" else kl_k2)(logprobs_BT, ref_logprobs_BT.detach())
    if cfg.ratio_level == "sequence":  # per sequence like the GSPO loss, so micro-batches add up to the batch
        return _over_sequences(_sequence_mean(kl_BT, mask_BT), mask_BT)
    return masked_reduce(kl_BT, mask_BT, cfg.reduction)


def add_moe_losses(loss: torch.Tensor, output) -> torch.Tensor:
    """loss + the router's balancing (aux) and z losses of a `ModelOutput` (or anything with aux_loss, z_loss)."""
    return loss + output.aux_loss + output.z_loss
