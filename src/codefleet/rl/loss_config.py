"""`LossConfig`, the choice of policy loss and its constants (the loss itself and what each choice means:
`losses.py`). It lives apart from the loss so that a run's configuration loads without torch.
"""

from __future__ import annotations

from dataclasses import dataclass

OFF_POLICY = ("none", "decoupled", "tis")
REDUCTIONS = ("token_mean", "seq_mean")
RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k3", "k2")


@dataclass
class LossConfig:
    eps_low: float = 0.2  # PPO clip: the ratio is clipped to [1 - eps_low, 1 + eps_high]
    eps_high: float = 0.28  # > eps_low: clip-higher (DAPO)
    reduction: str = "token_mean"  # "token_mean" | "seq_mean"
    ratio_level: str = "token"  # "token" (PPO) | "sequence" (GSPO)
    off_policy: str = "none"  # "none" | "decoupled" | "tis"
    is_cap: float = 2.0  # decoupled: tokens with weight above are dropped; tis: weights truncated to it
    kl_coef: float = 0.0  # > 0 needs ref_logprobs_BT
    kl_estimator: str = "k3"  # "k3" | "k2" (bounded gradient: linear in logp - ref)

    def __post_init__(self) -> None:
        for value, allowed, name in (
            (self.reduction, REDUCTIONS, "reduction"),
            (self.ratio_level, RATIO_LEVELS, "ratio_level"),
            (self.off_policy, OFF_POLICY, "off_policy"),
            (self.kl_estimator, KL_ESTIMATORS, "kl_estimator"),
        ):
            if value not in allowed:
                raise ValueError(f"LossConfig.{name}={value!r} is not one of {', '.join(allowed)}")
        if self.ratio_level == "sequence" and self.off_policy != "none":
            raise ValueError(
                "LossConfig: GSPO (ratio_level='sequence') supports off_policy='none' only; "
                "pass the proximal logprobs as behave_logprobs_BT to ratio against a proximal policy"
            )
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0 and self.is_cap > 0):
            raise ValueError("LossConfig: need 0 <= eps_low < 1, eps_high >= 0 and is_cap > 0")
