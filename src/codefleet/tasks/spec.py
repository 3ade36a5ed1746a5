"""The task spec: versioned JSON, one file per task, validated field by field.

A task directory holds one sub-directory per task and an index:

    DIR/tasks.jsonl            one line per task: id, path of its task.json, family, template, split, difficulty
    DIR/<id>/task.json         the task (format below; docs/tasks.md)
    DIR/<id>/repo/             its repository (or repo.tar / repo.tar.gz)

`repo` in task.json is relative to the task.json's directory when it lies
inside it, so a task directory can be moved or copied; `load_task` makes it
absolute. Validation collects every problem (`checks.command: must contain
{tests}`) and raises one `TaskSpecError` naming the file and all of them, so
a hand-written task is fixed in one go. Unknown keys are errors: a typo must
not silently drop a field.

A task directory may be written into storage someone else prepared (a run
directory's tasks/, `tasks generate --out`), by root: `save_task` and
`save_tasks` write through codefleet.store.safe_files, so nothing below the
directory the user named (`root`, default the task directory) is reached
through a symlink; a link planted as a task.json or the index is refused.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re

from codefleet.store import safe_files
from codefleet.tasks.patch import PatchError, parse_unified_diff
from codefleet.types import TASK_SPEC_VERSION, Budgets, HiddenChecks, Task

TASK_FILE = "task.json"
INDEX_FILE = "tasks.jsonl"
ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")  # use with fullmatch
_TOP_KEYS = (
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
    "environment",
)
_CHECK_KEYS = ("command", "fail_to_pass", "pass_to_pass", "files")
_INDEX_META = ("family", "template", "split", "difficulty")


class TaskSpecError(ValueError):
    """A task file that does not follow the spec; `errors` lists every problem as `field: what is wrong`."""

    def __init__(self, errors: list[str], source: str = "task"):
        self.errors = list(errors)
        self.source = source
        super().__init__(
            f"{source}: {len(errors)} problem(s) in the task spec (docs/tasks.md):\n  " + "\n  ".join(errors)
        )


# -- validation -----------------------------------------------------------------------


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _check_relative_path(path: str) -> str | None:
    if not path or path.startswith("/") or "\\" in path or any(p in ("", ".", "..") for p in path.split("/")):
        return "must be a relative path inside the repository, without '.' or '..' parts"
    return None


def _validate_checks(data: object, errors: list[str]) -> None:
    if not isinstance(data, dict):
        errors.append("checks: must be an object with command, fail_to_pass, pass_to_pass, files")
        return
    for key in sorted(set(data) - set(_CHECK_KEYS)):
        errors.append(f"checks.{key}: unknown key (allowed: {', '.join(_CHECK_KEYS)})")
    command = data.get("command")
    if not isinstance(command, str) or not command.strip():
        errors.append(
            "checks.command: required, a shell command such as 'python3 -m pytest -q -p no:cacheprovider {tests}'"
        )
    elif "{tests}" not in command:
        errors.append("checks.command: must contain {tests} (replaced by the test ids)")
    for key in ("fail_to_pass", "pass_to_pass"):
        value = data.get(key, [])
        if not _is_str_list(value) or any(not v.strip() for v in value):
            errors.append(f"checks.{key}: must be a list of test ids (non-empty strings)")
    f2p, p2p = data.get("fail_to_pass", []), data.get("pass_to_pass", [])
    if _is_str_list(f2p) and not f2p:
        errors.append("checks.fail_to_pass: needs at least one test that fails before and passes after the fix")
    if _is_str_list(f2p) and _is_str_list(p2p):
        both = sorted(set(f2p) & set(p2p))
        if both:
            errors.append(f"checks: test ids in both fail_to_pass and pass_to_pass: {both[:5]}")
        if len(set(f2p)) != len(f2p) or len(set(p2p)) != len(p2p):
            errors.append("checks: a test id is listed twice")
    files = data.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        errors.append("checks.files: must be an object mapping relative paths to file contents (strings)")
    else:
        for path in files:
            problem = _check_relative_path(path)
            if problem:
                errors.append(f"checks.files[{path!r}]: {problem}")


def _validate_budgets(data: object, errors: list[str]) -> None:
    if not isinstance(data, dict):
        errors.append("budgets: must be an object")
        return
    names = [f.name for f in dataclasses.fields(Budgets)]
    for key, value in data.items():
        if key not in names:
            errors.append(f"budgets.{key}: unknown key (allowed: {', '.join(names)})")
        elif (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value <= 0
            or isinstance(value, float)
            and not math.isfinite(value)
        ):  # NaN <= 0 is False
            errors.append(f"budgets.{key}: must be a positive, finite number, got {value!r}")
        elif key != "wall_clock_s" and not isinstance(value, int):
            errors.append(f"budgets.{key}: must be a whole number, got {value!r}")


def validate_task_dict(data: object) -> list[str]:
    """Every problem of a task JSON object, as `field: what is wrong` (empty when valid)."""
    if not isinstance(data, dict):
        return ["(top level): a task is a JSON object"]
    errors: list[str] = []
    for key in sorted(set(data) - set(_TOP_KEYS)):
        errors.append(f"{key}: unknown key (allowed: {', '.join(_TOP_KEYS)})")
    version = data.get("spec_version")
    if isinstance(version, bool) or not isinstance(version, int):
        errors.append(f"spec_version: required, an integer (this codefleet reads version {TASK_SPEC_VERSION})")
    elif version != TASK_SPEC_VERSION:
        errors.append(f"spec_version: {version} is not supported; this codefleet reads version {TASK_SPEC_VERSION}")
    task_id = data.get("id")
    if not isinstance(task_id, str) or not ID_RE.fullmatch(task_id):
        errors.append(f"id: required, letters, digits, '.', '_' or '-' (at most 200), got {task_id!r}")
    for key in ("repo", "instruction"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            errors.append(f"{key}: required, a non-empty string")
    if not _is_str_list(data.get("setup_commands", [])):
        errors.append("setup_commands: must be a list of shell commands (strings)")
    if not isinstance(data.get("test_command", ""), str):
        errors.append("test_command: must be a string")
    if not isinstance(data.get("environment", ""), str):
        errors.append("environment: must be a string (an image archive, a root filesystem or an image id)")
    if "checks" not in data:
        errors.append("checks: required (command, fail_to_pass, pass_to_pass, files)")
    else:
        _validate_checks(data["checks"], errors)
    _validate_budgets(data.get("budgets", {}), errors)
    metadata = data.get("metadata", {})
    if not isinstance(metadata, dict) or not all(
        isinstance(v, (str, int, float)) and not isinstance(v, bool) for v in metadata.values()
    ):
        errors.append("metadata: must be an object of strings and numbers")
    patch = data.get("reference_patch", "")
    if not isinstance(patch, str):
        errors.append("reference_patch: must be a string (a unified diff)")
    elif patch.strip():
        try:
            if not parse_unified_diff(patch):
                errors.append("reference_patch: not a unified diff (no --- / +++ file headers)")
        except PatchError as e:
            errors.append(f"reference_patch: {e}")
    return errors


def validate_task(task: Task) -> list[str]:
    """Every problem of a Task object (the same rules as for its JSON)."""
    return validate_task_dict(task_to_dict(task))


# -- conversion -----------------------------------------------------------------------


def task_to_dict(task: Task) -> dict:
    """The task as a JSON object, keys in spec order."""
    return {
        "spec_version": task.spec_version,
        "id": task.id,
        "repo": task.repo,
        "instruction": task.instruction,
        "setup_commands": list(task.setup_commands),
        "test_command": task.test_command,
        "checks": {
            "command": task.checks.command,
            "fail_to_pass": list(task.checks.fail_to_pass),
            "pass_to_pass": list(task.checks.pass_to_pass),
            "files": dict(task.checks.files),
        },
        "budgets": dataclasses.asdict(task.budgets),
        "metadata": dict(task.metadata),
        "reference_patch": task.reference_patch,
        **({"environment": task.environment} if task.environment else {}),  # absent: the host's userland
    }


def task_from_dict(data: dict, source: str = "task") -> Task:
    """A Task from its JSON object; raises TaskSpecError listing every problem."""
    errors = validate_task_dict(data)
    if errors:
        raise TaskSpecError(errors, source)
    checks = data["checks"]
    budgets = {k: (float(v) if k == "wall_clock_s" else v) for k, v in data.get("budgets", {}).items()}
    return Task(
        id=data["id"],
        repo=data["repo"],
        instruction=data["instruction"],
        checks=HiddenChecks(
            command=checks["command"],
            fail_to_pass=list(checks.get("fail_to_pass", [])),
            pass_to_pass=list(checks.get("pass_to_pass", [])),
            files=dict(checks.get("files", {})),
        ),
        setup_commands=list(data.get("setup_commands", [])),
        test_command=data.get("test_command", ""),
        budgets=Budgets(**budgets),
        metadata=dict(data.get("metadata", {})),
        reference_patch=data.get("reference_patch", ""),
        spec_version=data["spec_version"],
        environment=data.get("environment", ""),
    )


def dumps_task(task: Task) -> str:
    """Canonical JSON text of a task (stable: same task, same bytes)."""
    return json.dumps(task_to_dict(task), indent=2, ensure_ascii=False) + "\n"


# -- files ----------------------------------------------------------------------------


def load_task(path: str) -> Task:
    """Read one task.json; `repo` comes back as an absolute path."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise TaskSpecError([f"(file): not valid JSON: {e}"], path) from None
    except UnicodeDecodeError as e:
        raise TaskSpecError(
            [f"(file): not UTF-8 text (bad byte at offset {e.start}); save it as UTF-8"], path
        ) from None
    task = task_from_dict(data, path)
    if not os.path.isabs(task.repo):
        task.repo = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), task.repo))
    if not os.path.exists(task.repo):
        raise TaskSpecError([f"repo: {task.repo} does not exist (a directory, .tar or .tar.gz)"], path)
    if task.environment and not task.environment.startswith("sha256:") and not os.path.isabs(task.environment):
        task.environment = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), task.environment))
    return task


def save_task(task: Task, out_dir: str, root: str | None = None) -> str:
    """Write `out_dir/<id>/task.json` (repo and environment made relative when
    they lie inside that directory) and return its path. Raises TaskSpecError if invalid.
    `root`: the directory the user named (default `out_dir`); no link below it is followed."""
    errors = validate_task(task)
    if errors:
        raise TaskSpecError(errors, f"task {task.id!r}")
    task_dir = os.path.join(os.path.abspath(out_dir), task.id)
    stored = dataclasses.replace(task, repo=_relative_if_inside(task.repo, task_dir))
    if task.environment and not task.environment.startswith("sha256:"):
        stored.environment = _relative_if_inside(task.environment, task_dir)
    path = os.path.join(task_dir, TASK_FILE)
    safe_files.write_file_beneath(os.path.abspath(root or out_dir), path, dumps_task(stored), mode=0o644)
    return path


def index_line(task: Task) -> str:
    entry = {"id": task.id, "path": f"{task.id}/{TASK_FILE}"}
    entry.update({k: task.metadata[k] for k in _INDEX_META if k in task.metadata})
    return json.dumps(entry, ensure_ascii=False)


def _relative_if_inside(path: str, task_dir: str) -> str:
    path = os.path.abspath(path)
    inside = os.path.commonpath([path, os.path.abspath(task_dir)]) == os.path.abspath(task_dir)
    return os.path.relpath(path, task_dir) if inside else path


def save_tasks(tasks: list[Task], out_dir: str, root: str | None = None) -> list[str]:
    """Save every task and write the tasks.jsonl index; paths of the task files. `root`: as for `save_task`."""
    root = os.path.abspath(root or out_dir)
    paths = [save_task(task, out_dir, root) for task in tasks]
    write_index(tasks, out_dir, root)
    return paths


def write_index(tasks: list[Task], out_dir: str, root: str | None = None) -> None:
    """`out_dir/tasks.jsonl`, one line per task, written atomically with no link below `root` followed."""
    safe_files.write_file_beneath(
        os.path.abspath(root or out_dir),
        os.path.join(os.path.abspath(out_dir), INDEX_FILE),
        "".join(index_line(task) + "\n" for task in tasks),
        mode=0o644,
    )


def task_paths(task_dir: str) -> list[str]:
    """Task files of a directory: from tasks.jsonl when present, else every */task.json."""
    if not os.path.exists(task_dir):
        raise FileNotFoundError(
            f"task directory {task_dir!r} does not exist; create one with `codefleet tasks generate --out DIR`"
        )
    index = os.path.join(task_dir, INDEX_FILE)
    if os.path.exists(index):
        paths = []
        with open(index, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    paths.append(os.path.join(task_dir, json.loads(line)["path"]))
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise TaskSpecError([f"line {number}: not an index entry with a 'path' ({e})"], index) from None
        return paths
    if os.path.isfile(task_dir):
        return [task_dir]
    return sorted(
        os.path.join(task_dir, name, TASK_FILE)
        for name in os.listdir(task_dir)
        if os.path.isfile(os.path.join(task_dir, name, TASK_FILE))
    )


def load_tasks(task_dir: str) -> list[Task]:
    """Every task of a task directory (or a single task.json), in index order."""
    return [load_task(path) for path in task_paths(task_dir)]
