"""`codefleet agent run`: the product — an agent on your repository, with any OpenAI-compatible model.

    codefleet agent run --repo . --task "make the tests pass" --model http://localhost:8000/v1

The repository is overlaid into a sandbox (copy-on-write) and is never
modified unless `--apply`, which applies the final diff with `git apply`
after checking it applies cleanly. Progress (turns, tool calls, durations)
streams to stderr; the diff goes to stdout, or with `--json` one JSON object
(diff, turns, tool_calls, stop_reason, wall_s, ... and every attempt).
`--attempts N` runs N attempts at once in forked sandboxes and keeps the best
(attempts.py). While it runs, each line typed on stdin (a terminal or a pipe)
is sent to the agent as a correction, seen at its next turn.

`register(subparsers)` adds the `agent` command group to the main `codefleet`
parser; `main(argv)` runs it standalone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from codefleet.agent import toolchain, workspace
from codefleet.agent.attempts import Attempt, best_attempt, run_attempts
from codefleet.agent.clients import build_policy
from codefleet.agent.clients.local_engine import grammar_options
from codefleet.agent.loop import AgentLoop, Event
from codefleet.config import ConfigError, load_config
from codefleet.contracts import ENGINES, SANDBOXES
from codefleet.model import checkpoint
from codefleet.sandbox import SandboxConfig, SandboxError, create_sandbox, environments, resolve_backend
from codefleet.types import Budgets


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `agent run` to a `codefleet` parser's subcommands."""
    agent = subparsers.add_parser("agent", help="run the coding agent on a repository")
    agent_sub = agent.add_subparsers(dest="action", required=True)
    run = agent_sub.add_parser(
        "run",
        help="run the agent on a repository with an OpenAI-compatible model",
        description="Run the coding agent on a copy-on-write view of REPO; REPO is only changed with --apply. "
        "Lines typed on stdin while it runs are sent to the agent as corrections.",
    )
    _add_task_arguments(run)
    _add_budget_arguments(run)
    _add_engine_and_sandbox_arguments(run)
    run.set_defaults(func=run_command)


def _add_task_arguments(run: argparse.ArgumentParser) -> None:
    """What to do, with which model (and planner), how many attempts, and what to do with the result."""
    run.add_argument("--repo", default=".", help="the repository to work on (default: .)")
    run.add_argument("--task", required=True, help="what to do, in words")
    run.add_argument(
        "--model",
        required=True,
        help="OpenAI-compatible base URL, e.g. http://localhost:8000/v1, or "
        "local:CHECKPOINT_DIR for codefleet's own engine in this process",
    )
    run.add_argument("--model-name", default="", help="model name (default: the first one the endpoint lists)")
    run.add_argument(
        "--planner", default=None, help="base URL (or local:CHECKPOINT_DIR) of a planner model that writes a plan first"
    )
    run.add_argument("--planner-model-name", default="", help="the planner's model name")
    run.add_argument("--attempts", type=int, default=1, help="parallel attempts in forked sandboxes (default 1)")
    run.add_argument("--test-command", default="", help="visible test command; picks the best attempt")
    run.add_argument("--apply", action="store_true", help="apply the final diff to REPO")
    run.add_argument("--json", action="store_true", help="print one JSON object on stdout at the end")


def _add_budget_arguments(run: argparse.ArgumentParser) -> None:
    """The episode's budgets and the model requests' patience."""
    run.add_argument("--max-turns", type=int, default=None, help=f"turn budget (default {Budgets().max_turns})")
    run.add_argument(
        "--max-wall-s",
        type=float,
        default=None,
        help=f"wall-clock budget in seconds (default {Budgets().wall_clock_s:g})",
    )
    run.add_argument("--timeout-s", type=float, default=300.0, help="per model request (default 300)")
    run.add_argument("--max-retries", type=int, default=3, help="retries of a failed model request (default 3)")


def _add_engine_and_sandbox_arguments(run: argparse.ArgumentParser) -> None:
    """Where the commands run (sandbox backend, settings, virtual environment, image) and, for a local
    model, how it is prompted and sampled."""
    run.add_argument(
        "--backend",
        choices=["auto", *SANDBOXES.names()],
        default=None,
        help="sandbox backend (vm: a microVM per sandbox, docs/sandboxes/vm.md)",
    )
    run.add_argument(
        "--prompt",
        choices=["full", "bare"],
        default=None,
        help="'full' sends the system prompt and tool schemas; 'bare' the task alone, for a policy "
        "trained without them (default: full, or for --model local:DIR the style the checkpoint's "
        "metadata.json says it was trained on)",
    )
    run.add_argument(
        "--tool-grammar",
        choices=["off", "auto", "required"],
        default=None,
        help="for --model local:...: the engine samples only tool calls that parse and fit their schemas "
        "('required': and every turn calls a tool; default: what the checkpoint's metadata.json says, "
        "else off). A server constrains its own decoding (codefleet serve --tool-grammar)",
    )
    run.add_argument(
        "--engine",
        choices=ENGINES.names(),
        default="codefleet",
        help="for --model local:...: the inference engine (vllm: a Hugging Face checkpoint, in the "
        ".venv-vllm that scripts/setup_vllm.sh makes; default codefleet)",
    )
    run.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a SandboxConfig field")
    run.add_argument(
        "--venv",
        default="auto",
        metavar="auto|none|DIR",
        help="the Python virtual environment the sandbox uses, read-only, first on PATH: auto (the "
        "repo's .venv or venv, else an active VIRTUAL_ENV; default), none, or its directory",
    )
    run.add_argument(
        "--env",
        default=None,
        metavar="IMAGE",
        help="run in an image's userland instead of this machine's: an OCI image (oci-layout "
        "directory or tarball, docker save tarball; imported once) or a root filesystem "
        "directory (docs/environments.md)",
    )


def _progress(n_attempts: int, err: TextIO) -> Callable[[int, Event], None]:
    lock = threading.Lock()

    def on_event(index: int, event: Event) -> None:
        tag = f"[attempt {index + 1}] " if n_attempts > 1 else ""
        kind = event["event"]
        if kind == "turn":
            names = ", ".join(event["tool_calls"]) or "no tool calls"
            line = (
                f"{tag}turn {event['turn'] + 1}: {names} (model {event['model_s']:.2f} s, tools "
                f"{event['tool_s']:.2f} s, {event['tokens']} tokens)"
            )
            line += f" — {len(event['errors'])} error(s)" if event["errors"] else ""
            text = " ".join(event["text"].split())
            line += f"\n{tag}  {text[:200]}{'…' if len(text) > 200 else ''}" if text else ""
        elif kind == "plan":
            line = f"{tag}plan ({event['model_s']:.1f} s):\n{event['text']}"
        elif kind == "correction":
            line = f"{tag}correction delivered: {event['text']}"
        elif kind == "model_error":
            line = f"{tag}model error: {event['error']}"
        elif kind == "stop":
            line = f"{tag}stopped ({event['stop_reason']}) after {event['turns']} turns, {event['wall_s']:.1f} s"
        else:
            return
        with lock:
            print(line, file=err, flush=True)

    return on_event


class Corrections:
    """Lines typed by the user, delivered to every attempt's loop — also to loops that start later."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loops: list[AgentLoop] = []
        self._sent: list[str] = []

    def add_loop(self, loop: AgentLoop) -> None:
        with self._lock:
            self._loops.append(loop)
            for text in self._sent:
                loop.inject(text)

    def send(self, text: str) -> None:
        with self._lock:
            self._sent.append(text)
            for loop in self._loops:
                loop.inject(text)

    def read_from(self, stream: TextIO, err: TextIO) -> None:
        for line in stream:
            text = line.strip()
            if text:
                self.send(text)
                print(f"correction queued: {text}", file=err, flush=True)


def _interactive(stream: TextIO | None) -> bool:
    """True when `stream` is a terminal or a pipe (not a file, not /dev/null, not closed)."""
    try:
        mode = os.fstat(stream.fileno()).st_mode
    except (AttributeError, OSError, ValueError):
        return False
    return stream.isatty() or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def _usage(model: str) -> dict[str, str]:
    """How a `local:CHECKPOINT` policy is meant to be prompted (its checkpoint says: prompt style, tool grammar);
    the defaults for a server, which renders requests in its checkpoint's style itself (`codefleet serve`)."""

    return checkpoint.usage(model.partition(":")[2]) if model.startswith("local:") else dict(checkpoint.USAGE_DEFAULTS)


def _attempt_summary(a: Attempt) -> dict:
    t = a.trajectory
    return {
        "attempt": a.index,
        "stop_reason": t.stop_reason,
        "turns": t.n_turns,
        "tool_calls": t.n_tool_calls,
        "tool_calls_per_turn": round(t.tool_calls_per_turn, 3),
        "wall_s": round(t.wall_s, 3),
        "model_s": round(t.model_s, 3),
        "tool_s": round(t.tool_s, 3),
        "tokens": t.tokens,
        "tests_passed": a.tests_passed,
        "error": t.metadata.get("error", ""),
        "diff": a.diff,
    }


def _with_toolchain(config: SandboxConfig, args: argparse.Namespace, err: TextIO) -> SandboxConfig:
    """`config` with `--env`'s userland or the project's virtual environment (`--venv`), saying which."""
    if args.env:
        if args.venv not in ("auto", "none"):
            raise toolchain.ToolchainError(
                "a virtual environment of this machine runs on its own userland, not on "
                "an image's: give one of --venv and --env"
            )
        rootfs = args.env if _is_rootfs(args.env) else environments.import_image(args.env).rootfs
        print(f"codefleet agent run: the sandbox runs in the userland of {args.env}", file=err)
        return dataclasses.replace(config, environment=rootfs)
    if args.venv == "none":
        return config
    venv = toolchain.find_venv(args.repo, dict(os.environ)) if args.venv == "auto" else toolchain.venv_at(args.venv)
    if venv is None:
        return config
    if not SANDBOXES.get(name := resolve_backend(config.backend)).host_binds:  # e.g. a VM: no host path
        if args.venv != "auto":
            raise toolchain.ToolchainError(
                f"a {name} sandbox cannot use this machine's virtual environment "
                f"{venv.path}; give the packages as an environment (--env), or use "
                "--backend namespace"
            )
        print(
            f"codefleet agent run: the {name} sandbox does not see the virtual environment {venv.path}; its "
            "commands use the environment's python3 (--env gives an image with the packages)",
            file=err,
        )
        return config
    print(
        f"codefleet agent run: the sandbox uses the virtual environment {venv.path} (read-only; --venv none "
        "to leave it out)",
        file=err,
    )
    return toolchain.with_venv(config, venv)


def _is_rootfs(path: str) -> bool:
    return (
        os.path.isdir(path)
        and not os.path.exists(os.path.join(path, "oci-layout"))
        and any(os.path.isdir(os.path.join(path, top)) for top in ("usr", "bin"))
    )


def run_command(
    args: argparse.Namespace, stdin: TextIO | None = None, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    stdin = sys.stdin if stdin is None else stdin
    out, err = out or sys.stdout, err or sys.stderr
    problem = _bad_arguments(args)
    if problem:
        print(f"codefleet agent run: {problem}", file=err)
        return 2
    defaults = Budgets()
    budgets = Budgets(
        max_turns=defaults.max_turns if args.max_turns is None else args.max_turns,
        wall_clock_s=defaults.wall_clock_s if args.max_wall_s is None else args.max_wall_s,
    )
    deadline = time.monotonic() + budgets.wall_clock_s  # no model request outlasts the wall clock
    try:
        overrides = list(args.set or []) + ([f"backend={args.backend}"] if args.backend else [])
        sandbox_config = _with_toolchain(load_config(SandboxConfig, None, overrides), args, err)
        policy = _policy(args, args.model, args.model_name, args.tool_grammar, deadline)
        prompt = args.prompt or _usage(args.model)["prompt"]
        planner = _policy(args, args.planner, args.planner_model_name, "off", deadline) if args.planner else None
    except (ConfigError, ValueError, NotImplementedError, OSError, ImportError, SandboxError) as e:  # --env, vLLM
        print(f"codefleet agent run: {e}", file=err)
        return 2
    corrections = Corrections()
    if _interactive(stdin):
        threading.Thread(target=corrections.read_from, args=(stdin, err), daemon=True, name="corrections").start()
    stopping = threading.Event()  # the first Ctrl-C: attempts stop and keep their diffs, printed, not applied

    def stop() -> None:
        print(
            "codefleet agent run: stopping; each attempt ends after its current model call or command and keeps "
            "its diff; Ctrl-C again to quit at once",
            file=err,
            flush=True,
        )
        stopping.set()

    try:
        if prompt == "bare":
            print(
                "codefleet agent run: bare prompt: the model sees the task alone, without the system prompt and "
                "tool schemas, as it was trained",
                file=err,
            )
        attempts = _run_attempts(args, sandbox_config, policy, planner, budgets, prompt, corrections, stop, err)
    except (SandboxError, workspace.WorkspaceDiffError, FileNotFoundError) as e:
        print(f"codefleet agent run: {e}", file=err)
        return 2
    except KeyboardInterrupt:  # the second Ctrl-C
        print("codefleet agent run: interrupted; the repository was not changed", file=err)
        return 130
    finally:
        for p in (policy, planner):
            engine = getattr(p, "engine", None)  # a local:CHECKPOINT policy's engine thread
            if engine is not None:
                engine.close()
    return _report(args, attempts, stopping.is_set(), out, err)


def _bad_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the command line's numbers and --repo, in one sentence, or None."""
    if args.attempts < 1:
        return "--attempts must be at least 1"
    if args.max_turns is not None and args.max_turns < 1:
        return f"--max-turns must be at least 1, got {args.max_turns}"
    if args.max_wall_s is not None and not args.max_wall_s > 0:  # `not >`: NaN is refused too
        return f"--max-wall-s must be a positive number of seconds, got {args.max_wall_s:g}"
    if not os.path.isdir(args.repo):
        return f"--repo {args.repo!r} is not a directory"
    return None


def _policy(args: argparse.Namespace, spec: str, model_name: str, grammar: str | None, deadline: float):
    """The policy `spec` names: an OpenAI-compatible URL, or `local:CHECKPOINT` on the engine `--engine` names
    (codefleet.contracts.ENGINES), loaded in this process."""
    if spec == "local" or spec.startswith("local:"):  # the HTTP options mean nothing to an in-process engine
        options = grammar_options(grammar or _usage(spec)["tool_grammar"])
        backend = ENGINES.get(args.engine)
        if options["tool_grammar"] and not backend.tool_grammar:
            raise ValueError(
                f"--tool-grammar constrains the tool calls of an engine that has a tool-call grammar, "
                f"which the {args.engine} engine has not; with --engine {args.engine} give "
                "--tool-grammar off"
            )
        if spec.partition(":")[2]:  # `local` alone: build_policy says it needs a checkpoint
            options["engine"] = backend.load(spec.partition(":")[2], max_batch=16, **backend.serve_options)
        return build_policy(spec, model_name, **options)
    if grammar not in (None, "off"):
        raise ValueError(
            "--tool-grammar constrains codefleet's own engine (--model local:...); a server "
            "constrains its own decoding (codefleet serve --tool-grammar)"
        )
    return build_policy(spec, model_name, timeout_s=args.timeout_s, max_retries=args.max_retries, deadline=deadline)


def _run_attempts(
    args: argparse.Namespace,
    sandbox_config: SandboxConfig,
    policy,
    planner,
    budgets: Budgets,
    prompt: str,
    corrections: Corrections,
    stop: Callable[[], None],
    err: TextIO,
) -> list[Attempt]:
    """`--attempts` attempts at the task, each in its own fork of one sandbox over the repository; every sandbox
    is closed on the way out."""
    sandboxes = [create_sandbox(args.repo, sandbox_config)]
    try:
        for nested in workspace.snapshot(sandboxes[0]):
            print(
                f"codefleet agent run: warning: {nested}/ is a git repository of its own, so changes inside it "
                "will not be in the diff; run the agent on that directory to change it",
                file=err,
            )
        if args.attempts > 1:
            sandboxes = sandboxes[0].fork(args.attempts) + sandboxes
        return run_attempts(
            sandboxes[: args.attempts],
            args.task,
            policy,
            planner=planner,
            test_command=args.test_command,
            budgets=budgets,
            on_event=_progress(args.attempts, err),
            on_loop=corrections.add_loop,
            on_interrupt=stop,
            prompt=prompt,
        )
    finally:
        for sb in sandboxes:
            sb.close()


def _report(args: argparse.Namespace, attempts: list[Attempt], stopped: bool, out: TextIO, err: TextIO) -> int:
    """Print the best attempt's diff (or `--json`'s object), apply it with `--apply`; the exit status."""
    best = best_attempt(attempts)
    result = {
        **_attempt_summary(best),
        "best_attempt": best.index,
        "applied": False,
        "attempts": [_attempt_summary(a) for a in attempts],
    }
    code = 1 if best.trajectory.stop_reason == "error" else 0
    for a in attempts:
        if "diff_error" in a.trajectory.metadata:
            tag = f"attempt {a.index + 1}: " if len(attempts) > 1 else ""
            print(
                f"codefleet agent run: {tag}could not take the diff, so its changes are lost: "
                f"{a.trajectory.metadata['diff_error']}",
                file=err,
            )
    if "diff_error" in best.trajectory.metadata:
        result["diff_error"] = best.trajectory.metadata["diff_error"]
        code = 1
    if stopped:
        code = 130
        if args.apply and best.diff.strip():
            print(
                "codefleet agent run: interrupted, so the diff was not applied; it is in the output (`git apply` "
                "takes it)",
                file=err,
            )
    elif args.apply and best.diff.strip():
        try:
            workspace.apply_diff(args.repo, best.diff)
            result["applied"] = True
            print(f"applied the diff to {os.path.abspath(args.repo)}", file=err)
        except RuntimeError as e:
            result["apply_error"] = str(e)
            print(f"codefleet agent run: {e}", file=err)
            code = 1
    if args.json:
        print(json.dumps(result), file=out, flush=True)
    else:
        _write_diff(out, best.diff)
        if not best.diff.strip() and "diff_error" not in best.trajectory.metadata:
            print("(no changes)", file=err)
    return code


def _write_diff(out: TextIO, diff: str) -> None:
    """Write the diff with bytes that are not UTF-8 as they are in the files (workspace.diff keeps them as
    surrogates), not as an encoding error."""
    buffer = getattr(out, "buffer", None)
    if buffer is not None:
        out.flush()
        buffer.write(diff.encode("utf-8", "surrogateescape"))
        buffer.flush()
    else:
        out.write(diff.encode("utf-8", "surrogateescape").decode("utf-8", "replace"))
        out.flush()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="codefleet")
    register(parser.add_subparsers(dest="group", required=True))
    return parser


def main(
    argv: list[str] | None = None, stdin: TextIO | None = None, out: TextIO | None = None, err: TextIO | None = None
) -> int:
    """`codefleet agent ...` on its own: main(["agent", "run", "--repo", ".", ...])."""
    args = build_parser().parse_args(argv)
    return args.func(args, stdin=stdin, out=out, err=err)


if __name__ == "__main__":
    sys.exit(main())
