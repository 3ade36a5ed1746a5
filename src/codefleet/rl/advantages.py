"""Advantages of a group of attempts at the same task, and which groups carry no signal.

Every function takes the rewards of one group `[G]` or of many groups
`[n_groups, G]` (the last dimension is the group) and returns the same shape.

- GRPO (DeepSeekMath): `A_i = (r_i - mean(r)) / (std(r) + eps)`, std the
  sample std (`torch.std`, n - 1), as TRL and veRL compute it.
- Dr.GRPO (Liu et al. 2025): the same without the std division
  (`normalize_std=False`); a group whose rewards barely differ is then not
  blown up to unit scale, which removes GRPO's bias towards easy/hard tasks.
- RLOO (Ahmadian et al. 2024): the baseline of attempt i is the mean of the
  *other* G - 1 attempts, `A_i = r_i - (sum(r) - r_i) / (G - 1)`, which is
  `G / (G - 1) * (r_i - mean(r))`: unbiased, and a constant factor away from
  Dr.GRPO.
- `weigh_negatives`: scales the negative advantages (1 = unchanged, 0 =
  learn only from the attempts that beat their group, as in filtered
  behaviour cloning / expert iteration). Pushing down a weak policy's many
  failed tokens moves probability to tokens it never tried; a small weight
  keeps the baseline's variance reduction and damps that.
- `zero_variance_groups`: groups whose attempts all got the same reward have
  all-zero advantages, so they contribute no gradient; DAPO's dynamic
  sampling drops them and samples more.
"""

from __future__ import annotations

import torch

ESTIMATORS = ("grpo", "drgrpo", "rloo")


def grpo_advantages(rewards_NG: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """Reward minus the group mean, divided by the group's std + eps when `normalize_std` (off: Dr.GRPO)."""
    rewards_NG = rewards_NG.float()
    adv_NG = rewards_NG - rewards_NG.mean(-1, keepdim=True)
    if normalize_std:
        if rewards_NG.shape[-1] < 2:
            raise ValueError("GRPO std normalisation needs groups of at least 2 attempts; use normalize_std=False")
        adv_NG = adv_NG / (rewards_NG.std(-1, keepdim=True) + eps)
    return adv_NG


def rloo_advantages(rewards_NG: torch.Tensor) -> torch.Tensor:
    """Reward minus the mean reward of the other attempts of its group (leave-one-out)."""
    rewards_NG = rewards_NG.float()
    G = rewards_NG.shape[-1]
    if G < 2:
        raise ValueError("RLOO needs groups of at least 2 attempts (the baseline is the mean of the others)")
    others_NG = (rewards_NG.sum(-1, keepdim=True) - rewards_NG) / (G - 1)
    return rewards_NG - others_NG


def compute_advantages(rewards_NG: torch.Tensor, estimator: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Advantages by estimator name: "grpo", "drgrpo" (GRPO without std) or "rloo"."""
    if estimator == "grpo":
        return grpo_advantages(rewards_NG, True, eps)
    if estimator == "drgrpo":
        return grpo_advantages(rewards_NG, False)
    if estimator == "rloo":
        return rloo_advantages(rewards_NG)
    raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")


def weigh_negatives(adv_NG: torch.Tensor, weight: float) -> torch.Tensor:
    """Negative advantages times `weight` (in [0, 1]); positive ones unchanged."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"the weight of negative advantages must be in [0, 1], got {weight}")
    return torch.where(adv_NG < 0, adv_NG * weight, adv_NG)


def zero_variance_groups(rewards_NG: torch.Tensor, atol: float = 1e-8) -> torch.Tensor:
    """True for every group whose rewards are all equal (within atol): shape [] for [G], [n_groups] for [n, G]."""
    spread_N = rewards_NG.amax(-1) - rewards_NG.amin(-1)
    return spread_N <= atol
