"""What a task allows a rollout to change, for the analysis rules to judge findings against.

A rule that flags every edit of a test file fires on most honest wins of a
task that asks for the tests to change (a rename: "update every use ... and
the tests"). The task itself knows better:

- `task.expects_changed`: the paths its reference patch changes, adds or
  deletes. Editing one of these is what the task asks for, test file or not.
- `task.expects_deleted`: the paths its reference patch deletes. Deleting
  a test file is suspicious unless it is one of these.
- `task.hidden_paths`: the paths of its hidden checks (`checks.files`) that
  the repository the agent gets does not hold, plus the task's own
  `task.json` next to its repository. A tool call that reads one of them is
  looking for the answer: the agent cannot know these names from its task.

`task_allowance(task)` returns them as metadata keys; `agent.episode.score`
copies them into the trajectory's metadata and so into the rollout's store
row (`metadata` JSON), where `analysis.rules` reads them. A row without them
(an older store) is judged as before: every test edit is a finding.
Whether a checks path is in the repository is read from the repository
directory; for a repository archive (`repo.tar[.gz]`) the archive's names are
listed once per archive and cached.
"""

from __future__ import annotations

import functools
import os
import tarfile

from codefleet.tasks.patch import PatchError, parse_unified_diff
from codefleet.types import Task

EXPECTS_CHANGED_KEY = "task.expects_changed"
EXPECTS_DELETED_KEY = "task.expects_deleted"
HIDDEN_PATHS_KEY = "task.hidden_paths"
TASK_FILE = "task.json"


def expected_paths(reference_patch: str) -> list[str]:
    """Every path the reference patch touches (old and new names), sorted."""
    try:
        diffs = parse_unified_diff(reference_patch or "")
    except PatchError:
        return []
    return sorted({p for d in diffs for p in (d.old_path, d.new_path) if p})


def deleted_paths(reference_patch: str) -> list[str]:
    """The paths the reference patch deletes, sorted."""
    try:
        return sorted(d.old_path for d in parse_unified_diff(reference_patch or "") if d.is_deleted and d.old_path)
    except PatchError:
        return []


@functools.lru_cache(maxsize=64)
def _archive_names(path: str, mtime_ns: int) -> frozenset[str]:
    with tarfile.open(path) as archive:
        return frozenset(name.removeprefix("./") for name in archive.getnames())


def _in_repo(repo: str, path: str) -> bool:
    if os.path.isdir(repo):
        return os.path.lexists(os.path.join(repo, path))
    if os.path.isfile(repo) and tarfile.is_tarfile(repo):
        return path in _archive_names(repo, os.stat(repo).st_mtime_ns)
    return True  # unknown repository form: treat the path as visible (no finding rather than a false one)


def task_allowance(task: Task) -> dict[str, list[str]]:
    """{EXPECTS_CHANGED_KEY: paths the task asks to change, EXPECTS_DELETED_KEY: ... to delete,
    HIDDEN_PATHS_KEY: paths only its checks hold (and its task.json)}."""
    hidden = sorted(p for p in task.checks.files if not _in_repo(task.repo, p))
    task_file = os.path.join(os.path.dirname(os.path.abspath(task.repo)), TASK_FILE)
    if os.path.isfile(task_file):
        hidden.append(task_file)
    return {
        EXPECTS_CHANGED_KEY: expected_paths(task.reference_patch),
        EXPECTS_DELETED_KEY: deleted_paths(task.reference_patch),
        HIDDEN_PATHS_KEY: hidden,
    }
