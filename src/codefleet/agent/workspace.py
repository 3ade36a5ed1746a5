"""The diff of a user's repository, and applying it back.

The user's repository is overlaid into a sandbox (copy-on-write), so the
agent can do anything there and the real repository is untouched. To show
and apply what changed, `snapshot()` records the workspace as a git tree in a
private git directory inside the workspace (`.codefleet/git`, never the
user's own `.git`, which may not exist or may point outside the sandbox) and
`diff()` compares the workspace with it: new, deleted and binary files
included; files the repository's .gitignore (or .git/info/exclude) ignores
and Python's bytecode caches (`__pycache__/`, which running the tests
writes) left out — unless the user's own git tracks them. Directories that are git repositories of their
own (submodules, vendored clones) appear as one entry whose inside is not
compared; `snapshot()` names them so the CLI can warn. The diff is read back
from a file as bytes, so it is never cut and bytes that are not UTF-8 survive
(as surrogates) into `apply_diff()`. Both run as separate processes at the
workspace root, so they neither see nor disturb the agent's shell. Forked
sandboxes inherit the snapshot. The tools hide `.codefleet` from `search`
and `list_dir`.

`apply_diff()` applies a diff to the real repository with `git apply`,
checking first that it applies cleanly (all or nothing).
"""

from __future__ import annotations

import os
import subprocess

from codefleet.agent.tools import PRIVATE_DIR, read_exact
from codefleet.contracts import Sandbox

_DIFF_FILE = f"{PRIVATE_DIR}/git/codefleet.diff"
_GIT = (
    f'export GIT_DIR="$PWD/{PRIVATE_DIR}/git" GIT_WORK_TREE="$PWD" '
    f"GIT_INDEX_FILE=\"$PWD/{PRIVATE_DIR}/git/index\"; git() {{ command git -c safe.directory='*' "
    '-c core.autocrlf=false -c core.quotepath=off "$@"; }'
)


class WorkspaceDiffError(RuntimeError):
    """git could not record or diff the workspace; the message says why."""


def _git(sandbox: Sandbox, script: str, timeout_s: float = 300) -> str:
    result = sandbox.run_oneoff(["bash", "-c", f"{_GIT}\nset -e\n{script}"], timeout_s=timeout_s)
    if not result.ok:
        raise WorkspaceDiffError(
            f"recording the workspace with git failed (exit {result.exit_code}): "
            f"{result.output.strip()[-400:]}; is git installed on this host?"
        )
    return result.output


def snapshot(sandbox: Sandbox) -> list[str]:
    """Record the workspace's current files as the baseline `diff()` compares against. Returns the
    directories that are git repositories of their own (submodules, vendored clones): the diff shows
    none of the changes inside them."""
    _git(
        sandbox,
        f"""
mkdir -p {PRIVATE_DIR}
git init -q --template=
mkdir -p "$GIT_DIR/info"
printf '/{PRIVATE_DIR}/\\n{_BYTECODE}' > "$GIT_DIR/info/exclude"
if [ -f .git/info/exclude ]; then cat .git/info/exclude >> "$GIT_DIR/info/exclude"; fi  # the user's own ignores
{_ADD_ALL}
{_ADD_TRACKED_IGNORED}
git write-tree > "$GIT_DIR/codefleet-base"
{{ git ls-files -s -z | {{ grep -z '^160000 ' || true; }} | cut -z -f2-
  sed -n "s|^error: '\\(.*\\)/' does not have a commit checked out$|\\1|p" "$GIT_DIR/add-errors" | tr '\\n' '\\0'
}} > "$GIT_DIR/nested"
""",
    )
    return sorted(set(filter(None, _git(sandbox, 'cat "$GIT_DIR/nested"').split("\0"))))


# Python's bytecode caches, which running the tests writes, are never part of a change (unless the user's git
# tracks them: `_ADD_TRACKED_IGNORED`).
_BYTECODE_PATTERNS = ("__pycache__/", "*.py[cod]")
_BYTECODE = "".join(f"{pattern}\\n" for pattern in _BYTECODE_PATTERNS)


# `--ignore-errors`: a file git cannot add (unreadable, or a nested repository without a commit) is left
# out instead of failing the whole snapshot or diff; a real failure (no git, a broken index) still fails
# the `git write-tree` that follows.
_ADD_ALL = """LC_ALL=C git add -A --ignore-errors 2>"$GIT_DIR/add-errors" || true"""


# Files the user's repository tracks although its .gitignore matches them (added with `git add -f`): the
# private index must hold them too, or changes to them would be missing from the diff. Once in the
# index, `git add -A` follows them like any tracked file.
_ADD_TRACKED_IGNORED = (
    """
if [ -e .git ]; then
  (unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE
   command git -c safe.directory='*' ls-files -z --cached --ignored --exclude-standard \\
     """
    + " ".join(f"--exclude='{pattern}'" for pattern in _BYTECODE_PATTERNS)
    + """ 2>/dev/null || true) |
    while IFS= read -r -d '' path; do
      if [ -e "$path" ] || [ -L "$path" ]; then printf '%s\\0' "$path"; fi
    done > "$GIT_DIR/tracked-ignored"
  git --literal-pathspecs add -f --pathspec-from-file="$GIT_DIR/tracked-ignored" --pathspec-file-nul
fi"""
)


def diff(sandbox: Sandbox) -> str:
    """The changes since `snapshot()`, as a `git apply`-able unified diff. Bytes that are not UTF-8 come
    back as surrogates (surrogateescape); `apply_diff` writes them back as they were."""
    _git(
        sandbox,
        f"""
{_ADD_ALL}
git diff --binary --no-color --no-ext-diff "$(cat "$GIT_DIR/codefleet-base")" "$(git write-tree)" \\
  > "$GIT_DIR/codefleet.diff"
""",
    )
    try:
        text = read_exact(sandbox, _DIFF_FILE)
    finally:  # not left where search would find it
        sandbox.run_oneoff(["rm", "-f", "--", _DIFF_FILE], timeout_s=30)
    if text is None:
        raise WorkspaceDiffError(
            "the diff has bytes that are not UTF-8, which this sandbox cannot read back "
            "exactly; run with a namespace or local sandbox"
        )
    return text


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
        result = subprocess.run(
            args + (["--check"] if check else []) + ["-"],
            cwd=repo,
            input=patch.encode("utf-8", "surrogateescape"),
            capture_output=True,
        )
        if result.returncode != 0:
            stderr = result.stderr.decode(errors="replace").strip()
            raise RuntimeError(
                f"the diff does not apply to {repo} ({stderr[:400]}); did the files "
                "change while the agent ran? Nothing was changed; the diff is printed above"
            )
