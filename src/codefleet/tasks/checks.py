"""Running a task: prepare its sandbox, take the agent's diff, run the hidden checks.

    sb = prepare_sandbox(task, config)        # repo + setup commands + git baseline
    ...the agent works in sb...
    diff = workspace_diff(sb)                 # everything it changed, as a unified diff
    result = run_checks(sb, task)             # CheckResult: per-test pass/fail

Design:

- **Baseline.** After the setup commands, the workspace's state is recorded
  as the commit `refs/codefleet/baseline` (fixed author and date). A
  workspace that is not a git repository becomes one (`__pycache__` and
  `*.pyc` excluded via .git/info/exclude); in one that is, the baseline is
  a commit of the current tree, uncommitted changes included, made with a
  temporary index so HEAD and the index are left alone. `workspace_diff`
  stages everything into a temporary index and diffs it against the
  baseline, so whatever the agent did with git (commits, stash, index) the
  diff is still "baseline -> files now". Files the repository's .gitignore
  ignores are not part of the diff.
- **Hidden.** Nothing of `reference_patch` or `checks.files` enters the
  sandbox before `run_checks`; `checks.files` are written just before the
  checks run, over whatever the agent left at those paths.
- **Not foolable by printing.** The checks run as a one-off process (a fresh
  namespace: clean environment, its own /tmp, not the agent's shell).
  pytest writes junit xml into a random directory of that private /tmp; a
  summarizer run with `python3 -I` turns it into one letter per test id and
  prints it after a random nonce. Output the tests print is only shown, never
  parsed for results. (Code under test runs in the same process as pytest and
  could still subvert it; no in-process check can prevent that.)
- **Missing ids fail, they do not abort.** pytest refuses to run anything
  when one id does not exist; ids whose file is missing are filtered out
  before, and ids pytest reports as not found are dropped and the rest rerun.
  Either way a missing id counts as failed.
- Scripts run with the workspace as their working directory, so the
  `local` backend (no isolation; a shared /tmp) works too.
- One-offs see the workspace but not the shell's environment or /tmp: setup
  commands must leave what the checks need in the workspace, and a check
  command that needs a variable sets it itself (`PYTHONPATH=src python3 ...`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import secrets
import shlex
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field

from codefleet.sandbox import Sandbox, SandboxClosedError, SandboxConfig, create_sandbox
from codefleet.tasks.spec import validate_task
from codefleet.tasks.unpack import UnpackError, unpack_source
from codefleet.types import CheckResult, Task

BASELINE_REF = "refs/codefleet/baseline"
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "codefleet",
    "GIT_AUTHOR_EMAIL": "codefleet@localhost",
    "GIT_COMMITTER_NAME": "codefleet",
    "GIT_COMMITTER_EMAIL": "codefleet@localhost",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
}
OUTPUT_KEEP_BYTES = 6000  # of pytest's own output, head and tail each, shown in CheckResult.output
PASSING = ("P", "X")
ABORTING = ("N", "E")  # outcomes that make pytest run nothing at all
_MAX_RERUNS = 4


class TaskSetupError(RuntimeError):
    """The task's repository could not be prepared (missing repo, a failing setup command). `timed_out`: a
    setup command ran out of time (on a loaded machine that may not be the task's fault)."""

    def __init__(self, message: str, timed_out: bool = False):
        super().__init__(message)
        self.timed_out = timed_out


class PatchApplyError(RuntimeError):
    """`git apply` refused a patch; the message has git's reason."""


# -- repository and baseline ----------------------------------------------------------


def default_cache_dir() -> str:
    root = os.environ.get("CODEFLEET_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "codefleet"
    )
    return os.path.join(root, "task-repos")


def materialize_repo(repo: str, cache_dir: str | None = None) -> str:
    """A directory with the task's repository: `repo` itself, or a tarball
    extracted once into the cache (keyed by path, size and mtime)."""
    if os.path.isdir(repo):
        return repo
    if not os.path.isfile(repo):
        raise TaskSetupError(f"task repo {repo!r} does not exist (a directory, .tar or .tar.gz)")
    st = os.stat(repo)
    key = hashlib.sha256(f"{os.path.abspath(repo)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:20]
    cache_dir = cache_dir or default_cache_dir()
    target = os.path.join(cache_dir, key)
    if os.path.isdir(target):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".extract-", dir=cache_dir)
    try:
        # a task directory is anyone's (docs/security.md): capped, nothing outside the tree, no special files
        unpack_source(repo, os.path.join(tmp, "repo"))
        os.rename(os.path.join(tmp, "repo"), target)
    except OSError:
        if not os.path.isdir(target):  # lost a race with another extractor: theirs is as good
            raise
    except UnpackError as e:
        raise TaskSetupError(f"task repo {repo!r}: {e}") from None
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _git_env() -> str:
    return "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in GIT_IDENTITY.items())


_BASELINE_SCRIPT = f"""set -e
{_git_env()}
if [ -e .git ]; then
  git rev-parse --git-dir >/dev/null 2>&1 || {{ echo "the workspace has a .git that git cannot read" >&2; exit 3; }}
  idx=$(mktemp /tmp/cf-index.XXXXXX); rm -f "$idx"; trap 'rm -f "$idx"' EXIT
  # -p: keep the index's mtime, which racy-git detection compares against
  if [ -f .git/index ]; then cp -p .git/index "$idx"; fi
  export GIT_INDEX_FILE="$idx"
  git add -A
  tree=$(git write-tree)
  if parent=$(git rev-parse -q --verify HEAD); then
    commit=$(git commit-tree "$tree" -p "$parent" -m "codefleet baseline")
  else
    commit=$(git commit-tree "$tree" -m "codefleet baseline")
  fi
else
  git -c init.defaultBranch=main init -q
  mkdir -p .git/info  # git without its templates (a minimal image) makes none
  printf '__pycache__/\\n*.py[cod]\\n.pytest_cache/\\n' >> .git/info/exclude
  git add -A
  git commit -q --allow-empty --no-verify -m "codefleet baseline"
  commit=$(git rev-parse HEAD)
fi
git update-ref {BASELINE_REF} "$commit"
"""


def prepare_sandbox(
    task: Task,
    config: SandboxConfig | None = None,
    cache_dir: str | None = None,
    setup_timeout_s: float = 600.0,
    create=None,
) -> Sandbox:
    """A sandbox over the task's repository with its setup commands run and a
    git baseline recorded. The reference patch and check files stay outside.
    `create(repo_dir, config)` makes the sandbox (default: `create_sandbox`
    here; `SandboxFleet.create` to place it on the fleet)."""
    if task.environment:  # resolved where the sandbox is made: an archive is imported once per node
        config = dataclasses.replace(config or SandboxConfig(), environment=task.environment)
    sandbox = (create or create_sandbox)(materialize_repo(task.repo, cache_dir), config)
    try:
        for command in task.setup_commands:
            result = sandbox.exec(command, timeout_s=setup_timeout_s)
            if not result.ok:
                raise TaskSetupError(
                    f"task {task.id}: setup command {command!r} failed (exit {result.exit_code}"
                    f"{', timed out' if result.timed_out else ''}): {result.output[-2000:]}",
                    timed_out=result.timed_out,
                )
        result = sandbox.run_oneoff(["bash", "-c", _BASELINE_SCRIPT], timeout_s=setup_timeout_s)
        if not result.ok:
            raise TaskSetupError(f"task {task.id}: could not record the git baseline: {result.output[-2000:]}")
    except BaseException:
        sandbox.close()
        raise
    return sandbox


# -- diff and patch -------------------------------------------------------------------


def workspace_diff(sandbox: Sandbox, timeout_s: float = 120.0) -> str:
    """Everything changed in the workspace since the baseline, as a unified
    diff (`git diff --binary`; new, deleted and renamed files included)."""
    name = f".git/codefleet-diff-{secrets.token_hex(8)}"
    script = f"""set -e
git rev-parse -q --verify {BASELINE_REF} >/dev/null || {{
  echo "no codefleet baseline in this workspace: create the sandbox with codefleet.tasks.prepare_sandbox" >&2
  exit 3; }}
idx=$(mktemp /tmp/cf-index.XXXXXX); rm -f "$idx"; trap 'rm -f "$idx"' EXIT
if [ -f .git/index ]; then cp -p .git/index "$idx"; fi  # -p: keep its mtime, which racy-git detection compares against
export GIT_INDEX_FILE="$idx"
git add -A
git diff --cached --binary --no-color --no-ext-diff {BASELINE_REF} > {name}
"""
    result = sandbox.run_oneoff(["bash", "-c", script], timeout_s=timeout_s)
    try:
        if not result.ok:
            raise RuntimeError(f"workspace_diff failed (exit {result.exit_code}): {result.output[-2000:]}")
        return sandbox.read_file(name)
    finally:
        sandbox.run_oneoff(["rm", "-f", "--", name], timeout_s=30)


def apply_patch(sandbox: Sandbox, patch_text: str, timeout_s: float = 120.0) -> None:
    """Apply a unified diff to the workspace with `git apply`, from a temp file
    in the sandbox's /tmp. For the checker and tests only: agent episodes never
    see a reference patch."""
    if not patch_text.strip():
        raise PatchApplyError("the patch is empty")
    nonce = secrets.token_hex(8)
    text = patch_text if patch_text.endswith("\n") else patch_text + "\n"
    path = f"/tmp/cf-patch-{nonce}.diff"
    command = (
        f"( cd {shlex.quote(sandbox.info.workspace)} && unset GIT_DIR GIT_WORK_TREE GIT_INDEX_FILE && "
        f"command cat > {path} <<'CF_EOF_{nonce}'\n"
        f"{text}CF_EOF_{nonce}\n"
        f"command git apply --whitespace=nowarn {path}; rc=$?; command rm -f {path}; exit $rc )"
    )
    result = sandbox.exec(command, timeout_s=timeout_s)
    if not result.ok:
        raise PatchApplyError(f"git apply failed (exit {result.exit_code}): {result.output.strip()[-2000:]}")


# -- hidden checks --------------------------------------------------------------------


def _summary_source() -> str:
    with open(os.path.join(os.path.dirname(__file__), "junit_summary.py"), encoding="utf-8") as f:
        return f.read()


def _check_script(command: str, workdir: str, nonce: str) -> str:
    junit = f"{workdir}/junit.xml"
    cmd = command.replace("{tests}", '"${run[@]}"')
    cmd = cmd.replace("{junit}", junit) if "{junit}" in cmd else f"{cmd} --junitxml={junit}"
    keep = OUTPUT_KEEP_BYTES
    return f"""mkdir -m 700 {workdir} || exit 90
trap 'rm -rf {workdir}' EXIT
export PYTHONDONTWRITEBYTECODE=1
run=(); : > {workdir}/missing
for t in "$@"; do
  if [ -e "${{t%%::*}}" ]; then run+=("$t"); else printf '%s\\n' "$t" >> {workdir}/missing; fi
done
rc=5
if [ ${{#run[@]}} -gt 0 ]; then
  ( {cmd} ) > {workdir}/out 2>&1 < /dev/null
  rc=$?
fi
touch {workdir}/out
size=$(wc -c < {workdir}/out)
if [ "$size" -gt {2 * keep} ]; then
  head -c {keep} {workdir}/out; printf '\\n[... %s bytes of pytest output cut ...]\\n' $((size - {2 * keep}))
  tail -c {keep} {workdir}/out
else
  cat {workdir}/out
fi
python3 -I -c {shlex.quote(_summary_source())} {workdir} "$rc" {nonce} "$@"
"""


def _run_once(sandbox: Sandbox, command: str, ids: list[str], timeout_s: float) -> tuple[dict[str, str], str]:
    """One pytest run over `ids`: ({id: letter}, output shown to humans)."""
    nonce = secrets.token_hex(16)
    workdir = f"/tmp/cf-check-{secrets.token_hex(16)}"
    result = sandbox.run_oneoff(
        ["bash", "-c", _check_script(command, workdir, nonce), "codefleet-check", *ids], timeout_s=timeout_s
    )
    pattern = re.compile(rf"^{nonce} (-?\d+) (\d+) ([PXFSENM]*)$", re.M)
    matches = list(pattern.finditer(result.output))
    if (
        result.timed_out
        or not matches
        or int(matches[-1].group(2)) != len(ids)
        or len(matches[-1].group(3)) != len(ids)
    ):
        why = "timed out" if result.timed_out else "ended without a result"
        return {i: "M" for i in ids}, result.output + f"\n[codefleet: the checks {why}; every test counts as failed]"
    last = matches[-1]
    return dict(zip(ids, last.group(3))), result.output[: last.start()].rstrip("\n") + "\n"


def run_checks(sandbox: Sandbox, task: Task, timeout_s: float = 300.0) -> CheckResult:
    """Write the hidden test files, run fail_to_pass + pass_to_pass in one
    pytest run and say per test whether it passed. all_passed only when every
    id passed; an id that does not exist counts as failed."""
    ids = list(dict.fromkeys(task.checks.fail_to_pass + task.checks.pass_to_pass))
    for path, content in sorted(task.checks.files.items()):
        sandbox.write_file(path, content)
    if not ids:
        return CheckResult(0, 0, False, {}, "[codefleet: the task has no check ids]")
    letters: dict[str, str] = {}
    output, pending = "", ids
    for attempt in range(1 + _MAX_RERUNS):
        got, more = _run_once(sandbox, task.checks.command, pending, timeout_s)
        letters.update(got)
        output += more
        choked = [i for i in pending if got[i] in ABORTING]  # then pytest ran nothing at all
        pending = [i for i in pending if got[i] == "M"]
        if not choked or not pending or attempt == _MAX_RERUNS:
            break
        output += (
            f"\n[codefleet: pytest ran nothing because {len(choked)} test id(s) do not exist or their file "
            f"fails to import ({', '.join(choked[:5])}); they count as failed and the others run again]\n"
        )
    per_test = {i: letters[i] in PASSING for i in ids}
    passed = sum(per_test.values())
    return CheckResult(passed=passed, total=len(ids), all_passed=passed == len(ids), per_test=per_test, output=output)


# -- soundness ------------------------------------------------------------------------


@dataclass
class TaskCheckReport:
    """Whether a task is sound: the reference patch passes every hidden check,
    the untouched repository fails every fail_to_pass (and passes every
    pass_to_pass), and `runs` runs of each give the same per-test outcome."""

    task_id: str
    sound: bool
    problems: list[str] = field(default_factory=list)
    reference: list[CheckResult] = field(default_factory=list)  # one per run
    untouched: list[CheckResult] = field(default_factory=list)
    duration_s: float = 0.0

    def line(self) -> str:
        """One line for a terminal: `ok` or `UNSOUND` with the reasons."""
        if self.sound:
            ref, base = self.reference[0], self.untouched[0]
            return (
                f"ok       {self.task_id}  reference {ref.passed}/{ref.total} pass, untouched "
                f"{base.total - base.passed}/{base.total} fail  ({self.duration_s:.1f} s)"
            )
        return f"UNSOUND  {self.task_id}  " + "; ".join(self.problems)


def _ids(ids: list[str], limit: int = 5) -> str:
    return ", ".join(ids[:limit]) + (f" (+{len(ids) - limit} more)" if len(ids) > limit else "")


def _judge(task: Task, reference: list[CheckResult], untouched: list[CheckResult]) -> list[str]:
    problems = []
    if reference:
        failing = [i for i, ok in reference[0].per_test.items() if not ok]
        if failing:
            problems.append(f"with the reference patch these checks fail: {_ids(failing)}")
    if untouched:
        per_test = untouched[0].per_test
        already = [i for i in task.checks.fail_to_pass if per_test.get(i)]
        if already:
            problems.append(f"fail_to_pass tests already pass on the untouched repo: {_ids(already)}")
        broken = [i for i in task.checks.pass_to_pass if not per_test.get(i)]
        if broken:
            problems.append(f"pass_to_pass tests fail on the untouched repo: {_ids(broken)}")
    for name, runs in (("reference", reference), ("untouched", untouched)):
        flaky = sorted({i for r in runs[1:] for i in r.per_test if r.per_test[i] != runs[0].per_test.get(i)})
        if flaky:
            problems.append(f"nondeterministic on the {name} repo: {_ids(flaky)}")
    return problems


def _check_runs(runs: int) -> None:
    if isinstance(runs, bool) or not isinstance(runs, int) or runs < 1:
        raise ValueError(
            f"runs must be a whole number of at least 1 (each state's checks run that often), got {runs!r}"
        )


class InFlight:
    """The sandboxes that checks running in worker threads hold, so that the main thread, interrupted (Ctrl-C,
    SIGTERM), closes them all at once and its threads return, instead of waiting for every check to end.
    A sandbox added after that is closed at once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._open: list[Sandbox] = []
        self._closed = False

    def add(self, sandbox: Sandbox) -> None:
        with self._lock:
            if not self._closed:
                self._open.append(sandbox)
                return
        sandbox.close()
        raise SandboxClosedError("the checks were interrupted")

    def close_all(self) -> None:
        with self._lock:
            self._closed, opened = True, list(self._open)
        for sandbox in opened:
            sandbox.close()


def check_task(
    task: Task,
    config: SandboxConfig | None = None,
    cache_dir: str | None = None,
    runs: int = 2,
    in_flight: InFlight | None = None,
) -> TaskCheckReport:
    """Prove `task` sound (see TaskCheckReport). One prepared sandbox is forked
    into the untouched and the patched state; both run their checks `runs`
    times, side by side."""

    _check_runs(runs)
    started = time.perf_counter()
    problems = validate_task(task)
    if not task.reference_patch.strip():
        problems.append("reference_patch is empty")
    if problems:
        return TaskCheckReport(task.id, False, problems, duration_s=time.perf_counter() - started)
    reference: list[CheckResult] = []
    untouched: list[CheckResult] = []
    sandboxes: list[Sandbox] = []
    try:
        base = prepare_sandbox(task, config, cache_dir)
        sandboxes.append(base)
        plain, patched = base.fork(2)
        sandboxes += [plain, patched]
        for sandbox in sandboxes if in_flight else ():
            in_flight.add(sandbox)
        try:
            apply_patch(patched, task.reference_patch)
        except PatchApplyError as e:
            problems.append(f"the reference patch does not apply: {e}")
            patched = None
        with ThreadPoolExecutor(max_workers=2) as pool:
            plain_runs = pool.submit(lambda: [run_checks(plain, task) for _ in range(runs)])
            if patched is not None:
                reference = [run_checks(patched, task) for _ in range(runs)]
            untouched = plain_runs.result()
    except Exception as e:  # one broken task must not end a whole `tasks check` run
        problems.append(f"could not run the checks: {type(e).__name__}: {e}")
    finally:
        for sandbox in reversed(sandboxes):
            sandbox.close()
    problems += _judge(task, reference, untouched)
    return TaskCheckReport(task.id, not problems, problems, reference, untouched, time.perf_counter() - started)


def check_tasks(
    tasks: list[Task],
    config: SandboxConfig | None = None,
    jobs: int = 2,
    cache_dir: str | None = None,
    on_report=None,
    runs: int = 2,
) -> list[TaskCheckReport]:
    """check_task for many tasks, `jobs` at a time; reports in task order.
    `on_report(report)` is called as each one finishes (for progress lines)."""
    _check_runs(runs)
    reports: dict[str, TaskCheckReport] = {}
    in_flight = InFlight()
    pool = ThreadPoolExecutor(max_workers=max(1, jobs))
    try:
        futures = {pool.submit(check_task, task, config, cache_dir, runs, in_flight): task for task in tasks}
        for future in as_completed(futures):
            report = future.result()
            reports[futures[future].id] = report
            if on_report:
                on_report(report)
    except BaseException:
        in_flight.close_all()  # Ctrl-C, SIGTERM: the checks in flight end now, not when their tests do
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return [reports[task.id] for task in tasks]
