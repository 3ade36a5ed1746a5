"""A training run's configuration, checked before the run starts: `check_config` refuses a field that would fail
later (after minutes of demonstrations and SFT) and names the field to change; `resumed_config` reads the
configuration a run directory holds, taking only the changes a resumed run may make."""

from __future__ import annotations

import os

from codefleet.agent.clients.local_engine import TOOL_GRAMMARS
from codefleet.chat.codefleet_template import PROMPTS
from codefleet.config import ConfigError, load_config
from codefleet.contracts import ENGINES, TRAINERS
from codefleet.fleet.placement import PLACEMENTS
from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.recipe.config import TrainRunConfig
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
    cl = config.cluster
    return [
        (cl.engine_backend in ENGINES, f"cluster.engine_backend must be one of {', '.join(ENGINES.names())}"),
        (cl.trainer_backend in TRAINERS, f"cluster.trainer_backend must be one of {', '.join(TRAINERS.names())}"),
        (
            cl.weight_sync in ("whole", "buckets", "collective") and cl.weight_sync_bucket_mb >= 1,
            "cluster.weight_sync must be whole, buckets or collective, and cluster.weight_sync_bucket_mb >= 1",
        ),
        (
            cl.trainer_workers >= 1 and cl.engines >= 1 and cl.rollout_workers >= 1,
            "cluster.trainer_workers, cluster.engines and cluster.rollout_workers must be >= 1",
        ),
        (cl.placement in PLACEMENTS, f"cluster.placement must be one of {', '.join(PLACEMENTS)}"),
        (
            cl.placement != "colocated" or cl.engines == cl.trainer_workers,
            "cluster.placement=colocated pairs each engine with a trainer worker: set cluster.engines equal to "
            "cluster.trainer_workers",
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
    t, cl = config.tasks, config.cluster
    return [
        (config.cluster.engine_wait_s > 0, "cluster.engine_wait_s must be > 0"),
        (
            0 <= cl.engine_gpus <= 1 and 0 <= cl.trainer_gpus <= 1,
            "cluster.engine_gpus and cluster.trainer_gpus must be in [0, 1]: one actor uses one GPU at most",
        ),
        (
            cl.engine_gpus == 0 or cl.engine_backend not in ENGINES or ENGINES.get(cl.engine_backend).gpu,
            f"cluster.engine_gpus > 0 needs cluster.engine_backend=vllm (an engine that runs on a GPU): the "
            f"{cl.engine_backend} engine runs on CPU only",
        ),
        (
            cl.trainer_gpus in (0, 1) or max(cl.trainer_workers, config.sft.workers) == 1,
            "cluster.trainer_gpus below 1 lets trainer workers share a GPU, which NCCL refuses: use 1 with several "
            "workers (cluster.trainer_workers, sft.workers)",
        ),
        (config.model.max_seq_len >= 256, "model.max_seq_len must be >= 256 (a task and one turn)"),
        (not t.train_dir or os.path.isdir(t.train_dir), f"tasks.train_dir {t.train_dir!r} is not a directory"),
        (not t.eval_dir or os.path.isdir(t.eval_dir), f"tasks.eval_dir {t.eval_dir!r} is not a directory"),
    ]


# what a resumed run may change: where it runs, how long RL goes on, how it is evaluated. The rest shaped the
# tasks, demonstrations and checkpoints the run already holds.
RESUMABLE = ("cluster.", "eval.", "rl.steps")
RESUMABLE_TEXT = "cluster.*, eval.* and rl.steps"


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
        config = load_config(TrainRunConfig, saved, overrides)
    except ConfigError as e:
        raise RunError(
            f"{saved} cannot be read as this run's configuration with the changes given ({e}); fix "
            f"that file or the change, or start a new run with --out"
        ) from None
    if address:
        config.cluster.address = address
    return config
