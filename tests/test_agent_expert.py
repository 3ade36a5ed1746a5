"""The scripted expert solves generated tasks of every family completely, through the real harness.

Each task runs as a full episode: a prepared sandbox, the agent loop with
the expert as policy (the same tool-call JSON a model writes), the final
diff, and the hidden checks, which must all pass.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from codefleet.agent.clients.scripted import ScriptedExpert
from codefleet.agent.episode import EpisodeConfig, run_episode
from codefleet.tasks.families import FAMILIES
from codefleet.tasks.generate import generate_tasks


def test_expert_solves_two_generated_tasks_of_every_family(tmp_path, config):
    tasks = generate_tasks(str(tmp_path / "tasks"), n=2 * len(FAMILIES), seed=3, split="all")
    assert {t.metadata["family"] for t in tasks} == set(FAMILIES)
    with ThreadPoolExecutor(max_workers=2) as pool:
        trajectories = list(pool.map(lambda task: run_episode(task, ScriptedExpert(task), config), tasks))
    for task, trajectory in zip(tasks, trajectories):
        assert trajectory.checks is not None, (task.id, trajectory.metadata)
        assert trajectory.checks.all_passed, (task.id, trajectory.checks.output[-2000:])
        assert trajectory.reward == 1.0 and trajectory.stop_reason == "submit", task.id
        assert not [e for turn in trajectory.turns for e in turn.errors], task.id  # every call was well-formed
        assert trajectory.diff.strip() and trajectory.n_turns <= 5
        names = [c.name for turn in trajectory.turns for c in turn.tool_calls]
        assert names[:1] == ["list_dir"] and names[-1] == "submit" and "run" in names, task.id
    # parallel tool use happens: exploring turns list and search at once
    assert any(len(trajectory.turns[0].tool_calls) >= 2 for trajectory in trajectories)


def test_expert_renames_with_one_shell_command_and_can_skip_exploring(tmp_path, config):
    from codefleet.agent.clients.scripted import pure_rename, rename_command
    from codefleet.tasks.patch import parse_unified_diff

    rename, bugfix = (
        generate_tasks(str(tmp_path / f), n=1, seed=5, families=[f], split="all")[0] for f in ("rename", "bugfix")
    )
    old, new = pure_rename(parse_unified_diff(rename.reference_patch))
    assert f"`{old}`" in rename.instruction and f"`{new}`" in rename.instruction
    assert pure_rename(parse_unified_diff(bugfix.reference_patch)) is None  # an operator change is no rename
    trajectory = run_episode(rename, ScriptedExpert(rename, explore=False), config, config=EpisodeConfig(prompt="bare"))
    assert trajectory.checks.all_passed, trajectory.checks.output[-2000:]
    assert [m["role"] for m in trajectory.messages[:2]] == ["user", "assistant"]  # bare: the task alone
    calls = [(c.name, c.arguments.get("command")) for turn in trajectory.turns for c in turn.tool_calls]
    assert calls[0] == ("run", rename_command(old, new)) and [n for n, _ in calls[1:]] == ["run", "submit"]


def test_expert_chains_the_tests_into_a_rename_and_explores_when_the_task_names_no_file(tmp_path, config):
    from codefleet.agent.clients.scripted import pure_rename, rename_command
    from codefleet.tasks.patch import parse_unified_diff

    rename, cfg = (
        generate_tasks(str(tmp_path / f), n=1, seed=5, families=[f], split="all")[0] for f in ("rename", "config")
    )
    old, new = pure_rename(parse_unified_diff(rename.reference_patch))
    trajectory = run_episode(
        rename, ScriptedExpert(rename, explore=False, chain_tests=True), config, config=EpisodeConfig(prompt="bare")
    )
    assert trajectory.checks.all_passed and trajectory.n_turns == 2  # rename + tests, then submit
    first = trajectory.turns[0].tool_calls[0]
    assert first.arguments["command"] == f"{rename_command(old, new)} && {rename.test_command}"
    assert "passed" in trajectory.turns[0].tool_results[0].output
    # a config task does not name the file to change: the expert explores before reading it all the same
    assert not any(d.old_path in cfg.instruction for d in parse_unified_diff(cfg.reference_patch))
    assert ScriptedExpert(cfg, explore=False).steps[0] == "explore"


def test_a_word_swap_in_a_config_file_is_no_rename_and_the_expert_solves_it(tmp_path, config):
    from codefleet.agent.clients.scripted import pure_rename
    from codefleet.tasks.generate import generate_task
    from codefleet.tasks.patch import parse_unified_diff

    # `"log_level": "INFO"` -> `"DEBUG"` in defaults.json, while a visible test also says "INFO": the rename
    # command would have edited the test and left the JSON alone (3 of 240 demonstrations failed so)
    task = generate_task(str(tmp_path / "tasks"), "config", 203, seed=0, difficulty=1, split="train")
    diffs = parse_unified_diff(task.reference_patch)
    assert [d.old_path for d in diffs] == ["worker_pool/defaults.json"]
    assert pure_rename(diffs, task.repo) is None and ScriptedExpert(task).rename is None
    trajectory = run_episode(task, ScriptedExpert(task, explore=False, chain_tests=True), config)
    assert trajectory.checks.all_passed and trajectory.stop_reason == "submit"
    # a word swap in one Python file is no rename either when another Python file holds the word
    from codefleet.tasks.patch import make_unified_diff

    before = {"pkg/a.py": "LEVEL = INFO\n", "pkg/b.py": "ok = level == INFO\n"}
    for path, text in before.items():
        (tmp_path / "repo" / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "repo" / path).write_text(text)
    swap = parse_unified_diff(make_unified_diff(before, {**before, "pkg/a.py": "LEVEL = DEBUG\n"}))
    assert pure_rename(swap) == ("INFO", "DEBUG") and pure_rename(swap, str(tmp_path / "repo")) is None
    (tmp_path / "repo" / "pkg" / "b.py").write_text("ok = True\n")
    assert pure_rename(swap, str(tmp_path / "repo")) == ("INFO", "DEBUG")
