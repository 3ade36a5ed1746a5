"""The configuration of a training run (`codefleet train`), composed of the components' own configs.

A component's settings are declared once, next to the component, with one default: the controller's
(`controller`: `fleet.controller_api.ControllerConfig`), the evaluation's (`eval`: `recipe.eval_config.EvalConfig`),
the sandboxes' (`sandbox`: `SandboxConfig`), the loss's, the reward's and the copy head's (`rl.loss`, `rl.reward`,
`model.copy`), and the fleet's actors' (`cluster`, `engine`, `trainer`, `weight_sync`, `rollouts`, `placement`:
`fleet.fleet_config`). The sections declared here hold what only the recipe has: its tasks, its model, its SFT
and RL stages. `tests/test_config_composed.py` fails when two config classes of a run declare the same
setting. A run's settings are layered, each layer over the one before:

1. the field defaults: each component's behaviour with no recipe tricks;
2. the recipe file `recipe` names (`codefleet/recipe/configs/NAME.yaml`, or a path): the tricks that
   make a particular policy train well, e.g. `demo`, the tiny policy of `make demo`;
3. `--config FILE`, then `key.sub=value` overrides from the command line.

Every field, its default and its meaning: docs/configuration.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from codefleet.agent.episode import EpisodeConfig
from codefleet.agent.reward import RewardConfig
from codefleet.agent.tools import ToolConfig
from codefleet.config import ConfigError, from_dict, read_config
from codefleet.fleet.controller_api import ControllerConfig
from codefleet.fleet.fleet_config import (
    EngineConfig,
    PlacementConfig,
    RayClusterConfig,
    RolloutWorkersConfig,
    TrainerWorkersConfig,
    WeightSyncConfig,
)
from codefleet.model.copy_config import CopyConfig
from codefleet.recipe.eval_config import EvalConfig
from codefleet.rl.loss_config import LossConfig
from codefleet.sandbox.base import SandboxConfig
from codefleet.types import Budgets

RECIPES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


@dataclass
class TasksSection:
    n_train: int = 80  # generated training tasks, each demonstrated by the scripted expert
    n_eval: int = 20  # generated held-out tasks, from templates training never uses (split "test")
    seed: int = 0  # the task generator's seed
    # the task families to draw from (codefleet.tasks.families)
    families: list[str] = field(default_factory=lambda: ["bugfix", "stub", "rename", "config", "multifile"])
    difficulty: int | None = 1  # 1-3: files, size and distractors per task; null draws it per task
    # which tasks RL attempts: "train", the demonstrated ones; "fresh", n_train new instances of the training
    # templates (seed `seed + 1`) that SFT never showed, so a group succeeds only through what carries over to
    # new code, as on the held-out tasks. With tasks.train_dir RL attempts your tasks either way
    rl_tasks: str = "fresh"
    # your own tasks instead of generated ones: a directory of task specs (`codefleet tasks generate`,
    # `codefleet tasks import-swebench` or your own task.json files; docs/tasks.md). All of its tasks are used and
    # n_train is ignored. The scripted expert demonstrates the tasks that have a reference patch; RL attempts all
    train_dir: str = ""
    eval_dir: str = ""  # your own held-out tasks instead of generated ones (n_eval is then ignored)


@dataclass
class ModelSection:
    size: str = "tiny"  # the ModelConfig preset of a fresh model: "tiny" | "small" | "medium"
    # start from this checkpoint instead of a fresh `size` model: a Hugging Face model directory (Qwen3,
    # Qwen3-MoE, Llama; docs/models/hugging-face.md) or a codefleet checkpoint. Its tokenizer and chat template
    # are used, and `size`, `seed`'s initialisation and `copy` are ignored
    init: str = ""
    max_seq_len: int = 4096  # context per episode, prompt and every turn
    seed: int = 0  # initialisation and SFT's data order
    # "bare": the policy sees the task alone and learns the tools from the demonstrations (a policy trained on
    # this harness from scratch); "full": the system prompt and tool schemas, what the product sends any model
    prompt: str = "bare"
    # copying names from the context: previous-token embeddings and the pointer-generator head
    # (docs/models/codefleet-moe.md)
    copy: CopyConfig = field(default_factory=CopyConfig)
    # "auto": the engine samples only tool calls that parse and fit the tools' schemas (inference.grammar), in RL's
    # rollouts and the evaluations; "required": and every turn calls a tool; "off": the tokens as drawn
    tool_grammar: str = "off"


@dataclass
class SFTSection:
    epochs: int = 30  # passes over the demonstrations
    batch_size: int = 4  # demonstrations per optimizer step
    lr: float = 2e-3  # peak; linear warm-up, then cosine decay to 10% over the run
    warmup_steps: int = 5  # optimizer steps of linear learning-rate warm-up
    # the share of demonstrations whose expert explores the repository before acting where the task names the
    # files: a habit RL can later choose against
    explore_fraction: float = 1.0
    chain_fraction: float = 0.0  # the share of renames whose expert runs the tests in the same command
    fresh_names: bool = False  # each time SFT shows a demonstration, its names are new (recipe.augment)
    first_turns: int = 0  # per step, also this many first turns of demonstrations with new names (fresh_names)
    workers: int = 1  # SFT's data-parallel trainer workers (RL's: trainer.workers)
    threads: int = 2  # torch threads per SFT worker (on a cluster: the cores per worker)


@dataclass
class RLSection:
    steps: int = 24  # optimizer steps of RL
    lr: float = 3e-4  # RL's learning rate (constant)
    estimator: str = "grpo"  # the advantage estimator: "grpo" | "drgrpo" | "rloo"
    negative_weight: float = 1.0  # scales negative advantages (0: learn only from attempts that beat their group)
    # which task next: "uniform" takes every task once per pass; "learnable" favours task families where a group
    # is likely to both succeed and fail (recipe.curriculum)
    task_sampling: str = "uniform"
    task_sampling_floor: float = 0.1  # with "learnable": every family keeps at least this sampling weight
    temperature: float = 1.0  # sampling temperature of RL's rollouts
    max_tokens: int = 256  # per turn
    max_turns: int = 6  # per episode
    # the policy loss: off-policy correction, reduction, KL anchor to the SFT policy (rl.losses)
    loss: LossConfig = field(default_factory=LossConfig)
    # the episode's reward: hidden checks minus costs (agent.reward)
    reward: RewardConfig = field(default_factory=RewardConfig)
    # Kimi k1.5's length reward on turns: among a group's solved attempts the one with the fewest turns gets
    # +speed_bonus/2, the one with the most -speed_bonus/2 (rl.rewards.speed_bonus); 0 = off
    speed_bonus: float = 0.0
    routing_replay: bool = True  # train MoE layers on the experts the engine routed each token to (R3)


@dataclass
class TrainRunConfig:
    name: str = "demo"  # the run's name in the rollout store and the evaluations
    # the recipe file whose settings lie beneath --config and overrides: a name in codefleet/recipe/configs/ or a
    # path to a YAML file; "" = the defaults alone
    recipe: str = "demo"
    tasks: TasksSection = field(default_factory=TasksSection)
    model: ModelSection = field(default_factory=ModelSection)
    sft: SFTSection = field(default_factory=SFTSection)
    rl: RLSection = field(default_factory=RLSection)
    # RL's asynchronous controller: attempts at once, groups, staleness bound, timeouts and retries
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    # the evaluations of the SFT and RL checkpoints on the held-out tasks (the tool grammar: model.tool_grammar)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cluster: RayClusterConfig = field(default_factory=RayClusterConfig)  # the Ray cluster the run starts or joins
    engine: EngineConfig = field(default_factory=EngineConfig)  # RL's inference engines
    trainer: TrainerWorkersConfig = field(default_factory=TrainerWorkersConfig)  # the trainer workers
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)  # RL's weights to the engines
    rollouts: RolloutWorkersConfig = field(default_factory=RolloutWorkersConfig)  # the agent harness's workers
    placement: PlacementConfig = field(default_factory=PlacementConfig)  # engines and trainer workers on the nodes
    # the sandboxes of the demonstrations, RL's attempts and the evaluations
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def recipe_path(recipe: str) -> str:
    """The YAML file `recipe` names: a file in RECIPES_DIR by name, else a path."""
    named = os.path.join(RECIPES_DIR, f"{recipe}.yaml")
    if os.path.isfile(named):
        return named
    if os.path.isfile(recipe):
        return recipe
    known = sorted(name.removesuffix(".yaml") for name in os.listdir(RECIPES_DIR) if name.endswith(".yaml"))
    raise ConfigError(f"recipe {recipe!r} is neither a recipe ({', '.join(known)}) nor a YAML file")


# settings that moved to the component that owns them: {old dotted name: new}
MOVED = {
    **{
        f"rl.{name}": f"controller.{name}"
        for name in ("eta", "group_size", "batch_groups", "rollout_slots", "rollout_timeout_s", "drop_zero_variance")
    },
    # the fleet's actors, once one `cluster` section, each in its component's own (fleet.fleet_config)
    "cluster.engines": "engine.count",
    "cluster.engine_backend": "engine.backend",
    "cluster.engine_threads": "engine.threads",
    "cluster.engine_gpus": "engine.gpus",
    "cluster.engine_wait_s": "engine.wait_s",
    "cluster.engine_resources": "engine.resources",
    "cluster.trainer_workers": "trainer.workers",
    "cluster.trainer_cpus": "trainer.cpus",
    "cluster.trainer_backend": "trainer.backend",
    "cluster.trainer_gpus": "trainer.gpus",
    "cluster.trainer_resources": "trainer.resources",
    "cluster.weight_sync": "weight_sync.method",
    "cluster.weight_sync_bucket_mb": "weight_sync.bucket_mb",
    "cluster.rollout_workers": "rollouts.workers",
    "cluster.rollout_cpus": "rollouts.cpus",
    "cluster.rollout_resources": "rollouts.resources",
    "cluster.placement": "placement.layout",
    "cluster.placement_wait_s": "placement.wait_s",
}


def refuse_moved(data: dict, source: str) -> None:
    """Refuse a key of `data` (read from `source`) that names a setting by its old place, saying the new one."""
    for old, new in MOVED.items():
        section, _, name = old.partition(".")
        if isinstance(data.get(section), dict) and name in data[section]:
            raise ConfigError(f"{old} is now {new}; rename it in {source}")


def load_train_config(path: str | None = None, overrides: list[str] | None = None) -> TrainRunConfig:
    """A run's configuration: the defaults, the recipe it names (default `demo`), the file at `path`, then
    the `key.sub=value` overrides, each over the one before."""
    data = read_config(path, overrides)
    refuse_moved(data, f"{path} or the command line" if path else "the command line")
    recipe = data.get("recipe", TrainRunConfig.recipe)
    if not isinstance(recipe, str):
        raise ConfigError(f"recipe: expected a recipe name or a path, got {recipe!r}")
    base = TrainRunConfig()
    if recipe:
        recipe_data = read_config(recipe_path(recipe))
        if "recipe" in recipe_data:
            raise ConfigError(f"recipe {recipe!r} names another recipe; a recipe file holds settings only")
        refuse_moved(recipe_data, f"the recipe {recipe_path(recipe)}")
        base = from_dict(TrainRunConfig, recipe_data, base=base)
    return from_dict(TrainRunConfig, data, base=base)


def policy_usage(config: TrainRunConfig) -> dict[str, str]:
    """How this run's policy checkpoints are meant to be used, written into each of them (checkpoint.usage)."""
    return {"prompt": config.model.prompt, "tool_grammar": config.model.tool_grammar, "run": config.name}


def episode_config(config: TrainRunConfig) -> EpisodeConfig:
    """The agent harness's settings for RL's rollouts, the demonstrations and the evaluations."""
    return EpisodeConfig(
        budgets=Budgets(
            max_turns=config.rl.max_turns,
            max_tool_calls=4 * config.rl.max_turns,
            wall_clock_s=config.controller.rollout_timeout_s / 2,
        ),
        tools=ToolConfig(max_output_chars=4000),
        reward=config.rl.reward,
        prompt=config.model.prompt,
    )
