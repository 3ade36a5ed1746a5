"""`codefleet tasks ...`: generate, check and import task sets.

    codefleet tasks generate --out DIR --n N --seed S [--families a,b] [--difficulty 1|2|3|mixed]
                             [--split train|test|all] [--no-more-domains]
    codefleet tasks check DIR [--jobs J] [--runs R] [--set KEY=VALUE ...]
    codefleet tasks import-swebench --jsonl FILE --repos DIR --out DIR [--setup CMD ...] [--check-command CMD]
                                    [--env IMAGE] [--images DIR]
    codefleet tasks mine SOURCE [SOURCE ...] --out DIR [--seed S] [--max-per-function K] [--max-tasks N]
                         [--kinds a,b] [--index-url URL] [--max-unpacked-mb M] [--max-files F] [--set KEY=VALUE ...]
    codefleet tasks fetch [NAME==VERSION ...] [-r FILE] --dest DIR [--index-url URL] [--max-mb M]

`register(subparsers)` adds the `tasks` group to the main parser (the lead
wires it into codefleet/cli.py); `main(argv)` runs it standalone. `check`
prints one line per task as it finishes, then a summary, and exits 1 if any
task is unsound (2 if the task directory cannot be read).
"""

from __future__ import annotations

import argparse
import sys
import time

from codefleet.config import ConfigError, load_config
from codefleet.sandbox import SandboxConfig
from codefleet.store.safe_files import LinkRefused
from codefleet.tasks.checks import check_tasks
from codefleet.tasks.families import FAMILIES
from codefleet.tasks.fetch import FetchError, download_sdist, parse_requirement, read_requirements
from codefleet.tasks.generate import generate_tasks
from codefleet.tasks.mine import KINDS, MineError, mine_library
from codefleet.tasks.spec import TaskSpecError, load_task, save_tasks, task_paths
from codefleet.tasks.swebench import DEFAULT_CHECK_COMMAND, load_swebench
from codefleet.tasks.unpack import UnpackLimits


def _cannot_write(action: str, e: OSError, out: str) -> int:
    if isinstance(e, LinkRefused):  # a link planted in --out: its own sentence says which
        print(f"codefleet tasks {action}: {e}", file=sys.stderr)
        return 2
    print(
        f"codefleet tasks {action}: cannot write {e.filename or out!r} ({e.strerror or e}); pass --out a "
        "directory you can write",
        file=sys.stderr,
    )
    return 2


def _generate(args: argparse.Namespace) -> int:
    families = [f.strip() for f in args.families.split(",") if f.strip()] if args.families else None
    difficulty = None if args.difficulty == "mixed" else int(args.difficulty)
    if args.n < 1:
        print(f"codefleet tasks generate: --n must be at least 1, got {args.n}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        tasks = generate_tasks(args.out, args.n, args.seed, families, difficulty, args.split, args.more_domains)
    except ValueError as e:
        print(f"codefleet tasks generate: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        return _cannot_write("generate", e, args.out)
    counts: dict[str, int] = {}
    for task in tasks:
        counts[str(task.metadata["family"])] = counts.get(str(task.metadata["family"]), 0) + 1
    summary = ", ".join(f"{family} {count}" for family, count in counts.items())
    print(
        f"wrote {len(tasks)} tasks to {args.out} ({summary}; split {args.split}) in "
        f"{time.perf_counter() - started:.1f} s"
    )
    return 0


def _check(args: argparse.Namespace) -> int:
    if args.runs < 1:
        print(f"codefleet tasks check: --runs must be at least 1, got {args.runs}", file=sys.stderr)
        return 2
    try:
        config = load_config(SandboxConfig, None, list(args.set or []))
        paths = task_paths(args.dir)
    except (ConfigError, TaskSpecError, OSError) as e:
        print(f"codefleet tasks check: {e}", file=sys.stderr)
        return 2
    tasks, unreadable = [], []
    for path in paths:
        try:
            tasks.append(load_task(path))
        except (TaskSpecError, OSError) as e:  # an unreadable task is unsound; the others are still checked
            unreadable.append(path)
            print(f"UNSOUND  {path}  " + str(e).replace("\n", " "), flush=True)
    if not paths:
        print(f"codefleet tasks check: no tasks in {args.dir}", file=sys.stderr)
        return 2
    started = time.perf_counter()

    def show(report) -> None:
        print(report.line(), flush=True)

    reports = check_tasks(tasks, config, jobs=args.jobs, on_report=show, runs=args.runs)
    unsound = [r.task_id for r in reports if not r.sound] + unreadable
    print(
        f"checked {len(paths)} tasks in {time.perf_counter() - started:.1f} s: {len(paths) - len(unsound)} "
        f"sound, {len(unsound)} unsound" + (f" ({', '.join(unsound[:10])})" if unsound else "")
    )
    return 1 if unsound else 0


def _import_swebench(args: argparse.Namespace) -> int:
    try:
        tasks, errors = load_swebench(
            args.jsonl,
            args.repos,
            args.out,
            setup_commands=list(args.setup or []),
            check_command=args.check_command or DEFAULT_CHECK_COMMAND,
            environment=args.env or "",
            images_dir=args.images,
        )
        for error in errors:
            print(f"skipped {error}", file=sys.stderr)
        save_tasks(tasks, args.out)
    except LinkRefused as e:
        return _cannot_write("import-swebench", e, args.out)
    except OSError as e:
        print(
            f"codefleet tasks import-swebench: cannot {'read' if e.filename == args.jsonl else 'write'} "
            f"{e.filename or args.out!r} ({e.strerror or e}); check the --jsonl and --out paths",
            file=sys.stderr,
        )
        return 2
    print(f"imported {len(tasks)} tasks into {args.out} ({len(errors)} rows skipped)")
    return 1 if errors and not tasks else 0


def _mine(args: argparse.Namespace) -> int:
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()] if args.kinds else None
    if args.max_unpacked_mb < 1 or args.max_files < 1:
        print(
            f"codefleet tasks mine: --max-unpacked-mb and --max-files must be at least 1, got "
            f"{args.max_unpacked_mb} and {args.max_files}",
            file=sys.stderr,
        )
        return 2
    limits = UnpackLimits(max_bytes=args.max_unpacked_mb << 20, max_files=args.max_files)
    try:
        config = load_config(SandboxConfig, None, list(args.set or []))
    except ConfigError as e:
        print(f"codefleet tasks mine: {e}", file=sys.stderr)
        return 2
    started, tasks = time.perf_counter(), []
    for source in args.sources:
        try:
            report = mine_library(
                source,
                args.out,
                seed=args.seed,
                max_per_function=args.max_per_function,
                max_tasks=args.max_tasks,
                kinds=kinds,
                config=config,
                jobs=args.jobs,
                cache_dir=args.cache,
                limits=limits,
                index_urls=[args.index_url] if args.index_url else None,
            )
        except MineError as e:
            print(f"codefleet tasks mine: {e}", file=sys.stderr)
            return 2
        except OSError as e:
            return _cannot_write("mine", e, args.out)
        print(report.table(), file=sys.stderr)
        if {t.id for t in tasks} & {t.id for t in report.tasks}:
            print(
                f"codefleet tasks mine: two sources are {report.library} {report.version}; mine them into "
                "different --out directories",
                file=sys.stderr,
            )
            return 2
        tasks += report.tasks
    save_tasks(tasks, args.out)  # one index over every library's tasks
    print(f"mined {len(tasks)} tasks into {args.out} in {time.perf_counter() - started:.1f} s")
    return 0


def _fetch(args: argparse.Namespace) -> int:
    try:
        requirements = read_requirements(args.requirements) if args.requirements else []
        for text in args.requirements_given:
            requirement = parse_requirement(text)
            if requirement is None:
                raise FetchError(f"{text!r} is not NAME==VERSION [--hash=sha256:HEX]")
            requirements.append(requirement)
        if not requirements:
            raise FetchError("nothing to fetch: name NAME==VERSION or pass -r FILE")
        for requirement in requirements:
            print(
                download_sdist(requirement, args.dest, [args.index_url] if args.index_url else None, args.max_mb << 20)
            )
    except FetchError as e:
        print(f"codefleet tasks fetch: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(
            f"codefleet tasks fetch: cannot {'read' if e.filename == args.requirements else 'write'} "
            f"{e.filename or args.dest!r} ({e.strerror or e}); check -r and --dest",
            file=sys.stderr,
        )
        return 2
    return 0


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add `tasks generate|check|import-swebench|mine|fetch` to a parser's subcommands."""
    tasks = subparsers.add_parser(
        "tasks",
        help="coding task sets: generate, check, import",
        description="Coding task sets (format: docs/tasks.md).",
    )
    sub = tasks.add_subparsers(dest="tasks_action", required=True)
    for add in (_add_generate, _add_check, _add_import_swebench, _add_mine, _add_fetch):
        add(sub)
    return tasks


def _add_generate(sub: argparse._SubParsersAction) -> None:
    """`tasks generate`: procedural tasks from the bundled families."""
    gen = sub.add_parser(
        "generate",
        help="write N procedural tasks to DIR",
        description="Write N tasks from the bundled families (deterministic by seed).",
    )
    gen.add_argument("--out", required=True, metavar="DIR", help="task directory to write")
    gen.add_argument("--n", type=int, required=True, metavar="N", help="number of tasks")
    gen.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    gen.add_argument("--families", metavar="A,B", help=f"comma-separated subset of: {', '.join(FAMILIES)}")
    gen.add_argument(
        "--difficulty",
        default="mixed",
        choices=["1", "2", "3", "mixed"],
        help="files, size and distractors (default: mixed, drawn per task)",
    )
    gen.add_argument(
        "--split",
        default="train",
        choices=["train", "test", "all"],
        help="templates to draw from; test holds out templates train never uses (default train)",
    )
    gen.add_argument(
        "--more-domains",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draw training tasks from the six domains of families/more_domains.py too (default yes; "
        "codefleet train leaves them out, see tasks.more_domains)",
    )
    gen.set_defaults(func=_generate)


def _add_check(sub: argparse._SubParsersAction) -> None:
    """`tasks check`: prove every task in a directory sound."""
    check = sub.add_parser(
        "check",
        help="prove every task in DIR sound",
        description="For every task: the reference patch passes all hidden checks, the "
        "untouched repo fails every FAIL_TO_PASS and passes every PASS_TO_PASS, and repeated "
        "runs agree. Exit status 1 if any task is unsound.",
    )
    check.add_argument("dir", metavar="DIR", help="task directory (or one task.json)")
    check.add_argument("--jobs", type=int, default=2, metavar="J", help="tasks checked at once (default 2)")
    check.add_argument("--runs", type=int, default=2, metavar="R", help="runs per state for determinism (default 2)")
    check.add_argument("--set", action="append", metavar="KEY=VALUE", help="sandbox config override, repeatable")
    check.set_defaults(func=_check)


def _add_import_swebench(sub: argparse._SubParsersAction) -> None:
    """`tasks import-swebench`: tasks from a SWE-bench-style JSONL and local checkouts."""
    imp = sub.add_parser(
        "import-swebench",
        help="convert SWE-bench-style JSONL + local checkouts into tasks",
        description="Read a SWE-bench-style JSONL; export each base_commit from "
        "REPOS/<owner>__<name> as a tarball; write one task per good row. Bad rows are "
        "reported with their line number and skipped.",
    )
    imp.add_argument("--jsonl", required=True, metavar="FILE")
    imp.add_argument("--repos", required=True, metavar="DIR", help="directory of git checkouts")
    imp.add_argument("--out", required=True, metavar="DIR", help="task directory to write")
    imp.add_argument("--setup", action="append", metavar="CMD", help="setup command for every task, repeatable")
    imp.add_argument("--check-command", metavar="CMD", help="hidden check command with {tests}")
    imp.add_argument(
        "--env",
        metavar="IMAGE",
        help="the environment of every task: an image archive, a root "
        "filesystem or an imported image's id (docs/environments.md)",
    )
    imp.add_argument(
        "--images",
        metavar="DIR",
        help="saved images (<name with / and : as _>.tar) of the rows that name theirs (image_name, docker_image)",
    )
    imp.set_defaults(func=_import_swebench)


def _add_mine(sub: argparse._SubParsersAction) -> None:
    """`tasks mine`: bug-fix tasks mined from real libraries by mutation."""
    mine = sub.add_parser(
        "mine",
        help="bug-fix tasks mined from real libraries by mutation",
        description="Run each library's own tests, mutate the functions they cover, and keep "
        "the mutants some test notices as checked bug-fix tasks (docs/tasks.md, Mined tasks).",
    )
    mine.add_argument(
        "sources",
        nargs="+",
        metavar="SOURCE",
        help="a .tar.gz (or .zip) sdist, an unpacked source directory, or NAME==VERSION "
        "[--hash=sha256:HEX] (its sdist from pip's index; nothing of it runs on this machine)",
    )
    mine.add_argument("--out", required=True, metavar="DIR", help="task directory to write")
    mine.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    mine.add_argument("--max-per-function", type=int, default=2, metavar="K", help="tasks per function (default 2)")
    mine.add_argument("--max-tasks", type=int, metavar="N", help="tasks per library (default: no limit)")
    mine.add_argument("--kinds", metavar="A,B", help=f"mutation kinds, comma-separated subset of: {', '.join(KINDS)}")
    mine.add_argument("--jobs", type=int, default=2, metavar="J", help="sandboxes at once (default 2)")
    mine.add_argument(
        "--cache", metavar="DIR", help="where NAME==VERSION downloads are kept (default ~/.cache/codefleet/sdists)"
    )
    mine.add_argument(
        "--index-url",
        metavar="URL",
        help="the simple index (PEP 503/691) NAME==VERSION comes from "
        "(default: pip's index-url, then its extra-index-urls)",
    )
    mine.add_argument(
        "--max-unpacked-mb",
        type=int,
        default=UnpackLimits.max_bytes >> 20,
        metavar="M",
        help="the most a source may unpack to, and a download may weigh (default %(default)s)",
    )
    mine.add_argument(
        "--max-files",
        type=int,
        default=UnpackLimits.max_files,
        metavar="F",
        help="the most files, directories and links a source may hold (default %(default)s)",
    )
    mine.add_argument("--set", action="append", metavar="KEY=VALUE", help="sandbox config override, repeatable")
    mine.set_defaults(func=_mine)


def _add_fetch(sub: argparse._SubParsersAction) -> None:
    """`tasks fetch`: sdists downloaded as data, hash-checked."""
    fetch = sub.add_parser(
        "fetch",
        help="download sdists from the index as data, hash-checked, running nothing",
        description="Download the source distribution of each NAME==VERSION into DIR, "
        "reading pip's index through its simple API: the sdist's sha256 is checked against "
        "the index and against any --hash=sha256: pin, and none of its code runs (unlike "
        "pip download, which builds its metadata).",
    )
    fetch.add_argument(
        "requirements_given",
        nargs="*",
        metavar="NAME==VERSION",
        help="a requirement, optionally with ' --hash=sha256:HEX' in the same argument",
    )
    fetch.add_argument(
        "-r",
        "--requirements",
        metavar="FILE",
        help="a requirements file of NAME==VERSION [--hash=sha256:HEX] lines (all pinned, or none)",
    )
    fetch.add_argument("--dest", required=True, metavar="DIR", help="where the sdists go (kept if there)")
    fetch.add_argument("--index-url", metavar="URL", help="the simple index to read (default: pip's)")
    fetch.add_argument(
        "--max-mb",
        type=int,
        default=UnpackLimits.max_bytes >> 20,
        metavar="M",
        help="the most one download may weigh (default %(default)s)",
    )
    fetch.set_defaults(func=_fetch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="codefleet")
    register(parser.add_subparsers(dest="group", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
