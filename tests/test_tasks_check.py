"""Checking tasks in real sandboxes: `tasks check` over every family, unsound
tasks caught, the checker not fooled, the diff and the baseline right."""

from __future__ import annotations

import dataclasses
import os

import pytest

from codefleet.tasks.checks import (
    PatchApplyError,
    TaskSetupError,
    apply_patch,
    check_task,
    check_tasks,
    prepare_sandbox,
    run_checks,
    workspace_diff,
)
from codefleet.tasks.cli import main
from codefleet.tasks.generate import generate_task
from codefleet.tasks.patch import apply_unified_diff, make_unified_diff
from codefleet.tasks.spec import load_tasks, save_tasks
from codefleet.types import HiddenChecks, Task

TASKS_PER_FAMILY = 2


@pytest.fixture(scope="module")
def bugfix_task(tmp_path_factory):
    return generate_task(str(tmp_path_factory.mktemp("bugfix")), "bugfix", 0, seed=4, difficulty=1, split="all")


def test_tasks_check_over_every_family(tmp_path, state_dir, capsys):
    out = str(tmp_path / "tasks")
    assert (
        main(["tasks", "generate", "--out", out, "--n", str(5 * TASKS_PER_FAMILY), "--seed", "21", "--split", "all"])
        == 0
    )
    assert "wrote 10 tasks" in capsys.readouterr().out
    assert main(["tasks", "check", out, "--jobs", "2", "--set", f"state_dir={state_dir}"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len([line for line in lines if line.startswith("ok ")]) == 10
    assert lines[-1].startswith("checked 10 tasks") and "10 sound, 0 unsound" in lines[-1]
    families = {t.metadata["family"] for t in load_tasks(out)}
    assert families == {"bugfix", "stub", "rename", "config", "multifile"}


def _broken_variants(task: Task) -> dict[str, Task]:
    checks = task.checks
    flaky = (
        "import pathlib\n\n\ndef test_flaky():\n    flag = pathlib.Path('.flaky-flag')\n"
        "    first = not flag.exists()\n    flag.write_text('x')\n    assert first\n"
    )
    return {
        "no-fix": dataclasses.replace(
            task,
            id="no-fix",
            reference_patch=make_unified_diff(
                {"README.md": open(os.path.join(task.repo, "README.md")).read()}, {"README.md": "# changed\n"}
            ),
        ),
        "passes-untouched": dataclasses.replace(
            task,
            id="passes-untouched",
            checks=dataclasses.replace(
                checks, fail_to_pass=checks.fail_to_pass + checks.pass_to_pass[:1], pass_to_pass=checks.pass_to_pass[1:]
            ),
        ),
        "fails-untouched": dataclasses.replace(
            task,
            id="fails-untouched",
            checks=dataclasses.replace(
                checks, fail_to_pass=checks.fail_to_pass[1:], pass_to_pass=checks.pass_to_pass + checks.fail_to_pass[:1]
            ),
        )
        if len(checks.fail_to_pass) > 1
        else None,
        "does-not-apply": dataclasses.replace(
            task, id="does-not-apply", reference_patch=make_unified_diff({"NOPE.md": "x\n"}, {"NOPE.md": "y\n"})
        ),
        "flaky": dataclasses.replace(
            task,
            id="flaky",
            checks=dataclasses.replace(
                checks,
                files=checks.files | {"tests/test_flaky.py": flaky},
                pass_to_pass=checks.pass_to_pass + ["tests/test_flaky.py::test_flaky"],
            ),
        ),
    }


def test_unsound_tasks_are_reported(bugfix_task, tmp_path, state_dir, capsys):
    variants = {k: v for k, v in _broken_variants(bugfix_task).items() if v is not None}
    out = str(tmp_path / "broken")
    save_tasks([bugfix_task, *variants.values()], out)
    with open(os.path.join(out, "tasks.jsonl"), "a") as index:  # and one task file that is not valid
        index.write('{"id": "garbled", "path": "garbled/task.json"}\n')
    os.makedirs(os.path.join(out, "garbled"))
    with open(os.path.join(out, "garbled", "task.json"), "w") as f:
        f.write('{"spec_version": 1, "id": "garbled"}')
    assert main(["tasks", "check", out, "--jobs", "2", "--set", f"state_dir={state_dir}"]) == 1
    text = capsys.readouterr().out
    lines = {line.split()[1]: line for line in text.splitlines() if line.startswith(("ok ", "UNSOUND "))}
    assert lines[bugfix_task.id].startswith("ok ")
    assert "with the reference patch these checks fail" in lines["no-fix"]
    assert "already pass on the untouched repo" in lines["passes-untouched"]
    assert "does not apply" in lines["does-not-apply"]
    assert "nondeterministic" in lines["flaky"]
    if "fails-untouched" in variants:
        assert "pass_to_pass tests fail on the untouched repo" in lines["fails-untouched"]
    assert "instruction: required" in lines[os.path.join(out, "garbled", "task.json")]
    assert f"{len(variants) + 1} unsound" in text.splitlines()[-1]


def test_missing_ids_fail_and_printed_results_do_not_count(bugfix_task, config):
    liar = (
        "def test_liar():\n    print('PASSED tests/test_liar.py::test_liar')\n"
        "    print('tests/test_liar.py::test_liar PASSED')\n    raise SystemExit(0)\n"
    )
    checks = bugfix_task.checks
    task = dataclasses.replace(
        bugfix_task,
        checks=dataclasses.replace(
            checks,
            files=checks.files | {"tests/test_liar.py": liar},
            fail_to_pass=checks.fail_to_pass
            + ["tests/test_liar.py::test_liar", "tests/test_liar.py::test_nope", "tests/no_such_file.py::test_x"],
        ),
    )
    sandbox = prepare_sandbox(task, config)
    try:
        apply_patch(sandbox, task.reference_patch)
        result = run_checks(sandbox, task)
    finally:
        sandbox.close()
    assert result.per_test["tests/test_liar.py::test_liar"] is False
    assert result.per_test["tests/test_liar.py::test_nope"] is False
    assert result.per_test["tests/no_such_file.py::test_x"] is False
    assert all(result.per_test[i] for i in checks.fail_to_pass + checks.pass_to_pass)  # the real ones still ran
    assert not result.all_passed and result.passed == result.total - 3
    assert 0 < result.fraction < 1


def test_workspace_diff_is_everything_the_agent_changed(bugfix_task, config):
    sandbox = prepare_sandbox(bugfix_task, config)
    try:
        assert workspace_diff(sandbox) == ""
        repo_files = {e.path for e in sandbox.list_dir(".", recursive=True) if e.kind == "file"}
        for hidden in set(bugfix_task.checks.files) - {
            os.path.relpath(os.path.join(d, f), bugfix_task.repo) for d, _, fs in os.walk(bugfix_task.repo) for f in fs
        }:
            assert hidden not in repo_files  # hidden tests are not in the sandbox before the checks
        apply_patch(sandbox, bugfix_task.reference_patch)
        sandbox.write_file("notes/new.txt", "added\n")
        sandbox.exec(
            "rm README.md && python3 -m pytest -q tests >/dev/null; git add -A && "
            "git -c user.name=a -c user.email=a@b commit -qm 'agent commit'"
        )
        diff = workspace_diff(sandbox)
    finally:
        sandbox.close()
    before = {
        path: open(os.path.join(bugfix_task.repo, path)).read()
        for path in [
            os.path.relpath(os.path.join(d, f), bugfix_task.repo) for d, _, fs in os.walk(bugfix_task.repo) for f in fs
        ]
    }
    after = apply_unified_diff(before, diff)
    expected = apply_unified_diff(before, bugfix_task.reference_patch)
    expected.pop("README.md")
    expected["notes/new.txt"] = "added\n"
    assert after == expected  # the agent's commit did not hide its changes; __pycache__ is not in the diff
    assert "__pycache__" not in diff


def test_setup_commands_run_before_the_baseline(bugfix_task, config, tmp_path):
    task = dataclasses.replace(bugfix_task, setup_commands=["echo built > build.txt", "export FOO=1"])
    sandbox = prepare_sandbox(task, config, cache_dir=str(tmp_path))
    try:
        assert sandbox.read_file("build.txt") == "built\n"
        assert workspace_diff(sandbox) == ""  # setup output is part of the baseline
    finally:
        sandbox.close()
    with pytest.raises(TaskSetupError, match="setup command 'exit 3' failed"):
        prepare_sandbox(dataclasses.replace(bugfix_task, setup_commands=["exit 3"]), config)


def test_apply_patch_refuses_a_bad_patch(bugfix_task, config):
    sandbox = prepare_sandbox(bugfix_task, config)
    try:
        with pytest.raises(PatchApplyError, match="git apply failed"):
            apply_patch(sandbox, "--- a/nope.py\n+++ b/nope.py\n@@ -1 +1 @@\n-a\n+b\n")
    finally:
        sandbox.close()


def test_existing_git_repo_keeps_its_history_and_uncommitted_work(tmp_path, config):
    import subprocess

    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "m.py").write_text("X = 1\n")
    (repo / "tests" / "test_m.py").write_text("from m import X\n\n\ndef test_x():\n    assert X == 2\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "one"], cwd=repo, check=True)
    (repo / "dirty.txt").write_text("uncommitted\n")
    task = Task(
        id="gitrepo",
        repo=str(repo),
        instruction="Make X 2.",
        checks=HiddenChecks(
            command="python3 -m pytest -q -p no:cacheprovider {tests}", fail_to_pass=["tests/test_m.py::test_x"]
        ),
        reference_patch=make_unified_diff({"m.py": "X = 1\n"}, {"m.py": "X = 2\n"}),
    )
    report = check_task(task, config)
    assert report.sound, report.problems
    sandbox = prepare_sandbox(task, config)
    try:
        assert workspace_diff(sandbox) == ""  # uncommitted work is part of the baseline
        assert sandbox.exec("git log --format=%s").output.split() == ["one"]  # HEAD untouched
        assert "dirty.txt" in sandbox.exec("git status --short").output
    finally:
        sandbox.close()


def test_check_tasks_keeps_order_and_reports_each(bugfix_task, config):
    seen = []
    reports = check_tasks([bugfix_task], config, jobs=1, on_report=seen.append)
    assert [r.task_id for r in reports] == [bugfix_task.id] and seen == reports
    report = reports[0]
    assert report.sound and len(report.reference) == 2 and len(report.untouched) == 2
    assert report.reference[0].all_passed and not report.untouched[0].all_passed
    assert report.line().startswith(f"ok       {bugfix_task.id}  reference ")


def test_runs_below_one_are_refused(bugfix_task, config, tmp_path, capsys):
    for runs in (0, -1):
        with pytest.raises(ValueError, match="runs must be a whole number of at least 1"):
            check_task(bugfix_task, config, runs=runs)  # not a report that calls an unchecked task sound
        with pytest.raises(ValueError, match="at least 1"):
            check_tasks([bugfix_task], config, runs=runs)
    save_tasks([bugfix_task], str(tmp_path / "tasks"))
    assert main(["tasks", "check", str(tmp_path / "tasks"), "--runs", "0"]) == 2
    captured = capsys.readouterr()
    assert captured.err == "codefleet tasks check: --runs must be at least 1, got 0\n" and captured.out == ""


def test_same_second_same_size_edit_is_in_the_diff(tmp_path, config):
    """Git compares whole seconds: a same-size edit in the second the baseline
    was taken is only caught by git's racy-index check, which the temporary
    index must not defeat (it once did, with a fresh mtime on the copy)."""
    import time

    repo = tmp_path / "repo"
    repo.mkdir()
    task = Task(
        id="racy",
        repo=str(repo),
        instruction="x",
        checks=HiddenChecks(command="python3 -m pytest {tests}", fail_to_pass=["t.py::t"]),
    )
    time.sleep(1.02 - time.time() % 1)  # start of a second: file, baseline and edit fit in it
    (repo / "m.py").write_text("X = 1 + 2\n")
    sandbox = prepare_sandbox(task, config)
    try:
        sandbox.write_file("m.py", "X = 1 - 2\n")  # same size, same inode
        time.sleep(1.02 - time.time() % 1)  # the diff's temporary index is made in a later second
        assert "+X = 1 - 2" in workspace_diff(sandbox)
    finally:
        sandbox.close()


def test_a_missing_task_directory_is_one_sentence(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    assert main(["tasks", "check", missing]) == 2
    captured = capsys.readouterr()
    assert (
        captured.err
        == (
            f"codefleet tasks check: task directory {missing!r} does not exist; create one with "
            "`codefleet tasks generate --out DIR`\n"
        )
        and captured.out == ""
    )
