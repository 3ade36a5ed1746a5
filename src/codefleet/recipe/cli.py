"""`codefleet train` and `codefleet eval`. Run directories, checkpoints, task directories and `eval --out` may be
fsspec URLs (`s3://bucket/run`, codefleet.store.storage; docs/training.md). Nothing below `train --out` or
`eval --out` is written through a symlink (codefleet.store.safe_files): a planted one is refused in one sentence,
before the evaluation starts where it is already there."""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from codefleet.agent.episode import EpisodeConfig
from codefleet.agent.policy import PolicyError
from codefleet.chat.codefleet_template import PROMPTS
from codefleet.config import ConfigError
from codefleet.fleet.controller_api import ControllerError
from codefleet.model import checkpoint
from codefleet.recipe.config import load_train_config
from codefleet.recipe.config_check import resumed_config
from codefleet.recipe.eval_config import EvalConfig
from codefleet.recipe.evaluate import comparison_line, evaluate, evaluate_endpoint, report_json
from codefleet.recipe.run_dir import RunDir
from codefleet.recipe.train import RunError, results_table, train
from codefleet.store import storage
from codefleet.store.parquet import RolloutWriter, rollout_record
from codefleet.store.safe_files import LinkRefused
from codefleet.tasks.spec import load_tasks
from codefleet.types import Budgets


def register(subparsers) -> None:
    """Add `codefleet train` and `codefleet eval` to the command's subparsers (codefleet.cli.COMMANDS)."""
    _add_train_parser(subparsers)
    _add_eval_parser(subparsers)


def _add_train_parser(subparsers) -> None:
    train = subparsers.add_parser(
        "train",
        help="tasks -> expert demos -> SFT -> asynchronous RL on Ray -> held-out evaluation",
        description="With no config, the tiny embedded default end to end (docs/training.md). Settings are the "
        "defaults, then the recipe the field `recipe` names (default: demo), then --config FILE, then KEY=VALUE "
        "overrides (e.g. rl.steps=20 cluster.num_cpus=8); every field: docs/configuration.md.",
    )
    train.add_argument("--config", default=None, help="YAML file with TrainRunConfig fields (docs/configuration.md)")
    train.add_argument(
        "--out",
        default=None,
        help="run directory, or an fsspec URL such as s3://bucket/run (required unless --resume RUN_DIR)",
    )
    train.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue the run in RUN_DIR (a directory or URL) after a crash",
    )
    train.add_argument("--address", default=None, help="Ray cluster address (default: RAY_ADDRESS or a local Ray)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    train.set_defaults(func=_train)


def _add_eval_parser(subparsers) -> None:
    ev = subparsers.add_parser(
        "eval",
        help="evaluate a checkpoint or an OpenAI-compatible model on a task directory",
        description="Success, turns, tool calls, tool calls per turn and wall clock per task "
        "of CHECKPOINT, or of the model behind --model URL, on the tasks in DIR (greedy "
        "decoding by default).",
    )
    policy = ev.add_mutually_exclusive_group(required=True)
    policy.add_argument("--checkpoint", help="checkpoint directory (or URL), run by codefleet's engine in this process")
    policy.add_argument(
        "--model",
        metavar="URL",
        help="an OpenAI-compatible base URL (vLLM, SGLang, codefleet serve, ...), e.g. http://localhost:8000/v1",
    )
    ev.add_argument(
        "--model-name",
        default="",
        help="with --model: the model to ask for (default: the first one the endpoint lists)",
    )
    ev.add_argument("--tasks", required=True, help="task directory or URL (codefleet tasks generate)")
    ev.add_argument("--attempts", type=int, default=EvalConfig.attempts, help="episodes per task")
    ev.add_argument("--jobs", type=int, default=EvalConfig.jobs, help="tasks at once")
    ev.add_argument("--max-tokens", type=int, default=EvalConfig.max_tokens, help="per turn")
    ev.add_argument("--max-turns", type=int, default=8)
    ev.add_argument(
        "--wall-clock",
        type=float,
        default=1800.0,
        help="seconds per episode (a weak policy's hanging command costs this much)",
    )
    ev.add_argument("--temperature", type=float, default=EvalConfig.temperature, help="0: greedy")
    ev.add_argument(
        "--threads",
        type=int,
        default=EvalConfig.threads,
        help="with --checkpoint: torch threads of the engine that serves it in this process",
    )
    ev.add_argument(
        "--exact-tokens",
        action="store_true",
        help="each turn's prompt extends the exact tokens sampled before, as in RL's rollouts (default: "
        "the conversation rendered again, as a server would)",
    )
    ev.add_argument(
        "--tool-grammar",
        nargs="?",
        const="auto",
        default=None,
        choices=("off", "auto", "required"),
        help="the engine samples only tool calls that parse and fit their schemas (constrained decoding); "
        "'required': and every turn calls a tool (default: what the checkpoint's metadata.json says, "
        "else off)",
    )
    ev.add_argument(
        "--prompt",
        choices=PROMPTS,
        default=None,
        help="what the policy is shown: 'full' the system prompt and tool schemas, 'bare' the task alone "
        "(default: the style the checkpoint's metadata.json says it was trained on, else full; with "
        "--model: full, and codefleet serve renders it in its checkpoint's style)",
    )
    ev.add_argument(
        "--out", default=None, help="also write the trajectories to a rollout store in this directory (or URL)"
    )
    ev.add_argument("--json", action="store_true", help="print only the JSON summary")
    ev.set_defaults(func=_eval)


def _train(args: argparse.Namespace) -> int:
    if not (args.out or args.resume):
        print("codefleet train: give --out RUN_DIR (a new run) or --resume RUN_DIR", file=sys.stderr)
        return 2
    if args.resume and (args.out or args.config):
        print(
            "codefleet train: --resume RUN_DIR continues that run with its own configuration; drop --out and "
            "--config (a resumed run takes KEY=VALUE changes to the fleet's sections, eval.* and rl.steps)",
            file=sys.stderr,
        )
        return 2
    try:
        if args.resume:
            config = resumed_config(args.resume, args.overrides, args.address)
        else:
            config = load_train_config(args.config, args.overrides)
            if args.address:
                config.cluster.address = args.address
    except (ConfigError, ValueError, RunError) as e:
        print(f"codefleet train: {e}", file=sys.stderr)
        return 2
    run_dir = args.resume or args.out
    try:
        summary = train(config, run_dir, resume=bool(args.resume), progress=not args.no_progress)
    except (RunError, LinkRefused) as e:
        print(f"codefleet train: {e}", file=sys.stderr)
        return 2
    except ControllerError as e:  # the RL loop stopped, saying why; the traceback is for a bug report
        run = RunDir(run_dir)
        run.write("error.txt", traceback.format_exc().encode())
        print(f"codefleet train: {e} (traceback: {run.durable('error.txt')})", file=sys.stderr)
        return 1
    print(f"\nheld-out tasks ({summary['run_dir']}/tasks/eval), run wall clock {summary['wall_s']:.0f} s:")
    print(results_table(summary["results"]))
    print(comparison_line(summary["rl_vs_sft"]))
    print(json.dumps(summary["results"], sort_keys=True))
    print(f"sft checkpoint tensor hash {summary['sft_tensor_hash']}")
    print("wall clock per phase: " + ", ".join(f"{phase} {s:.0f} s" for phase, s in summary["phases_s"].items()))
    best = (summary["results"].get("rl") or summary["results"].get("sft") or {}).get("checkpoint")
    if best and not storage.is_url(best):  # a URL: download it first (`codefleet eval --checkpoint URL` reads one)
        print(
            f"\nrun the policy on a repository: codefleet agent run --repo DIR --task TEXT --model local:{best}\n"
            f"or serve it: codefleet serve --checkpoint {best} --port 8000",
            file=sys.stderr,
        )
    return 0


class _Refused(Exception):
    """An input `codefleet eval` cannot use; the message says what to do instead."""


def _eval(args: argparse.Namespace) -> int:
    try:
        _check_eval_flags(args)
        local = _local_inputs(args)
        _check_eval_counts(args)
        tasks = _eval_tasks(args, local)
        on_task = _rollout_recorder(args)
    except _Refused as e:
        print(f"codefleet eval: {e}", file=sys.stderr)
        return 2
    usage = checkpoint.usage(local["--checkpoint"]) if args.checkpoint else dict(checkpoint.USAGE_DEFAULTS)
    episode = EpisodeConfig(
        budgets=Budgets(max_turns=args.max_turns, max_tool_calls=4 * args.max_turns, wall_clock_s=args.wall_clock),
        prompt=args.prompt or usage["prompt"],
    )
    config = EvalConfig(
        attempts=args.attempts,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        jobs=args.jobs,
        threads=args.threads,
        exact_tokens=args.exact_tokens,
    )
    try:
        if args.model:
            report, _ = evaluate_endpoint(
                args.model, tasks, config, args.model_name, episode_config=episode, on_task=on_task
            )
        else:
            report, _ = evaluate(
                args.checkpoint,
                tasks,
                config,
                episode_config=episode,
                on_task=on_task,
                tool_grammar=args.tool_grammar or usage["tool_grammar"],
            )
    except (PolicyError, LinkRefused) as e:
        print(f"codefleet eval: {e}", file=sys.stderr)
        return 2
    if not args.json:
        print(report.table())
    elif warning := report.clock_warning():
        print(f"codefleet eval: {warning}", file=sys.stderr)
    print(report_json(report))
    return 0


def _check_eval_flags(args: argparse.Namespace) -> None:
    """Refuse flags that do not go together."""
    if args.model and not args.model.startswith(("http://", "https://")):
        raise _Refused(
            f"--model {args.model!r} is not a URL; give an OpenAI-compatible base URL such as "
            "http://localhost:8000/v1, or a checkpoint directory with --checkpoint"
        )
    if args.model and args.tool_grammar not in (None, "off"):
        raise _Refused(
            "--tool-grammar constrains codefleet's own engine, used with --checkpoint; an endpoint "
            "constrains its own decoding (`codefleet serve --tool-grammar`)"
        )
    if args.model and args.exact_tokens:
        raise _Refused("--exact-tokens needs codefleet's own engine in process; use it with --checkpoint")


def _check_eval_counts(args: argparse.Namespace) -> None:
    bad = [
        f"{flag} {value}"
        for flag, value, ok in (
            ("--attempts", args.attempts, args.attempts >= 1),
            ("--jobs", args.jobs, args.jobs >= 1),
            ("--threads", args.threads, args.threads >= 1),
            ("--max-turns", args.max_turns, args.max_turns >= 1),
            ("--max-tokens", args.max_tokens, args.max_tokens >= 1),
            ("--wall-clock", args.wall_clock, args.wall_clock > 0),
            ("--temperature", args.temperature, args.temperature >= 0),
        )
        if not ok
    ]
    if bad:
        raise _Refused(
            f"{', '.join(bad)}: counts must be at least 1, --wall-clock above 0 and --temperature at least 0"
        )


def _local_inputs(args: argparse.Namespace) -> dict[str, str | None]:
    """--checkpoint and --tasks as local directories (a URL's copy in this node's download cache), or None."""
    local = {}
    for path, what in ((args.checkpoint, "--checkpoint"), (args.tasks, "--tasks")):
        try:
            local[what] = storage.local_copy(path) if path is not None else None
        except (OSError, ValueError) as e:
            raise _Refused(f"{what} {path!r} cannot be read: {e}") from None
        if path is not None and not os.path.isdir(local[what]):
            raise _Refused(f"{what} {path!r} is not a directory")
    return local


def _eval_tasks(args: argparse.Namespace, local: dict[str, str | None]) -> list:
    """The tasks to evaluate on, once the checkpoint (if one is given) has passed its check."""
    try:
        if args.checkpoint:
            checkpoint.check(local["--checkpoint"])
    except (OSError, ValueError) as e:
        raise _Refused(f"--checkpoint {args.checkpoint} cannot be evaluated: {e}") from None
    try:
        tasks = load_tasks(local["--tasks"])
    except (OSError, ValueError) as e:
        raise _Refused(f"cannot read the tasks in {args.tasks}: {e}") from None
    if not tasks:
        raise _Refused(f"{args.tasks} holds no tasks; make some with `codefleet tasks generate`")
    return tasks


def _rollout_recorder(args: argparse.Namespace):
    """With --out, a function that appends each task's attempts to the rollout store beneath it; else None."""
    if not args.out:
        return None
    try:  # the store beneath --out, no link below it followed: a planted one is refused before the evaluation
        writer = RolloutWriter(storage.join(args.out, "rollouts"), beneath=args.out)
    except OSError as e:
        raise _Refused(f"cannot write the rollout store in {args.out}: {e}") from None
    run_name = storage.basename(storage.absolute(args.checkpoint)) if args.checkpoint else args.model_name or "model"

    def on_task(task, trajectories):
        writer.append(
            [
                rollout_record(t, run=run_name, step=0, group=0, attempt=i, split="eval")
                for i, t in enumerate(trajectories)
            ]
        )

    return on_task
