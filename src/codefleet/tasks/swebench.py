"""SWE-bench-style JSONL to Tasks, from a local file and local checkouts.

    tasks, errors = load_swebench("dev.jsonl", repos_dir="checkouts", export_dir="tasks/swe")
    save_tasks(tasks, "tasks/swe")        # task.json next to each exported repo.tar

Rows have SWE-bench's fields: `instance_id`, `repo` ("owner/name"),
`base_commit`, `problem_statement`, `FAIL_TO_PASS` and `PASS_TO_PASS`
(JSON-encoded lists, as SWE-bench ships them, or real lists), `test_patch`,
`patch`; `version`, `environment_setup_commit`, `hints_text` and
`created_at` are kept as metadata when present. Every bad row becomes a
`LoadError` naming its line and what is wrong; the other rows still load.

Choices:

- **Checkouts.** `repos_dir/<owner>__<name>` (SWE-bench's naming), else
  `repos_dir/<owner>/<name>`, else `repos_dir/<name>`: any git repository
  (bare too) that contains `base_commit`. It is only read.
- **Export with `git archive`.** `base_commit` is exported to
  `export_dir/<instance_id>/repo.tar`: one file per task, no checkout or
  worktree written into the user's repository, extracted once into a cache
  by `prepare_sandbox`, which then records its own git baseline. (Submodules
  and `export-ignore` paths are not in the archive.) git writes the archive
  into a descriptor codefleet.store.safe_files opened: no link below
  `export_dir` is followed (a planted one is refused, `LinkRefused`).
- **test_patch becomes `checks.files`.** It is applied in memory to the
  base versions of the files it touches, and the resulting whole files are
  written over the workspace at check time — what SWE-bench's harness does
  (reset the test files, apply the test patch), without `git apply` and
  whatever state the agent left. A test_patch that deletes a file or is
  binary cannot be expressed that way and is a row error.
- Environments: a row that names its image (`image_name` or `docker_image`,
  as SWE-Gym and R2E-Gym ship them) runs in that image, saved as an archive
  in `images_dir`; or every task gets `environment`; else the host's
  userland. Images are not built here: `setup_commands` prepare the
  repository inside the sandbox (their effects must stay in the workspace,
  see checks.py) and a `check_command` runs its tests.
"""

from __future__ import annotations

import json
import os
import re
import subprocess

from codefleet.store import safe_files
from codefleet.tasks.patch import PatchError, apply_file_diff, parse_unified_diff
from codefleet.tasks.spec import ID_RE, validate_task
from codefleet.types import HiddenChecks, Task

DEFAULT_CHECK_COMMAND = "python3 -m pytest -rA -p no:cacheprovider {tests}"
_REQUIRED = ("instance_id", "repo", "base_commit", "problem_statement", "test_patch", "patch")
_OPTIONAL_META = ("version", "environment_setup_commit", "created_at")


class LoadError(Exception):
    """One row that could not become a task: its line number (1-based) and why."""

    def __init__(self, line: int, reason: str, instance_id: str | None = None):
        self.line, self.reason, self.instance_id = line, reason, instance_id
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"line {self.line}" + (f" ({self.instance_id})" if self.instance_id else "")
        return f"{where}: {self.reason}"


class _RowError(Exception):
    pass


def _git(checkout: str, *args: str, binary: bool = False) -> str | bytes:
    result = subprocess.run(["git", "-C", checkout, *args], capture_output=True, timeout=600)
    if result.returncode != 0:
        raise _RowError(
            f"`git {' '.join(args[:3])}` failed in {checkout}: {result.stderr.decode(errors='replace').strip()[:300]}"
        )
    return result.stdout if binary else result.stdout.decode("utf-8", "replace")


def _test_ids(row: dict, key: str) -> list[str]:
    value = row.get(key)
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise _RowError(f"{key} is a string but not a JSON-encoded list of test ids") from None
    if not isinstance(value, list) or not all(isinstance(v, str) and v.strip() for v in value):
        raise _RowError(f"{key} must be a list of test ids (or such a list JSON-encoded), got {type(value).__name__}")
    return value


def find_checkout(repos_dir: str, repo: str) -> str:
    """The local checkout of "owner/name" under repos_dir (see the module docstring)."""
    owner, _, name = repo.partition("/")
    candidates = [
        os.path.join(repos_dir, f"{owner}__{name}"),
        os.path.join(repos_dir, owner, name),
        os.path.join(repos_dir, name),
    ]
    for path in candidates:
        if os.path.isdir(path):
            return path
    raise _RowError(
        f"no checkout of {repo} in {repos_dir}: expected one of "
        f"{', '.join(os.path.relpath(c, repos_dir) for c in candidates)} (git clone it there)"
    )


def _check_files(checkout: str, base: str, test_patch: str) -> dict[str, str]:
    """The files the test patch touches, whole, as they are after it."""
    try:
        diffs = parse_unified_diff(test_patch)
    except PatchError as e:
        raise _RowError(f"test_patch is not a valid diff: {e}") from None
    if not diffs:
        raise _RowError("test_patch has no file changes")
    files: dict[str, str] = {}
    for diff in diffs:
        if diff.is_binary or diff.is_deleted:
            raise _RowError(
                f"test_patch {'changes a binary file' if diff.is_binary else 'deletes'} {diff.path}; "
                "hidden checks can only write text files"
            )
        old = ""
        if not diff.is_new:
            blob = _git(checkout, "cat-file", "-p", f"{base}:{diff.old_path}", binary=True)
            try:
                old = blob.decode("utf-8")
            except UnicodeDecodeError:
                raise _RowError(f"test_patch touches {diff.old_path}, which is not UTF-8 text") from None
        try:
            files[diff.new_path] = apply_file_diff(old, diff)
        except PatchError as e:
            raise _RowError(f"test_patch does not apply to base_commit: {e}") from None
    return files


def _export(checkout: str, base: str, target: str, root: str) -> None:
    """`base` of `checkout` as the tar file `target`, written atomically beneath `root` (the export directory the
    user named) without following a link below it: git writes into a descriptor safe_files opened."""
    safe_files.write_file_beneath(root, target, lambda f: _git_archive(checkout, base, f), mode=0o644)


def _git_archive(checkout: str, base: str, out) -> None:
    result = subprocess.run(
        ["git", "-C", checkout, "archive", "--format=tar", base],
        check=False,
        stdout=out,
        stderr=subprocess.PIPE,
        timeout=600,
    )
    if result.returncode != 0:
        raise _RowError(
            f"`git archive --format=tar {base}` failed in {checkout}: "
            f"{result.stderr.decode(errors='replace').strip()[:300]}"
        )


def _row_task(
    row: object, repos_dir: str, export_dir: str, setup_commands: list[str], check_command: str, test_command: str
) -> Task:
    if not isinstance(row, dict):
        raise _RowError("a row must be a JSON object")
    missing = [k for k in _REQUIRED if not isinstance(row.get(k), str) or not row[k].strip()]
    if missing:
        raise _RowError(f"missing, empty or non-string field(s): {', '.join(missing)}")
    instance_id, repo, base = row["instance_id"], row["repo"], row["base_commit"].strip()
    if not ID_RE.fullmatch(instance_id):
        raise _RowError(f"instance_id {instance_id!r} must be letters, digits, '.', '_' or '-'")
    if not re.match(r"^[\w.-]+/[\w.-]+$", repo):
        raise _RowError(f"repo must be 'owner/name', got {repo!r}")
    fail_to_pass, pass_to_pass = _test_ids(row, "FAIL_TO_PASS"), _test_ids(row, "PASS_TO_PASS")
    if not fail_to_pass:
        raise _RowError("FAIL_TO_PASS is empty")
    try:
        if not parse_unified_diff(row["patch"]):
            raise _RowError("patch has no file changes")
    except PatchError as e:
        raise _RowError(f"patch is not a valid diff: {e}") from None
    checkout = find_checkout(repos_dir, repo)
    try:
        base = _git(checkout, "rev-parse", "--verify", "--quiet", f"{base}^{{commit}}").strip()
    except _RowError:
        raise _RowError(
            f"base_commit {base} is not in {checkout} (fetch it: git -C {checkout} fetch origin {base})"
        ) from None
    files = _check_files(checkout, base, row["test_patch"])
    target = os.path.join(os.path.abspath(export_dir), instance_id, "repo.tar")
    _export(checkout, base, target, os.path.abspath(export_dir))
    metadata: dict[str, str | int | float] = {
        "family": "swebench",
        "template": repo,
        "source_repo": repo,
        "base_commit": base,
    }
    metadata.update({k: str(row[k]) for k in _OPTIONAL_META if row.get(k) not in (None, "")})
    task = Task(
        id=instance_id,
        repo=os.path.abspath(target),
        instruction=row["problem_statement"],
        checks=HiddenChecks(
            command=check_command,
            fail_to_pass=fail_to_pass,
            pass_to_pass=[t for t in pass_to_pass if t not in fail_to_pass],
            files=files,
        ),
        setup_commands=list(setup_commands),
        test_command=test_command,
        metadata=metadata,
        reference_patch=row["patch"],
    )
    problems = validate_task(task)
    if problems:
        raise _RowError("; ".join(problems))
    return task


def _row_environment(row: dict, environment: str, images_dir: str | None) -> str:
    name = row.get("image_name") or row.get("docker_image")
    if not images_dir or not isinstance(name, str) or not name:
        return environment
    archive = os.path.join(images_dir, re.sub(r"[/:]", "_", name) + ".tar")
    if not os.path.isfile(archive):
        raise _RowError(
            f"its image {name!r} is not saved in {images_dir} as {os.path.basename(archive)} "
            f"(`docker save {name} -o {archive}`)"
        )
    return os.path.abspath(archive)


def load_swebench(
    jsonl_path: str,
    repos_dir: str,
    export_dir: str,
    setup_commands: list[str] | None = None,
    check_command: str = DEFAULT_CHECK_COMMAND,
    test_command: str = "",
    environment: str = "",
    images_dir: str | None = None,
) -> tuple[list[Task], list[LoadError]]:
    """Tasks from the good rows and a LoadError per bad row (blank lines are skipped). `environment`: every
    task's (docs/environments.md); `images_dir`: where a row that names its image (`image_name`,
    `docker_image`) finds it saved as an archive, `<name with / and : as _>.tar` (a row error if missing)."""
    tasks: list[Task] = []
    errors: list[LoadError] = []
    seen: set[str] = set()
    with open(jsonl_path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                errors.append(LoadError(number, f"not UTF-8 text (bad byte at offset {e.start}); save it as UTF-8"))
                continue
            if not line.strip():
                continue
            instance_id = None
            try:
                row = json.loads(line)
                instance_id = row.get("instance_id") if isinstance(row, dict) else None
                if not isinstance(instance_id, str):  # reported by _row_task; a list would not even hash
                    instance_id = None
                if instance_id in seen:
                    raise _RowError(f"duplicate instance_id {instance_id!r} (first row kept)")
                task = _row_task(row, repos_dir, export_dir, list(setup_commands or []), check_command, test_command)
                task.environment = _row_environment(row, environment, images_dir)
            except json.JSONDecodeError as e:
                errors.append(LoadError(number, f"not valid JSON: {e}"))
                continue
            except _RowError as e:
                errors.append(LoadError(number, str(e), instance_id))
                continue
            except safe_files.LinkRefused:  # a link planted in export_dir: not this row's fault, every row's
                raise
            except (OSError, subprocess.SubprocessError) as e:
                errors.append(LoadError(number, f"could not read the checkout: {e}", instance_id))
                continue
            seen.add(task.id)
            tasks.append(task)
    return tasks, errors
