"""A training run's configuration, checked before the run starts: `check_config` refuses a field that would fail
later (after minutes of demonstrations and SFT) and names the field to change; `resumed_config` reads the
configuration a run directory holds, taking only the changes a resumed run may make."""

from __future__ import annotations

import os

from codefleet.agent.clients.local_engine import TOOL_GRAMMARS
from codefleet.chat.codefleet_template import PROMPTS
from codefleet.config import ConfigError, load_config, read_config
from codefleet.contracts import ENGINES, TRAINERS
from codefleet.fleet.fleet_config import PLACEMENTS, WEIGHT_SYNCS
from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.recipe.config import TrainRunConfig, refuse_moved
from codefleet.recipe.curriculum import MODES as SAMPLING_MODES
from codefleet.recipe.run_dir import RunDir, RunError
from codefleet.rl.advantages import ESTIMATORS
from codefleet.store import storage
from codefleet.tasks.families import FAMILIES


def check_config(config: TrainRunConfig) -> None:
    """Refuse a configuration that would fail later (after minutes of SFT), with the field to change."""

    problems = [
        *_learning_problems(config),
        *_cluster_problems(config),
        *_stage_problems(config),
        *_resource_problems(config),
    ]
    if config.model.init:  # its files checked now, not after the demonstrations
        try:
            checkpoint.check(storage.local_copy(config.model.init))  # a URL: this node's copy
        except (OSError, ValueError) as e:
            problems.append((False, f"model.init: {e}"))
    bad = [message for ok, message in problems if not ok]
    if bad:
        raise RunError("invalid configuration: " + "; ".join(bad))


# Each step below gives (ok, what to change) pairs; check_config reports the failing ones in this order.


def _learning_problems(config: TrainRunConfig) -> list[tuple[bool, str]]:
    """What is learnt and how: the task sets, the model's size, the RL objective and the controller's schedule."""
    t, r, ctl = config.tasks, config.rl, config.controller
    return [
        (t.n_train >= 1 and t.n_eval >= 1, "tasks.n_train and tasks.n_eval must be >= 1"),
        (t.rl_tasks in ("train", "fresh"), f"tasks.rl_tasks must be train or fresh, got {t.rl_tasks!r}"),
        (not set(t.families) - set(FAMILIES), f"tasks.families must be among {', '.join(sorted(FAMILIES))}"),
        (
            config.model.size in ("tiny", "small", "medium") and hasattr(ModelConfig, config.model.size),
            "model.size must be tiny, small or medium",
        ),
        (r.estimator in ESTIMATORS, f"rl.estimator must be one of {', '.join(ESTIMATORS)}"),
        (ctl.group_size >= 2, "controller.group_size must be >= 2: group-relative advantages need two attempts"),
        (0 <= r.negative_weight <= 1, "rl.negative_weight must be in [0, 1]"),
        (r.speed_bonus >= 0, "rl.speed_bonus must be >= 0 (0 turns it off)"),
        (
            ctl.rollout_slots >= ctl.group_size,
            "controller.rollout_slots must hold at least one group (>= controller.group_size)",
        ),
        (
            r.steps >= 0 and ctl.eta >= 0 and ctl.batch_groups >= 1,
            "rl.steps, controller.eta >= 0 and controller.batch_groups >= 1",
        ),
    ]


def _cluster_problems(config: TrainRunConfig) -> list[tuple[bool, str]]:
    """How the RL stage is laid out on the cluster: backends, weight sync, actor counts, placement."""
    return [
        (config.engine.backend in ENGINES, f"engine.backend must be one of {', '.join(ENGINES.names())}"),
        (config.trainer.backend in TRAINERS, f"trainer.backend must be one of {', '.join(TRAINERS.names())}"),
        (
            config.weight_sync.method in WEIGHT_SYNCS and config.weight_sync.bucket_mb >= 1,
            "weight_sync.method must be whole, buckets or collective, and weight_sync.bucket_mb >= 1",
        ),
        (
            config.trainer.workers >= 1 and config.engine.count >= 1 and config.rollouts.workers >= 1,
            "trainer.workers, engine.count and rollouts.workers must be >= 1",
        ),
        (config.placement.layout in PLACEMENTS, f"placement.layout must be one of {', '.join(PLACEMENTS)}"),
        (
            config.placement.layout != "colocated" or config.engine.count == config.trainer.workers,
            "placement.layout=colocated pairs each engine with a trainer worker: set engine.count equal to "
            "trainer.workers",
        ),
    ]


def _stage_problems(config: TrainRunConfig) -> list[tuple[bool, str]]:
    """The settings of the SFT and RL stages and of the evaluation."""
    t, r = config.tasks, config.rl
    return [
        (config.sft.epochs >= 1 and config.sft.batch_size >= 1, "sft.epochs and sft.batch_size must be >= 1"),
        (config.sft.workers >= 1 and config.sft.threads >= 1, "sft.workers and sft.threads must be >= 1"),
        (
            0 <= config.sft.explore_fraction <= 1 and 0 <= config.sft.chain_fraction <= 1,
            "sft.explore_fraction and sft.chain_fraction must be in [0, 1]",
        ),
        (config.model.prompt in PROMPTS, f"model.prompt must be one of {', '.join(PROMPTS)}"),
        (config.model.tool_grammar in TOOL_GRAMMARS, "model.tool_grammar must be off, auto or required"),
        (r.task_sampling in SAMPLING_MODES, f"rl.task_sampling must be one of {', '.join(SAMPLING_MODES)}"),
        (r.task_sampling_floor >= 0, "rl.task_sampling_floor must be >= 0"),
        (t.difficulty in (None, 1, 2, 3), "tasks.difficulty must be 1, 2, 3 or null (drawn per task)"),
        (r.lr > 0 and config.sft.lr > 0, "rl.lr and sft.lr must be > 0"),
        (r.temperature >= 0 and config.eval.temperature >= 0, "rl.temperature and eval.temperature must be >= 0"),
        (
            min(r.max_tokens, r.max_turns, config.eval.max_tokens, config.eval.attempts, config.eval.jobs) >= 1,
            "rl.max_tokens, rl.max_turns, eval.max_tokens, eval.attempts and eval.jobs must be >= 1",
        ),
    ]


def _resource_problems(config: TrainRunConfig) -> list[tuple[bool, str]]:
    """What the machines and files must allow: the engines' start-up wait, GPUs per actor, the context, the
    task directories."""
    t = config.tasks
    return [
        (config.engine.wait_s > 0, "engine.wait_s must be > 0"),
        (
            0 <= config.engine.gpus <= 1 and 0 <= config.trainer.gpus <= 1,
            "engine.gpus and trainer.gpus must be in [0, 1]: one actor uses one GPU at most",
        ),
        (
            config.engine.gpus == 0 or config.engine.backend not in ENGINES or ENGINES.get(config.engine.backend).gpu,
            f"engine.gpus > 0 needs engine.backend=vllm (an engine that runs on a GPU): the "
            f"{config.engine.backend} engine runs on CPU only",
        ),
        (
            config.trainer.gpus in (0, 1) or max(config.trainer.workers, config.sft.workers) == 1,
            "trainer.gpus below 1 lets trainer workers share a GPU, which NCCL refuses: use 1 with several "
            "workers (trainer.workers, sft.workers)",
        ),
        (config.model.max_seq_len >= 256, "model.max_seq_len must be >= 256 (a task and one turn)"),
        (not t.train_dir or os.path.isdir(t.train_dir), f"tasks.train_dir {t.train_dir!r} is not a directory"),
        (not t.eval_dir or os.path.isdir(t.eval_dir), f"tasks.eval_dir {t.eval_dir!r} is not a directory"),
    ]


# what a resumed run may change: where it runs, how long RL goes on, how it is evaluated. The rest shaped the
# tasks, demonstrations and checkpoints the run already holds.
RESUMABLE = ("cluster.", "engine.", "trainer.", "weight_sync.", "rollouts.", "placement.", "eval.", "rl.steps")
RESUMABLE_TEXT = (
    "the fleet's sections (cluster, engine, trainer, weight_sync, rollouts, placement), eval.* and rl.steps"
)


def nothing_to_resume(out: str) -> RunError:
    """The error for `--resume out` where no run was started."""
    return RunError(f"{out} has no config.yaml: nothing to resume; start a run with --out {out}")


def resumed_config(out: str, overrides: list[str] | None = None, address: str | None = None) -> TrainRunConfig:
    """The configuration saved in the run `out`, with the `key=value` changes a resumed run may take."""

    run = RunDir(out)
    if not run.exists("config.yaml"):
        raise nothing_to_resume(out)
    run.check_format()
    run.fetch("config.yaml")  # a URL run: read here
    saved = run.path("config.yaml")
    for item in overrides or []:
        key = item.partition("=")[0].strip()
        if not any(key == p or key.startswith(p) for p in RESUMABLE):
            raise RunError(
                f"{key} cannot change when a run resumes (it shaped what the run already holds); a "
                f"resumed run takes changes to {RESUMABLE_TEXT} only; start a new run with --out"
            )
    try:
        refuse_moved(read_config(saved), saved)  # a run saved before a setting moved: say where it went
        config = load_config(TrainRunConfig, saved, overrides)
    except ConfigError as e:
        raise RunError(
            f"{saved} cannot be read as this run's configuration with the changes given ({e}); fix "
            f"that file or the change, or start a new run with --out"
        ) from None
    if address:
        config.cluster.address = address
    return config
