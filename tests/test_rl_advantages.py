"""GRPO, Dr.GRPO and RLOO advantages and zero-variance groups, against values computed by hand."""

import math

import pytest
import torch

from codefleet.agent.reward import RewardConfig
from codefleet.rl.advantages import (
    compute_advantages,
    grpo_advantages,
    rloo_advantages,
    weigh_negatives,
    zero_variance_groups,
)
from codefleet.rl.rewards import speed_bonus
from codefleet.types import CheckResult, Trajectory, Turn


def test_grpo_binary_group_by_hand():
    # mean 0.5; sample std sqrt((4 * 0.25) / 3) = sqrt(1/3); 0.5 / sqrt(1/3) = sqrt(3) / 2
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    h = math.sqrt(3) / 2
    torch.testing.assert_close(adv, torch.tensor([h, -h, -h, h]))


def test_grpo_with_eps_and_dr_grpo_by_hand():
    r = torch.tensor([3.0, 1.0, 2.0])  # mean 2, sample std sqrt((1 + 1 + 0) / 2) = 1
    torch.testing.assert_close(grpo_advantages(r, eps=0.5), torch.tensor([1.0, -1.0, 0.0]) / 1.5)
    torch.testing.assert_close(grpo_advantages(r, normalize_std=False), torch.tensor([1.0, -1.0, 0.0]))
    torch.testing.assert_close(compute_advantages(r, "drgrpo"), torch.tensor([1.0, -1.0, 0.0]))


def test_rloo_is_reward_minus_mean_of_the_others():
    # 3 - (1+2)/2 = 1.5, 1 - (3+2)/2 = -1.5, 2 - (3+1)/2 = 0
    torch.testing.assert_close(rloo_advantages(torch.tensor([3.0, 1.0, 2.0])), torch.tensor([1.5, -1.5, 0.0]))
    # 1 - 1/3 = 2/3, 0 - 2/3 = -2/3
    torch.testing.assert_close(
        compute_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), "rloo"), torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    )


def test_batched_groups_equal_one_group_at_a_time():
    r_NG = torch.tensor([[3.0, 1.0, 2.0, 0.5], [1.0, 1.0, 0.0, 0.0], [0.2, 0.2, 0.2, 0.2]])
    for name in ("grpo", "drgrpo", "rloo"):
        batched = compute_advantages(r_NG, name)
        assert batched.shape == (3, 4)
        for n in range(3):
            torch.testing.assert_close(batched[n], compute_advantages(r_NG[n], name))
    assert torch.equal(compute_advantages(r_NG, "grpo")[2], torch.zeros(4))  # no NaN on a constant group


def test_zero_variance_groups_for_dynamic_sampling():
    r_NG = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert zero_variance_groups(r_NG).tolist() == [True, False, True]
    assert not bool(zero_variance_groups(torch.tensor([0.5, 0.25])))


def test_bad_estimator_and_too_small_groups_say_what_to_do():
    with pytest.raises(ValueError, match="grpo, drgrpo, rloo"):
        compute_advantages(torch.tensor([1.0, 0.0]), "ppo")
    with pytest.raises(ValueError, match="at least 2"):
        rloo_advantages(torch.tensor([[1.0]]))


def test_weigh_negatives_scales_only_the_attempts_below_their_group():
    adv_NG = compute_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.5, 0.5, 0.5, 0.5]]), "drgrpo")
    torch.testing.assert_close(weigh_negatives(adv_NG, 0.2), torch.tensor([[0.75, -0.05, -0.05, -0.05], [0.0] * 4]))
    assert torch.equal(weigh_negatives(adv_NG, 1.0), adv_NG)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        weigh_negatives(adv_NG, 1.5)


def test_speed_bonus_ranks_a_groups_solved_attempts_by_turns_and_leaves_failures_at_zero():
    turns = torch.tensor([[2, 4, 3, 6], [3, 3, 6, 2], [5, 5, 5, 5], [4, 4, 5, 6]])
    solved = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    # group 0: solved turns 2..4 -> +w/2, -w/2, 0 (linear); the failure's 6 turns count for nothing
    # group 1: the solved attempts tie; group 2: none solved; group 3: one solved, no one to beat
    torch.testing.assert_close(
        speed_bonus(turns, solved, 0.5), torch.tensor([[0.25, -0.25, 0.0, 0.0], [0.0] * 4, [0.0] * 4, [0.0] * 4])
    )
    # what it is for: two solves of 4 and 5 turns and two failures get advantages far apart
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    bonus = speed_bonus(torch.tensor([[4, 5, 6, 6]]), torch.tensor([[1, 1, 0, 0]]), 0.5)
    torch.testing.assert_close(
        grpo_advantages(rewards + bonus), torch.tensor([[1.2247, 0.4082, -0.8165, -0.8165]]), atol=1e-4, rtol=0
    )


def test_the_rl_stage_adds_the_speed_bonus_by_what_the_reward_counts_solved():
    from types import SimpleNamespace

    from codefleet.fleet.staleness import Group, Rollout
    from codefleet.recipe.config import RLSection
    from codefleet.recipe.train_rl import group_speed_bonus

    def attempt(all_passed: bool, turns: int, stop: str = "submit") -> Rollout:
        checks = CheckResult(passed=int(all_passed), total=1, all_passed=all_passed)
        t = Trajectory("t", [], [Turn(i, "") for i in range(turns)], stop, checks=checks)
        return Rollout("r", 0, 0, 0.0, t)

    group = Group(SimpleNamespace(group_id=0), [attempt(True, 2), attempt(True, 4, "max_turns"), attempt(False, 1)])
    torch.testing.assert_close(group_speed_bonus([group], RLSection(speed_bonus=1.0)), torch.tensor([[0.5, -0.5, 0.0]]))
    # an attempt that never submitted is not solved when the reward requires it: no one left to compare with
    strict = RLSection(speed_bonus=1.0, reward=RewardConfig(require_submit=True))
    torch.testing.assert_close(group_speed_bonus([group], strict), torch.zeros(1, 3))
