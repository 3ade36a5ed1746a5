"""What only a group of attempts can add to their rewards: which of its solved attempts was fast.

The reward of one episode is `codefleet.agent.reward.compute_reward` (hidden
checks 1/0 or passing fraction, minus the configured costs per turn, second
and token); the bonus here is added per group, on the tensor the advantage
estimators take.

`speed_bonus` is Kimi k1.5's length reward (Kimi Team 2025, section 2.3.3)
on turns instead of tokens: among a group's solved attempts, the one with
the fewest turns gets +w/2, the one with the most -w/2, linearly between;
failed attempts and groups whose solved attempts all took the same turns
get 0. A cost per turn cannot do this at a scale that keeps failing worse
than succeeding slowly: in a group of 4 with a 4-turn and a 5-turn solve
and two failures, a cost of 0.02 per turn gives the two solves advantages
of +0.89 and +0.85 (GRPO), so RL reinforces both paths nearly alike; with
a bonus of 0.5 (and no cost) they get +1.22 and +0.41.
"""

from __future__ import annotations

import torch


def speed_bonus(turns_NG: torch.Tensor, solved_NG: torch.Tensor, weight: float) -> torch.Tensor:
    """[n_groups, G] bonus: weight * (0.5 - (turns - fewest) / (most - fewest)) over each group's solved
    attempts (fewest and most among them); 0 for failed attempts and where the solved ones tie."""
    turns_NG, solved_NG = turns_NG.float(), solved_NG.bool()
    fewest = torch.where(solved_NG, turns_NG, torch.inf).amin(-1, keepdim=True)
    most = torch.where(solved_NG, turns_NG, -torch.inf).amax(-1, keepdim=True)
    spread = (most - fewest).nan_to_num(0.0).clamp(min=0.0)
    lam = 0.5 - (turns_NG - fewest) / spread.clamp(min=1e-9)
    return torch.where(solved_NG & (spread > 0), weight * lam, torch.zeros_like(turns_NG))
