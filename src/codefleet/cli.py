"""`codefleet` — one command, subcommands per capability.

    codefleet agent run --repo PATH --task TEXT --model URL [...]
    codefleet serve --checkpoint DIR [--host H] --port P
    codefleet train [--config FILE] --out RUN_DIR [KEY=VALUE ...]
    codefleet eval --checkpoint DIR --tasks DIR
    codefleet analyze RUN_DIR
    codefleet chaos RUN_CONFIG --minutes N --seed S
    codefleet tasks generate|check|import-swebench ...
    codefleet sandbox run [--repo DIR] [--timeout S] [--memory-mb N] -- CMD [ARGS...]
    codefleet bench sandbox|env|moe|engine|controller|analyze|weightsync|gpucheck|mine|scale [--quick] [--json]

Each command's module is imported only when that command runs, so that `codefleet sandbox run` and
`codefleet --help` do not pay for importing PyTorch and Ray (about 2 s).

Ctrl-C, SIGTERM and SIGHUP end any command with one line on stderr and the status 128 + the signal's
number, after its sandboxes are closed and their mounts, cgroups and state directory removed (`main`).
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import shlex
import signal
import subprocess
import sys
import threading
import time

from codefleet.config import ConfigError, load_config
from codefleet.contracts import SANDBOXES
from codefleet.sandbox import SandboxConfig, SandboxError, create_sandbox, resolve_backend

# command -> (the module whose `register(subparsers)` adds its parser, what it does in one line)
COMMANDS = {
    "agent": ("codefleet.agent.cli", "run the coding agent on a repository"),
    "serve": ("codefleet.inference.serve_cli", "serve a checkpoint behind an OpenAI-compatible API"),
    "train": ("codefleet.recipe.cli", "tasks -> expert demos -> SFT -> asynchronous RL on Ray -> held-out evaluation"),
    "eval": ("codefleet.recipe.cli", "evaluate a checkpoint or an OpenAI-compatible model on a task directory"),
    "analyze": (
        "codefleet.analysis.cli",
        "analyse a run's rollouts with Ray Data: summary.json, judgments.parquet, report.html",
    ),
    "tasks": ("codefleet.tasks.cli", "coding task sets: generate, check, import"),
    "export": (
        "codefleet.model.export_cli",
        "write a checkpoint as a Hugging Face model directory (transformers, vLLM)",
    ),
    "env": ("codefleet.sandbox.env_cli", "environments (OCI images) sandboxes run in: import, ls, rm, gc"),
    "chaos": (
        "codefleet.chaos.cli",
        "a training run on a local multi-node Ray cluster under injected faults, then its invariants",
    ),
}


def _sandbox_run(args: argparse.Namespace) -> int:
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        print(
            "codefleet sandbox run: give the command after `--`, e.g. `codefleet sandbox run --repo . -- pytest -q`",
            file=sys.stderr,
        )
        return 2
    if args.repo is not None and not os.path.isdir(args.repo):
        problem = "is not a directory" if os.path.exists(args.repo) else "does not exist"
        print(
            f"codefleet sandbox run: repository directory {args.repo!r} {problem}; give --repo an "
            "existing directory (or leave it out for an empty workspace)",
            file=sys.stderr,
        )
        return 2
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        print(
            f"codefleet sandbox run: --timeout must be a positive number of seconds, got {args.timeout:g}",
            file=sys.stderr,
        )
        return 2
    overrides = list(args.set or [])
    if args.memory_mb is not None:
        overrides.append(f"memory_mb={args.memory_mb}")
    if args.backend:
        overrides.append(f"backend={args.backend}")
    try:
        config = load_config(SandboxConfig, args.config, overrides)
        resolve_backend(config.backend)  # an unknown backend is a usage error, like a bad key
    except (ConfigError, ValueError) as e:
        print(f"codefleet sandbox run: {e}", file=sys.stderr)
        return 2
    line = command[0] if len(command) == 1 else shlex.join(command)
    try:
        with create_sandbox(args.repo, config) as sb:
            result = sb.exec(line, timeout_s=args.timeout)
    except (SandboxError, FileNotFoundError) as e:
        print(f"codefleet sandbox run: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(result.output)
    sys.stdout.flush()
    if result.timed_out:
        return 124
    return result.exit_code if 0 <= result.exit_code < 256 else 1


def _sandbox_vm_setup(args: argparse.Namespace) -> int:
    from codefleet.sandbox import vm, vm_disks, vm_image

    try:
        print(f"kernel: {vm_image.setup_kernel(args.deb)}", flush=True)
        print(f"initramfs: {vm_image.initramfs()}", flush=True)
        started = time.perf_counter()
        print(
            f"environment disk (host userland): {vm_disks.environment_disk()} ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
        if not args.no_snapshot:
            with create_sandbox(None, SandboxConfig(backend="vm")) as sb:  # boots and saves the default shape
                print(
                    f"snapshot: ready ({sb.info.limits['accel']}); a sandbox restored from it in "
                    f"{sb.restore_s * 1000:.0f} ms",
                    flush=True,
                )
    except (SandboxError, OSError, subprocess.CalledProcessError) as e:
        print(f"codefleet sandbox vm-setup: {e}", file=sys.stderr)
        return 2
    print(f"codefleet sandbox vm-setup: done ({vm.accel()})")
    return 0


_BENCHES = {
    "sandbox": "codefleet.bench.sandbox_bench",
    "env": "codefleet.bench.env_bench",
    "moe": "codefleet.bench.moe_bench",
    "engine": "codefleet.bench.engine_bench",
    "controller": "codefleet.bench.controller_bench",
    "analyze": "codefleet.bench.analyze_bench",
    "weightsync": "codefleet.bench.weightsync_bench",
    "gpucheck": "codefleet.bench.gpu_check",
    "mine": "codefleet.bench.mine_bench",
    "scale": "codefleet.bench.scale_bench",
}


def _bench(args: argparse.Namespace) -> int:
    run_cli = importlib.import_module(_BENCHES[args.what]).run_cli
    if args.what == "sandbox":
        return run_cli(quick=args.quick, as_json=args.json, backend=args.backend)
    if args.what == "engine":
        return run_cli(quick=args.quick, as_json=args.json, checkpoint_dir=args.checkpoint, shape=args.shape or "tiny")
    if args.what == "gpucheck":
        return run_cli(quick=args.quick, as_json=args.json, device=args.device, shape=args.shape)
    return run_cli(quick=args.quick, as_json=args.json)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser of `codefleet`; of the commands in COMMANDS, only the one `argv` names (default: the
    command line's) gets its full parser, the others a line in the help."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="codefleet", description="Train fast coding agents with RL.")
    sub = parser.add_subparsers(dest="group", required=True)
    _add_sandbox_parser(sub)
    _add_bench_parser(sub)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    if chosen in COMMANDS:
        importlib.import_module(COMMANDS[chosen][0]).register(sub)
    for name, (_, help_line) in COMMANDS.items():
        if name not in sub.choices:
            sub.add_parser(name, help=help_line)
    return parser


def _add_sandbox_parser(sub) -> None:
    """`codefleet sandbox run` and `codefleet sandbox vm-setup`, which need no heavy import to parse."""
    sandbox = sub.add_parser(
        "sandbox",
        help="isolated copy-on-write sandboxes",
        description="Isolated copy-on-write sandboxes (docs/sandboxes/choosing-a-backend.md).",
    )
    sandbox_sub = sandbox.add_subparsers(dest="action", required=True)
    run = sandbox_sub.add_parser(
        "run",
        help="run one command in a fresh sandbox over a repository",
        description="Run CMD in a fresh sandbox's shell with the workspace (a "
        "copy-on-write view of DIR; DIR itself is never modified) as cwd. Prints the "
        "output and exits with the command's exit code (124 on timeout).",
    )
    run.add_argument("--repo", default=None, help="directory to work on (default: an empty workspace)")
    run.add_argument("--timeout", type=float, default=600.0, help="wall-clock limit in seconds (default 600)")
    run.add_argument("--memory-mb", type=int, default=None, help="memory limit in MB")
    run.add_argument(
        "--backend",
        choices=["auto", *SANDBOXES.names()],
        default=None,
        help="sandbox backend (default: SandboxConfig's, auto)",
    )
    run.add_argument("--config", default=None, help="YAML file with SandboxConfig fields")
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a SandboxConfig field")
    run.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    run.set_defaults(func=_sandbox_run)
    vm_setup = sandbox_sub.add_parser(
        "vm-setup",
        help="fetch the guest kernel and build the disks vm sandboxes boot",
        description="Set up the vm backend (docs/sandboxes/vm.md): extract the guest "
        "kernel from Debian's kernel package (downloaded with apt unless --deb names "
        "one), build the initramfs and the host userland's read-only disk, and boot one "
        "VM to save its snapshot. Idempotent.",
    )
    vm_setup.add_argument("--deb", default=None, metavar="FILE", help="a linux-image-*.deb to take the kernel from")
    vm_setup.add_argument("--no-snapshot", action="store_true", help="build the files only; boot nothing")
    vm_setup.set_defaults(func=_sandbox_vm_setup)


def _add_bench_parser(sub) -> None:
    """`codefleet bench WHAT`: one parser for every benchmark in _BENCHES, with the flags some of them take."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks (a table, then one JSON object)",
        description="Run a benchmark; it prints a table, then one JSON object (docs/benchmarks.md).",
    )
    bench.add_argument("what", choices=sorted(_BENCHES))
    bench.add_argument("--quick", action="store_true", help="a smaller run (10-90 s, by benchmark and machine load)")
    bench.add_argument("--json", action="store_true", help="print only the JSON object")
    bench.add_argument(
        "--backend",
        choices=["auto", *SANDBOXES.names(), "both"],
        default="auto",
        help="sandbox backend (bench sandbox only; both: namespace and vm)",
    )
    bench.add_argument(
        "--checkpoint",
        metavar="DIR",
        default=None,
        help="Hugging Face model directory that codefleet's engine and transformers' generate() "
        "both run (bench engine only; default: a tiny random Qwen3-MoE built with transformers)",
    )
    bench.add_argument(
        "--shape",
        choices=["tiny", "qwen3-0.6b", "moe-1b"],
        default=None,
        help="random model that bench engine builds without --checkpoint: tiny (default), a dense "
        "Qwen3 of Qwen3-0.6B's shape, or a ~1B-total Qwen3-MoE (fewer tokens at these two); bench "
        "gpucheck: moe-1b (default on cuda) or tiny (default on cpu)",
    )
    bench.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda",
        help="bench gpucheck only: the GPU (scripts/gpu_check.sh), or its code path on CPU",
    )
    bench.set_defaults(func=_bench)


class Terminated(SystemExit):
    """Raised in the main thread by SIGTERM or SIGHUP, so that on the way out `with` blocks and `finally`
    clauses close the sandboxes, and at exit state.py's hook removes their mounts, cgroups and state
    directory. A SystemExit: `except Exception` lets it through, and were it never caught the process
    would still exit quietly with 128 + the signal's number."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


_STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def _set_handlers(handlers: dict) -> None:
    """Install `handlers` ({signal: handler}) if this is the main thread (no other may)."""
    if threading.current_thread() is threading.main_thread():
        for s, handler in handlers.items():
            signal.signal(s, handler)


def _terminate(signum: int, frame: object) -> None:
    _set_handlers(dict.fromkeys(_STOP_SIGNALS, signal.SIG_IGN))  # the clean-up on the way out is not cut short
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    """Run one `codefleet` command: the program (argv None: the command line), or a call from Python.

    As the program, Ctrl-C (SIGINT), SIGTERM and SIGHUP end the command with one line on stderr and the
    status 128 + the signal's number, with everything it started released (a subcommand may handle Ctrl-C
    itself: `agent run` stops its attempts gently at the first one). A call leaves signals to its caller."""
    if argv is not None:
        args = build_parser(argv).parse_args(argv)
        return args.func(args)
    # a signal the process was started with ignored (nohup, a background job) stays ignored
    _set_handlers({s: _terminate for s in _STOP_SIGNALS if signal.getsignal(s) != signal.SIG_IGN})
    try:
        args = build_parser().parse_args()
        return args.func(args)
    except KeyboardInterrupt:
        stopped_by = signal.SIGINT
    except Terminated as e:
        stopped_by = e.signum
    # what is released at exit (state.py: mounts, cgroups, the state directory) is not cut short either
    _set_handlers(dict.fromkeys((signal.SIGINT, *_STOP_SIGNALS), signal.SIG_IGN))
    name = "SIGINT (Ctrl-C)" if stopped_by == signal.SIGINT else signal.Signals(stopped_by).name
    print(f"codefleet: interrupted by {name}; its sandboxes were closed", file=sys.stderr)
    return 128 + stopped_by


if __name__ == "__main__":
    sys.exit(main())
