"""Rewards of groups of trajectories, as the tensor the advantage estimators take.

The reward of one episode is `codefleet.agent.reward.compute_reward` (hidden
checks 1/0 or passing fraction, minus the configured costs per turn, second
and token); this module only arranges it per group.
"""

from __future__ import annotations

import torch

from codefleet.agent.reward import RewardConfig, compute_reward
from codefleet.types import Trajectory


def group_rewards(groups: list[list[Trajectory]], config: RewardConfig | None = None) -> torch.Tensor:
    """[n_groups, G] rewards; every group must hold the same number G of attempts."""
    sizes = {len(g) for g in groups}
    if len(sizes) != 1:
        raise ValueError(f"groups must all have the same number of attempts, got sizes {sorted(sizes)}")
    return torch.tensor([[compute_reward(t, config) for t in g] for g in groups], dtype=torch.float32)
