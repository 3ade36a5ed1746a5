"""Expert demonstrations are the same token for token from run to run (rl.demos)."""

from __future__ import annotations

from codefleet.recipe.demos import expert_demos, steady_timings


def test_steady_timings_rewrites_the_durations_pytest_prints_in_tool_results_only():
    messages = [
        {"role": "user", "content": "make 8 passed in 0.5s pass"},
        {"role": "assistant", "content": "Running the tests.", "tool_calls": []},
        {"role": "tool", "content": "........ [100%]\n8 passed in 0.38s\n[exit code 0]"},
        {"role": "tool", "content": "FAILED tests/test_a.py::test_x\n1 failed, 7 passed, 2 warnings in 12.07s"},
        {"role": "tool", "content": "no tests ran in 0.00s"},
        {"role": "tool", "content": "sleep in 3s; grep 'passed in 2s' log"},
        {"role": "tool", "content": None},
    ]
    out = steady_timings(messages)
    assert out[0] == messages[0] and out[1] == messages[1] and out[6] == messages[6]
    assert out[2]["content"] == "........ [100%]\n8 passed in 0.01s\n[exit code 0]"
    assert out[3]["content"].endswith("1 failed, 7 passed, 2 warnings in 0.01s")
    assert out[4]["content"] == "no tests ran in 0.01s"
    assert out[5]["content"] == "sleep in 3s; grep 'passed in 0.01s' log"  # what pytest would print, anywhere
    assert messages[2]["content"].endswith("in 0.38s\n[exit code 0]")  # the input is not changed


def test_two_runs_of_the_expert_give_the_same_demonstrations(tmp_path, config):
    from codefleet.agent.episode import EpisodeConfig
    from codefleet.chat.tokenizer import default_tokenizer
    from codefleet.tasks.generate import generate_tasks

    tasks = generate_tasks(str(tmp_path / "tasks"), n=3, seed=2, families=["bugfix", "rename", "stub"], split="train")
    tokenizer = default_tokenizer()
    runs = [
        expert_demos(tasks, tokenizer, 4096, config, EpisodeConfig(prompt="bare"), chain_fraction=0.5) for _ in range(2)
    ]
    assert len(runs[0].examples) == 3 and not runs[0].unsolved
    assert runs[0].examples == runs[1].examples and runs[0].conversations == runs[1].conversations
    assert any("passed in 0.01s" in (m.get("content") or "") for conv in runs[0].conversations for m in conv)


def test_a_task_without_a_reference_patch_or_whose_set_up_fails_gets_no_demonstration_and_the_rest_do(tmp_path, config):
    import dataclasses

    from codefleet.agent.episode import EpisodeConfig
    from codefleet.chat.tokenizer import default_tokenizer
    from codefleet.tasks.generate import generate_tasks

    tasks = generate_tasks(str(tmp_path / "tasks"), n=3, seed=2, families=["rename"], split="train")
    tasks[1] = dataclasses.replace(tasks[1], reference_patch="")  # say, a task of your own with hidden checks only
    tasks[2] = dataclasses.replace(tasks[2], setup_commands=["npm ci || exit 7"])  # a set-up that cannot work here
    demos = expert_demos(tasks, default_tokenizer(), 4096, config, EpisodeConfig(prompt="bare"))
    assert demos.task_ids == [tasks[0].id] and demos.no_patch == [tasks[1].id] and not demos.unsolved
    assert list(demos.broken) == [tasks[2].id] and "exit 7" in demos.broken[tasks[2].id]


def test_all_habits_records_each_habit_that_makes_another_episode_and_sft_draws_one_each_time(tmp_path, config):
    import random

    from codefleet.agent.episode import EpisodeConfig
    from codefleet.chat.tokenizer import default_tokenizer
    from codefleet.recipe.config import SFTSection
    from codefleet.recipe.train import sft_batch
    from codefleet.tasks.generate import generate_tasks

    tasks = generate_tasks(str(tmp_path / "tasks"), n=2, seed=2, families=["rename", "stub"], split="train")
    tokenizer = default_tokenizer()
    drawn_once = expert_demos(tasks, tokenizer, 4096, config, EpisodeConfig(prompt="bare"), chain_fraction=0.5)
    demos = expert_demos(
        tasks, tokenizer, 4096, config, EpisodeConfig(prompt="bare"), chain_fraction=0.5, all_habits=True
    )
    # the habit drawn per task is the one recorded as the task's demonstration either way
    assert demos.examples == drawn_once.examples and not drawn_once.variants
    rename = demos.task_ids.index(next(t.id for t in tasks if t.id.startswith("rename")))
    stub = 1 - rename

    def turns(messages):
        return sum(1 for m in messages if m["role"] == "assistant")

    # a rename: explore or not, tests chained or not, four episodes; 4 turns slowest, 2 fastest
    assert {h: turns(m) for h, m in demos.variants[rename].items()} == {
        (True, False): 4,
        (True, True): 3,
        (False, False): 3,
        (False, True): 2,
    }
    # chaining the tests is a rename's habit only: a stub task's habits that differ in it share one episode
    assert all(demos.variants[stub][(e, False)] is demos.variants[stub][(e, True)] for e in (True, False))
    assert demos.conversations[rename] in demos.variants[rename].values()

    rng = random.Random(0)
    seen = {turns(demos.conversation(rename, rng)) for _ in range(40)}
    assert seen == {2, 3, 4}
    assert {turns(demos.conversation(rename, rng, 1.0, 0.0)) for _ in range(10)} == {4}  # always explore, never chain
    assert demos.conversation(rename) is demos.conversations[rename]  # no rng: as recorded

    batch = sft_batch(
        demos, [rename] * 40, SFTSection(explore_fraction=0.5, chain_fraction=0.5), random.Random(0), tokenizer, 4096
    )
    assert {tokenizer.decode(ids).count("<|assistant|>") for ids, _ in batch} == {2, 3, 4}  # a habit drawn each time
