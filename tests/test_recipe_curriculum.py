"""The RL task sampler (rl.curriculum): uniform passes, and the curriculum that follows the signal."""

import collections
import random

import pytest

from codefleet.recipe.curriculum import TaskSampler, family_of, mixed_group_probability
from codefleet.types import HiddenChecks, Task


def _tasks(families=("rename", "config", "stub"), per_family=4):
    return [
        Task(
            id=f"{f}-x-s0-{i:04d}",
            repo="repo",
            instruction="",
            checks=HiddenChecks(command="true"),
            metadata={"family": f},
        )
        for f in families
        for i in range(per_family)
    ]


def test_uniform_is_every_task_once_per_pass_and_skip_resumes_the_same_stream():
    tasks = _tasks()
    sampler = TaskSampler(tasks, seed=3)
    first = [next(sampler).id for _ in range(2 * len(tasks))]
    assert sorted(first[: len(tasks)]) == sorted(t.id for t in tasks)
    assert sorted(first[len(tasks) :]) == sorted(t.id for t in tasks)
    expected = list(tasks)
    random.Random("3/0").shuffle(expected)  # the order runs before the curriculum existed used
    assert first[: len(tasks)] == [t.id for t in expected]
    resumed = TaskSampler(tasks, seed=3, skip=5)
    assert [next(resumed).id for _ in range(7)] == first[5:12]


@pytest.mark.parametrize("mode", ["uniform", "learnable"])
def test_an_excluded_task_never_comes_again_and_excluding_all_ends_the_stream(mode):
    tasks = _tasks()
    sampler = TaskSampler(tasks, seed=1, mode=mode)
    first = next(sampler)
    sampler.exclude(first.id)
    sampler.exclude(tasks[5].id)
    rest = [next(sampler).id for _ in range(3 * len(tasks))]
    assert first.id not in rest and tasks[5].id not in rest
    assert set(rest) == {t.id for t in tasks} - {first.id, tasks[5].id}
    for t in tasks:
        sampler.exclude(t.id)
    with pytest.raises(StopIteration):
        next(sampler)


def test_mixed_group_probability_by_hand():
    assert mixed_group_probability(0.5, 4) == pytest.approx(1 - 2 / 16)
    assert mixed_group_probability(0.1, 4) == pytest.approx(1 - 0.1**4 - 0.9**4)
    assert mixed_group_probability(0.0, 4) == 0.0 and mixed_group_probability(1.0, 4) == 0.0


def test_success_estimate_and_weight_follow_the_observed_groups():
    sampler = TaskSampler(_tasks(), mode="learnable", group_size=4, floor=0.1)
    assert sampler.success_estimate("rename") == 0.5
    sampler.observe("config-x-s0-0001", [False] * 4)
    sampler.observe("rename-x-s0-0002", [True, False, False, False])
    sampler.observe("no-such-task", [True] * 4)  # ignored
    assert sampler.success_estimate("config") == pytest.approx(0.5 / 5)
    assert sampler.success_estimate("rename") == pytest.approx(1.5 / 5)
    assert sampler.weight("config") == pytest.approx(0.1 + 1 - 0.1**4 - 0.9**4)
    assert sampler.stats()["rename"]["attempts"] == 4 and sampler.stats()["stub"]["attempts"] == 0


def test_learnable_draws_favour_the_family_with_signal_and_keep_the_others():
    tasks = _tasks()
    sampler = TaskSampler(tasks, seed=1, mode="learnable", group_size=4, floor=0.1)
    for _ in range(3):
        sampler.observe("config-x-s0-0000", [False] * 4)
        sampler.observe("stub-x-s0-0000", [False] * 4)
        sampler.observe("rename-x-s0-0000", [True, False, True, False])
    drawn = collections.Counter(family_of(next(sampler)) for _ in range(600))
    assert drawn["rename"] > 2.5 * drawn["config"] and drawn["rename"] > 2.5 * drawn["stub"]
    assert drawn["config"] > 30 and drawn["stub"] > 30  # the floor keeps them in play


def test_learnable_goes_through_a_family_before_repeating_a_task():
    tasks = _tasks(families=("rename",), per_family=5)
    sampler = TaskSampler(tasks, seed=0, mode="learnable")
    ids = [next(sampler).id for _ in range(10)]
    assert sorted(ids[:5]) == sorted(ids[5:]) == sorted(t.id for t in tasks)


def test_bad_mode_and_no_tasks_are_clear_errors():
    with pytest.raises(ValueError, match="uniform, learnable"):
        TaskSampler(_tasks(), mode="hardest")
    with pytest.raises(ValueError, match="at least one task"):
        TaskSampler([])
