"""The task spec: round trips, per-field errors, task directories."""

from __future__ import annotations

import json
import os

import pytest

from codefleet.tasks.spec import (
    TaskSpecError,
    dumps_task,
    load_task,
    load_tasks,
    save_task,
    save_tasks,
    task_from_dict,
    task_to_dict,
    validate_task_dict,
)
from codefleet.types import TASK_SPEC_VERSION, Budgets, HiddenChecks, Task

PATCH = "--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-x = 1\n+x = 2\n"


def _task(repo: str, task_id: str = "demo-1") -> Task:
    return Task(
        id=task_id,
        repo=repo,
        instruction="Set x to 2.",
        checks=HiddenChecks(
            command="python3 -m pytest -q {tests}",
            fail_to_pass=["tests/test_m.py::test_x"],
            pass_to_pass=["tests/test_m.py::test_y"],
            files={"tests/test_m.py": "..."},
        ),
        setup_commands=["true"],
        test_command="python3 -m pytest -q",
        budgets=Budgets(max_turns=10),
        metadata={"family": "demo", "difficulty": 1},
        reference_patch=PATCH,
    )


def test_round_trip_through_json(tmp_path):
    repo = tmp_path / "demo-1" / "repo"
    repo.mkdir(parents=True)
    task = _task(str(repo))
    path = save_task(task, str(tmp_path))
    stored = json.loads(open(path).read())
    assert stored["repo"] == "repo"  # relative to the task file: the directory can move
    assert list(stored) == [
        "spec_version",
        "id",
        "repo",
        "instruction",
        "setup_commands",
        "test_command",
        "checks",
        "budgets",
        "metadata",
        "reference_patch",
    ]
    assert stored["spec_version"] == TASK_SPEC_VERSION
    loaded = load_task(path)
    assert loaded == task
    assert dumps_task(loaded) == dumps_task(task)


def test_every_problem_is_reported_with_its_field():
    data = task_to_dict(_task("/r"))
    data.update(spec_version=99, id="bad id!", instruction="", setup_commands="make", surprise=1)
    data["checks"] = {
        "command": "pytest",
        "fail_to_pass": [],
        "pass_to_pass": [3],
        "files": {"../x.py": "a"},
        "extra": True,
    }
    data["budgets"] = {"max_turns": 0, "wall_clock_s": "long", "speed": 1}
    data["reference_patch"] = "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n-a\n"
    errors = validate_task_dict(data)
    fields = {e.split(":")[0] for e in errors}
    assert {
        "spec_version",
        "id",
        "instruction",
        "setup_commands",
        "surprise",
        "checks.command",
        "checks.fail_to_pass",
        "checks.pass_to_pass",
        "checks.extra",
        "budgets.max_turns",
        "budgets.wall_clock_s",
        "budgets.speed",
        "reference_patch",
    } <= fields
    assert any(e.startswith("checks.files['../x.py']") for e in errors)
    assert any("{tests}" in e for e in errors)
    with pytest.raises(TaskSpecError) as info:
        task_from_dict(data, "somewhere/task.json")
    assert "somewhere/task.json" in str(info.value) and info.value.errors == errors


def test_overlapping_ids_and_missing_checks_are_errors():
    data = task_to_dict(_task("/r"))
    data["checks"]["pass_to_pass"] = list(data["checks"]["fail_to_pass"])
    assert any("both" in e for e in validate_task_dict(data))
    del data["checks"]
    assert any(e.startswith("checks: required") for e in validate_task_dict(data))
    assert validate_task_dict([]) == ["(top level): a task is a JSON object"]


def test_valid_task_has_no_errors():
    assert validate_task_dict(task_to_dict(_task("/r"))) == []


def test_load_errors_name_the_file(tmp_path):
    broken = tmp_path / "task.json"
    broken.write_text("{")
    with pytest.raises(TaskSpecError, match="not valid JSON"):
        load_task(str(broken))
    data = task_to_dict(_task("no-such-repo"))
    broken.write_text(json.dumps(data))
    with pytest.raises(TaskSpecError, match="repo: .*no-such-repo does not exist"):
        load_task(str(broken))


def test_task_directory_with_index_and_without(tmp_path):
    tasks = []
    for i in range(3):
        repo = tmp_path / f"t{i}" / "repo"
        repo.mkdir(parents=True)
        tasks.append(_task(str(repo), f"t{i}"))
    save_tasks(tasks, str(tmp_path))
    index = [json.loads(line) for line in open(tmp_path / "tasks.jsonl")]
    assert [e["id"] for e in index] == ["t0", "t1", "t2"] and index[0]["family"] == "demo"
    assert [t.id for t in load_tasks(str(tmp_path))] == ["t0", "t1", "t2"]
    os.remove(tmp_path / "tasks.jsonl")  # without the index, every */task.json is found
    assert sorted(t.id for t in load_tasks(str(tmp_path))) == ["t0", "t1", "t2"]
    with pytest.raises(FileNotFoundError, match="tasks generate"):
        load_tasks(str(tmp_path / "missing"))


def test_a_task_file_that_is_not_utf8_is_a_spec_error(tmp_path):
    broken = tmp_path / "task.json"
    broken.write_bytes(b'{"id": "caf\xe9"}')  # Latin-1
    with pytest.raises(TaskSpecError, match=r"not UTF-8 text \(bad byte at offset 11\)") as info:
        load_task(str(broken))
    assert info.value.source == str(broken)


def test_ids_end_where_they_end_and_budgets_are_finite(tmp_path):
    data = task_to_dict(_task("/r"))
    for bad in ("demo-1\n", "demo-1\n\n", "-demo", "a" * 201):
        assert any(e.startswith("id:") for e in validate_task_dict(data | {"id": bad})), bad
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert [
            e
            for e in validate_task_dict(data | {"budgets": {"wall_clock_s": bad}})
            if e.startswith("budgets.wall_clock_s: must be a positive, finite number")
        ], bad
    text = json.dumps(data | {"budgets": {"wall_clock_s": float("nan")}})
    assert "NaN" in text  # what json writes, and reads back, for a NaN
    path = tmp_path / "task.json"
    path.write_text(text)
    with pytest.raises(TaskSpecError, match="budgets.wall_clock_s"):
        load_task(str(path))
    assert validate_task_dict(data | {"budgets": {"wall_clock_s": 1e9, "max_turns": 10**30}}) == []
