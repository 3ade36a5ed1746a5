"""Bug-fix tasks mined from a real library: mutate the functions its tests cover.

    report = mine_library("attrs-23.1.0.tar.gz", out_dir="tasks/mined", seed=0)   # or an unpacked tree
    tasks = report.tasks                                                         # saved, checked, sound

For one source distribution (a `.tar.gz`/`.tar`/`.zip` sdist or a directory), mining

1. unpacks it (unpack.py: capped in size and entries, nothing written outside the tree or through a
   symlink, no symlink out of it kept) and runs its own test suite once in a sandbox (pytest from the
   sandbox's `python3`; `PYTHONPATH=src` for a src layout): the tests that
   pass are the PASS set. A suite that does not collect, or where nothing
   passes, is one `MineError`.
2. makes mutants of every function of the library's modules (tests, setup.py
   and docs are left alone), each ONE small source edit at the exact span of
   an `ast` node, so the rest of the file stays byte-identical: swapped
   comparison (`<`/`<=`, `>`/`>=`, `==`/`!=`), swapped arithmetic (`+`/`-`,
   `*`/`//`), off-by-one (an integer constant, a `range` bound), a negated
   `if`/`while`/`x if c else y` condition, a dropped statement, a changed
   default argument, two swapped positional arguments.
3. runs the PASS set on each mutant (the same check command the task will
   use). A mutant that some of them fail becomes a task: those are its
   FAIL_TO_PASS, the rest of the PASS set is PASS_TO_PASS. Mutants nobody
   notices are discarded.
4. writes each task with the mutated tree as its repository, the diff back
   to the original as `reference_patch`, every test file as `checks.files`,
   and an issue text made of what fails and pytest's own assertion lines,
   never the mutation; then proves every task sound with `check_tasks` and
   drops (and reports) any that is not.

Order and choice are deterministic by seed: the functions are visited in a
seeded order, and for each one its candidate mutations are shuffled by
`Random("codefleet-mine/<seed>/<module>/<qualname>")` and interleaved by
kind; rounds take one candidate per function, so `--max-tasks` spreads over
functions and kinds instead of exhausting the first file.

`PACKAGE==VERSION [--hash=sha256:HEX]` is fetched from pip's index as data (fetch.py: the simple API,
the sdist's sha256 checked, never `pip download`, which would run the package's build backend here) into a
cache; the only step that needs the network.

Nothing of the library runs on the host: its tests, its conftest.py and its setup.py run only in
sandboxes (never the `local` backend, which does not isolate: mining refuses it, also where `auto` would
fall back to it); here its files are only read (PKG-INFO, pyproject.toml, and the modules that `ast`
parses), never through a symlink.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
import tomllib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from codefleet.contracts import SANDBOXES
from codefleet.sandbox import Sandbox, SandboxConfig, create_sandbox, resolve_backend
from codefleet.tasks.checks import check_tasks, run_checks
from codefleet.tasks.fetch import FetchError, fetch_sdist, parse_requirement
from codefleet.tasks.mutations import KINDS, Mutation, file_mutations
from codefleet.tasks.patch import make_unified_diff
from codefleet.tasks.spec import save_tasks
from codefleet.tasks.unpack import ARCHIVE_SUFFIXES, UnpackError, UnpackLimits, unpack_source
from codefleet.types import HiddenChecks, Task

PYTEST = "python3 -m pytest -q -p no:cacheprovider"
_SKIP_DIRS = {"tests", "test", "testing", "docs", "doc", "examples", "benchmarks", "build", "dist", "__pycache__"}


class MineError(RuntimeError):
    """A source that cannot be mined: not a source tree, a suite that does not run, a failed download."""


# -- the source tree ------------------------------------------------------------------


def _unpack(source: str, work_dir: str, limits: UnpackLimits | None) -> str:
    if not os.path.isdir(source) and (not os.path.isfile(source) or not source.endswith(ARCHIVE_SUFFIXES)):
        raise MineError(
            f"{source!r} is not a source distribution: pass a .tar.gz (or .zip) sdist, an unpacked "
            "source directory or NAME==VERSION"
        )
    root = os.path.join(work_dir, "src")
    try:
        unpack_source(source, root, limits)
    except UnpackError as e:
        raise MineError(str(e)) from None
    entries = [e for e in os.listdir(root) if not e.startswith(".")]
    if (
        len(entries) == 1
        and os.path.isdir(os.path.join(root, entries[0]))
        and not os.path.islink(os.path.join(root, entries[0]))
    ):  # sdists hold NAME-VERSION/
        root = os.path.join(root, entries[0])
    return root


def _open(root: str, rel: str, mode: str = "r", **kwargs):
    """A file of the unpacked tree, never opened through a symlink (_source_files lists no symlinks)."""
    return os.fdopen(os.open(os.path.join(root, rel), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), mode, **kwargs)


def _name_version(root: str, source: str) -> tuple[str, str]:
    fields: dict[str, str] = {}
    if _is_file(root, "PKG-INFO"):
        with _open(root, "PKG-INFO", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key in ("Name", "Version") and key.lower() not in fields:
                    fields[key.lower()] = value.strip()
    if len(fields) < 2 and _is_file(root, "pyproject.toml"):
        try:
            with _open(root, "pyproject.toml", "rb") as f:
                project = tomllib.load(f).get("project", {})
            fields.setdefault("name", str(project.get("name", "")))
            fields.setdefault("version", str(project.get("version", "")))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, AttributeError, RecursionError):
            pass
    base = os.path.basename(os.path.normpath(source))
    base = next((base[: -len(s)] for s in ARCHIVE_SUFFIXES if base.endswith(s)), base)
    guess = re.match(r"^(.+?)-(\d[\w.]*)$", base)
    name = fields.get("name") or (guess.group(1) if guess else base)
    version = fields.get("version") or (guess.group(2) if guess else "0")
    return name, version


def _is_file(root: str, rel: str) -> bool:
    path = os.path.join(root, rel)
    return os.path.isfile(path) and not os.path.islink(path)


def _is_test_file(rel: str) -> bool:
    parts = rel.split("/")
    name = parts[-1]
    return (
        any(p in ("tests", "test", "testing") for p in parts[:-1])
        or name == "conftest.py"
        or name.startswith("test_")
        or name.endswith("_test.py")
    )


def _source_files(root: str) -> tuple[list[str], list[str]]:
    """(library modules to mutate, test files), relative paths, sorted."""
    modules, tests = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
        for name in filenames:
            rel = os.path.relpath(os.path.join(dirpath, name), root).replace(os.sep, "/")
            if not name.endswith(".py") or os.path.islink(os.path.join(dirpath, name)):
                continue  # a symlink is left alone: never read, never mutated
            if _is_test_file(rel):
                tests.append(rel)
            elif name not in ("setup.py", "conftest.py", "noxfile.py") and not set(rel.split("/")[:-1]) & _SKIP_DIRS:
                modules.append(rel)
    return sorted(modules), sorted(tests)


def _module_name(rel: str, src_layout: bool) -> str:
    rel = rel[len("src/") :] if src_layout and rel.startswith("src/") else rel
    parts = rel[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


# -- running the suite ----------------------------------------------------------------


def _probe(command: str, ids: list[str]) -> Task:
    """A throwaway task whose checks are `ids` (run_checks runs fail_to_pass + pass_to_pass)."""
    return Task(id="mine-probe", repo="", instruction="", checks=HiddenChecks(command, ids, [], {}))


def _passing_tests(sandbox: Sandbox, command: str, source: str) -> list[str]:
    collect = command.replace("{tests}", "").strip() + " --collect-only"
    result = sandbox.run_oneoff(["bash", "-c", f"export PYTHONDONTWRITEBYTECODE=1; {collect}"], timeout_s=600)
    ids = [line.strip() for line in result.output.splitlines() if "::" in line and not line.startswith(" ")]
    if result.exit_code != 0 or not ids:
        raise MineError(
            f"the test suite of {source} does not collect in the sandbox (exit {result.exit_code}): "
            f"{result.output.strip()[-600:]}"
        )
    outcome = run_checks(sandbox, _probe(command, ids), timeout_s=600)
    passing = [i for i in ids if outcome.per_test[i]]
    if not passing:
        raise MineError(
            f"the test suite of {source} fails on the original source ({len(ids)} tests, none passes), "
            f"so no mutant can be told apart: {outcome.output.strip()[-600:]}"
        )
    return passing


_ADDRESS = re.compile(r"0x[0-9a-f]{6,}")  # object addresses change from run to run: same seed, same text


def _issue_text(name: str, failing: list[str], output: str, test_command: str) -> str:
    lines = _ADDRESS.sub("0x...", output).splitlines()
    errors = [line.rstrip() for line in lines if line.startswith("E ")][:12]
    summary = [line for line in lines if line.startswith(("FAILED ", "ERROR "))][:5]
    shown = "\n".join(failing[:5]) + (f"\n(and {len(failing) - 5} more)" if len(failing) > 5 else "")
    return (
        f"Some of {name}'s own tests fail and I don't think they should: the tests look right, so something "
        f"in the library code is broken.\n\nFailing tests:\n{shown}\n\nWhat pytest says (`{test_command}`):\n"
        "```\n" + "\n".join(errors + ([""] if errors and summary else []) + summary) + "\n```\n\n"
        "Please fix the library so that these tests pass again, without breaking the others and without "
        "changing the tests."
    )


# -- mining ---------------------------------------------------------------------------


@dataclass
class MineReport:
    """What mining one source did: its tasks (sound ones only) and the counts of the stderr table."""

    library: str
    version: str
    functions: int = 0
    tried: Counter = field(default_factory=Counter)  # by kind
    kept: Counter = field(default_factory=Counter)  # by kind, after check_tasks
    unsound: list[str] = field(default_factory=list)  # "id: reasons"
    tasks: list[Task] = field(default_factory=list)

    def table(self) -> str:
        rows = [
            f"{self.library} {self.version}: {self.functions} functions, {sum(self.tried.values())} mutants "
            f"tried, {sum(self.kept.values())} kept"
            + (f", {len(self.unsound)} dropped as unsound" if self.unsound else ""),
            f"  {'kind':<20}{'tried':>7}{'kept':>7}",
        ]
        rows += [f"  {kind:<20}{self.tried[kind]:>7}{self.kept[kind]:>7}" for kind in KINDS if self.tried[kind]]
        rows += [f"  unsound {line}" for line in self.unsound]
        return "\n".join(rows)


def _schedule(per_function: dict[str, list[Mutation]], seed: int) -> list[list[Mutation]]:
    """Per function (in a seeded order), its candidates shuffled and interleaved by kind."""
    order = []
    for name in sorted(per_function):
        rng = random.Random(f"codefleet-mine/{seed}/{name}")
        by_kind: dict[str, list[Mutation]] = {}
        for mutation in per_function[name]:
            by_kind.setdefault(mutation.kind, []).append(mutation)
        kinds = sorted(by_kind)
        rng.shuffle(kinds)
        for kind in kinds:
            rng.shuffle(by_kind[kind])
        queue = [
            by_kind[k][i]
            for i in range(max(map(len, by_kind.values()), default=0))
            for k in kinds
            if i < len(by_kind[k])
        ]
        if queue:
            order.append(queue)
    random.Random(f"codefleet-mine/{seed}").shuffle(order)
    return order


def mine_library(
    source: str,
    out_dir: str,
    seed: int = 0,
    max_per_function: int = 2,
    max_tasks: int | None = None,
    kinds: list[str] | None = None,
    config: SandboxConfig | None = None,
    jobs: int = 2,
    check: bool = True,
    cache_dir: str | None = None,
    limits: UnpackLimits | None = None,
    index_urls: list[str] | None = None,
) -> MineReport:
    """Mine one source (a directory, a .tar.gz/.zip sdist, or NAME==VERSION [--hash=sha256:HEX] fetched from
    `index_urls` (default: pip's) into `cache_dir`) into tasks under `out_dir` (saved with their index), its
    tree within `limits` (also the most a download may weigh); see the module docstring."""
    kinds = _checked_arguments(kinds, max_per_function, max_tasks, config)
    source = _local_source(source, cache_dir, index_urls, limits)
    with tempfile.TemporaryDirectory(prefix="codefleet-mine-") as work_dir:
        os.chmod(work_dir, 0o755)  # the sandbox user reads the tree through it
        root = _unpack(source, work_dir, limits)
        name, version = _name_version(root, source)
        report = MineReport(name, version)
        modules, test_files = _source_files(root)
        if not modules or not test_files:
            raise MineError(
                f"{source!r} is not a Python source tree with tests: found {len(modules)} library "
                f"module(s) and {len(test_files)} test file(s) (tests/, test_*.py)"
            )
        src_layout = os.path.isdir(os.path.join(root, "src"))
        command = ("PYTHONPATH=src " if src_layout else "") + PYTEST + " {tests}"
        sources, per_function = _candidate_mutations(root, modules, src_layout, kinds)
        report.functions = len(per_function)
        base = create_sandbox(root, config)
        try:
            passing = _passing_tests(base, command, source)
            workers = base.fork(max(1, jobs))
            try:
                candidates = _mutants_that_fail(
                    workers, per_function, seed, max_per_function, max_tasks, sources, command, passing, report
                )
            finally:
                for sandbox in workers:
                    sandbox.close()
        finally:
            base.close()
        tests = {}
        for rel in test_files:
            with _open(root, rel, encoding="utf-8", errors="replace") as f:
                tests[rel] = f.read()
        tasks = [
            _write_task(root, out_dir, index, candidate, sources, tests, name, version, seed, command, passing)
            for index, candidate in enumerate(candidates)
        ]
    if check and tasks:
        tasks = _sound_tasks(tasks, out_dir, config, jobs, report)
    save_tasks(tasks, out_dir)
    report.tasks = tasks
    report.kept = Counter(str(t.metadata["mutation"]) for t in tasks)
    return report


def _checked_arguments(
    kinds: list[str] | None, max_per_function: int, max_tasks: int | None, config: SandboxConfig | None
) -> list[str]:
    """The mutation kinds to try, once the caps and the sandbox backend have been checked."""
    kinds = list(kinds or KINDS)
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        raise MineError(f"unknown mutation kind(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    if max_per_function < 1 or (max_tasks is not None and max_tasks < 1):
        raise MineError(
            f"--max-per-function and --max-tasks must be at least 1, got {max_per_function} and {max_tasks}"
        )
    backend = (config or SandboxConfig()).backend
    if not SANDBOXES.get(resolved := resolve_backend(backend)).isolated:
        raise MineError(
            f"mining runs the library's own tests, code nobody has checked, so it needs a sandbox that "
            f"isolates; backend {backend!r} is {resolved!r} here, which does not: install "
            "bubblewrap and enable user namespaces (docs/sandboxes/namespace.md), or --set backend=vm"
        )
    return kinds


def _local_source(source: str, cache_dir: str | None, index_urls: list[str] | None, limits: UnpackLimits | None) -> str:
    """`source` itself if it is a path; for NAME==VERSION, its sdist fetched into the cache."""
    try:
        requirement = None if os.path.exists(source) else parse_requirement(source)
        if requirement is not None:
            source = fetch_sdist(
                requirement,
                cache_dir or os.path.expanduser("~/.cache/codefleet/sdists"),
                index_urls,
                (limits or UnpackLimits()).max_bytes,
            )
    except FetchError as e:
        raise MineError(str(e)) from None
    return source


def _candidate_mutations(
    root: str, modules: list[str], src_layout: bool, kinds: list[str]
) -> tuple[dict[str, bytes], dict[str, list[Mutation]]]:
    """Each library module's bytes, and each function's mutations of `kinds` (files Python cannot parse skipped)."""
    sources = {}
    per_function: dict[str, list[Mutation]] = {}
    for rel in modules:
        with _open(root, rel, "rb") as f:
            sources[rel] = f.read()
        try:
            found = file_mutations(sources[rel], rel, _module_name(rel, src_layout))
        except (SyntaxError, ValueError, UnicodeDecodeError, RecursionError, MemoryError):
            continue  # a file this Python cannot parse (or nested too deep to) is left alone
        per_function.update({k: [m for m in v if m.kind in kinds] for k, v in found.items()})
    return sources, per_function


def _write_task(
    root: str,
    out_dir: str,
    index: int,
    candidate: tuple[Mutation, list[str], str],
    sources: dict[str, bytes],
    tests: dict[str, str],
    name: str,
    version: str,
    seed: int,
    command: str,
    passing: list[str],
) -> Task:
    """Task `index`: the library with the mutant in place under out_dir, the tests that noticed it as checks."""
    mutation, failing, output = candidate
    slug = re.sub(r"[^A-Za-z0-9._-]", "-", f"{name}-{version}")
    task_id = f"mined-{slug}-s{seed}-{index:04d}"
    repo = os.path.join(out_dir, task_id, "repo")
    if os.path.exists(repo):
        shutil.rmtree(repo)
    shutil.copytree(root, repo, symlinks=True)
    with open(os.path.join(repo, mutation.path), "w", encoding="utf-8", newline="") as f:
        f.write(mutation.apply(sources[mutation.path]))
    original = sources[mutation.path].decode("utf-8")
    return Task(
        id=task_id,
        repo=os.path.abspath(repo),
        instruction=_issue_text(name, failing, output, command.replace(" {tests}", "")),
        checks=HiddenChecks(command, failing, [t for t in passing if t not in failing], dict(tests)),
        test_command=command.replace(" {tests}", ""),
        metadata={
            "family": "mined",
            "template": name,
            "library": name,
            "version": version,
            "mutation": mutation.kind,
            "function": mutation.function,
            "seed": seed,
            "index": index,
        },
        reference_patch=make_unified_diff(
            {mutation.path: mutation.apply(sources[mutation.path])}, {mutation.path: original}
        ),
    )


def _sound_tasks(
    tasks: list[Task], out_dir: str, config: SandboxConfig | None, jobs: int, report: MineReport
) -> list[Task]:
    """The tasks check_tasks finds sound; the others are recorded in the report and their directories removed."""
    sound = []
    for task, result in zip(tasks, check_tasks(tasks, config, jobs=jobs), strict=True):
        if result.sound:
            sound.append(task)
        else:
            report.unsound.append(f"{task.id}: {'; '.join(result.problems)}")
            shutil.rmtree(os.path.join(out_dir, task.id), ignore_errors=True)
    return sound


def _mutants_that_fail(
    workers: list[Sandbox],
    per_function: dict[str, list[Mutation]],
    seed: int,
    max_per_function: int,
    max_tasks: int | None,
    sources: dict[str, bytes],
    command: str,
    passing: list[str],
    report: MineReport,
) -> list[tuple[Mutation, list[str], str]]:
    """Run the PASS set on mutants (one per worker at a time) in schedule order, round by round, until the caps;
    the ones some test notices, with those tests and pytest's output."""

    def run(sandbox: Sandbox, mutation: Mutation) -> tuple[list[str], str]:
        sandbox.write_file(mutation.path, mutation.apply(sources[mutation.path]))
        try:
            result = run_checks(sandbox, _probe(command, passing), timeout_s=600)
        finally:
            sandbox.write_file(mutation.path, sources[mutation.path].decode("utf-8"))
        return [t for t in passing if not result.per_test[t]], result.output

    queues = _schedule(per_function, seed)
    kept_per_function: Counter = Counter()
    found: list[tuple[Mutation, list[str], str]] = []
    tries_left = {id(q): 3 * max_per_function for q in queues}  # a function whose mutants nobody notices is left
    pool = ThreadPoolExecutor(max_workers=len(workers))
    try:
        while queues and (max_tasks is None or len(found) < max_tasks):
            round_ = []
            for queue in queues:
                if queue and kept_per_function[queue[0].function] < max_per_function and tries_left[id(queue)] > 0:
                    round_.append(queue.pop(0))
                    tries_left[id(queue)] -= 1
            queues = [
                q for q in queues if q and tries_left[id(q)] > 0 and kept_per_function[q[0].function] < max_per_function
            ]
            for start in range(0, len(round_), len(workers)):
                if max_tasks is not None and len(found) >= max_tasks:
                    break
                batch = round_[start : start + len(workers)]
                results = list(pool.map(run, workers, batch))
                for mutation, (failing, output) in zip(batch, results, strict=True):
                    report.tried[mutation.kind] += 1
                    if (
                        failing
                        and (max_tasks is None or len(found) < max_tasks)
                        and kept_per_function[mutation.function] < max_per_function
                    ):
                        kept_per_function[mutation.function] += 1
                        found.append((mutation, failing, output))
    finally:
        # not waiting here: interrupted (Ctrl-C, SIGTERM), the caller closes the workers, which ends the runs in
        # flight at once; waiting first would keep the command alive until their tests had finished
        pool.shutdown(wait=False, cancel_futures=True)
    return found
