"""The diff of a user's repository, and applying it back.

The user's repository is overlaid into a sandbox (copy-on-write), so the
agent can do anything there and the real repository is untouched. To show
and apply what changed, `snapshot()` records the workspace as a git tree in a
private git directory inside the workspace (`.codefleet/git`, never the
user's own `.git`, which may not exist or may point outside the sandbox) and
`diff()` compares the workspace with it: new, deleted and binary files
included, files the repository's .gitignore ignores left out. Both run as
separate processes at the workspace root, so they neither see nor disturb
the agent's shell. Forked sandboxes inherit the snapshot.

`apply_diff()` applies a diff to the real repository with `git apply`,
checking first that it applies cleanly (all or nothing).
"""

from __future__ import annotations

import os
import subprocess

from codefleet.sandbox.base import Sandbox

PRIVATE_DIR = ".codefleet"
_GIT = (f"export GIT_DIR=\"$PWD/{PRIVATE_DIR}/git\" GIT_WORK_TREE=\"$PWD\" "
        f"GIT_INDEX_FILE=\"$PWD/{PRIVATE_DIR}/git/index\"; git() {{ command git -c safe.directory='*' "
        "-c core.autocrlf=false -c core.quotepath=off \"$@\"; }")


class WorkspaceDiffError(RuntimeError):
    """git could not record or diff the workspace; the message says why."""


def _git(sandbox: Sandbox, script: str, timeout_s: float = 300) -> str:
    result = sandbox.run_oneoff(["bash", "-c", f"{_GIT}\nset -e\n{script}"], timeout_s=timeout_s)
    if not result.ok:
        raise WorkspaceDiffError(f"recording the workspace with git failed (exit {result.exit_code}): "
                                 f"{result.output.strip()[-400:]}; is git installed on this host?")
    return result.output


def snapshot(sandbox: Sandbox) -> None:
    """Record the workspace's current files as the baseline `diff()` compares against."""
    _git(sandbox, f"""
mkdir -p {PRIVATE_DIR}
git init -q
printf '/{PRIVATE_DIR}/\\n' > "$GIT_DIR/info/exclude"
git add -A
git write-tree > "$GIT_DIR/codefleet-base"
""")


def diff(sandbox: Sandbox) -> str:
    """The changes since `snapshot()`, as a `git apply`-able unified diff."""
    return _git(sandbox, """
git add -A
git diff --binary --no-color --no-ext-diff "$(cat "$GIT_DIR/codefleet-base")" "$(git write-tree)"
""")


def apply_diff(repo: str, patch: str) -> None:
    """Apply `patch` (from diff()) to the directory `repo`; raises RuntimeError, leaving `repo`
    untouched, if it does not apply cleanly."""
    if not patch.strip():
        return
    repo = os.path.abspath(repo)
    prefix = subprocess.run(["git", "rev-parse", "--show-prefix"], cwd=repo, capture_output=True, text=True)
    args = ["git", "apply", "--whitespace=nowarn"]
    if prefix.returncode == 0 and prefix.stdout.strip():  # repo is a subdirectory of a git repository
        args.append(f"--directory={prefix.stdout.strip().rstrip('/')}")
    for check in (True, False):
        result = subprocess.run(args + (["--check"] if check else []) + ["-"], cwd=repo, input=patch,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"the diff does not apply to {repo} ({result.stderr.strip()[:400]}); did the files "
                               "change while the agent ran? Nothing was changed; the diff is printed above")
