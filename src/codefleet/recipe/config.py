"""The configuration of a training run (`codefleet train`), one typed section per stage.

Defaults are the tiny embedded run of `make demo`: 2 CPU cores, a ~11M
parameter MoE policy trained from scratch, generated tasks. Every field can
be set from a YAML file (`--config`) or the command line (`rl.steps=20`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from codefleet.agent.episode import EpisodeConfig
from codefleet.agent.reward import RewardConfig
from codefleet.agent.tools import ToolConfig
from codefleet.rl.losses import LossConfig
from codefleet.sandbox.base import SandboxConfig
from codefleet.types import Budgets


@dataclass
class TasksSection:
    n_train: int = 80
    n_eval: int = 20  # held-out templates (split "test")
    seed: int = 0
    families: list[str] = field(default_factory=lambda: ["bugfix", "stub", "rename", "config", "multifile"])
    difficulty: int | None = 1  # 1-3; None draws per task
    # the six training domains of tasks/families/more_domains.py besides the five of domains.py: with them the
    # tiny policy solved 0 of 80 held-out episodes after SFT in 2 of 2 runs, without them 5.0% (2026-12-04)
    more_domains: bool = False
    # tasks only RL attempts (no demonstration, seed `seed + 1`), from the training templates of all eleven
    # domains: RL practises on code SFT never showed, as the held-out tasks are
    n_rl_extra: int = 0
    # which tasks RL attempts: "train", the demonstrated ones, whose instances SFT has learnt by heart; "fresh",
    # n_train new instances of the training templates (seed `seed + 1`, the same families and domains) that SFT
    # never showed, so a group succeeds only through what carries over to new code, as on the held-out tasks.
    # With tasks.train_dir RL attempts your tasks either way
    rl_tasks: str = "fresh"
    # your own tasks instead of generated ones: directories of task specs (`codefleet tasks generate`, `tasks
    # import` of SWE-bench-style instances, or your own task.json files; docs/tasks.md). All of a directory's
    # tasks are used and n_train / n_eval are ignored for it. The scripted expert demonstrates the training tasks
    # that have a reference patch; RL attempts them all.
    train_dir: str = ""
    eval_dir: str = ""


@dataclass
class ModelSection:
    size: str = "tiny"  # "tiny" | "small" | "medium" (ModelConfig presets)
    max_seq_len: int = 4096
    seed: int = 0
    # "bare": the policy sees the task alone and learns the tools from the demonstrations (it is trained on this
    # harness from scratch); "full": system prompt and tool schemas, what the product sends any model (agent.prompts)
    prompt: str = "bare"
    # the pointer-generator output (CopyConfig.head): names from the task are copied, not memorised
    copy_head: bool = True
    # "prompt": the copy head points only at the tokens before the current turn (no loops over its own output)
    copy_scope: str = "prompt"
    # the copy head also scores where the tokens before a context position match the last ones written
    copy_match: bool = True
    # the copy head never points at tokens holding quotes, backticks, brackets, commas or colons
    # (CopyConfig.blocked): a copied name ends where the LM head says, not where the context did
    copy_words_only: bool = False
    # "auto": the engine samples only tool calls that parse and fit the tools' schemas (model.grammar), in RL's
    # rollouts and in the evaluations; "required": and every turn calls a tool (a turn without one ends the
    # episode); "off": the model's tokens as drawn. A 600-step SFT checkpoint, 640 held-out episodes: tool errors
    # per episode 3.16 off, 1.32 required; success 12.2% and 11.4%; turns per solved task 3.24 and 2.97. Not the
    # default: the grammar runs in the engine's Python loop, and at the demo's 80 evaluation episodes at once on
    # 2 cores 25-29% of them ran out of their 60 s (2026-12-05)
    tool_grammar: str = "off"


@dataclass
class SFTSection:
    # 600 steps: 11.2-13.8% held-out success in seven evaluations, against 1.2-3.8% after 400 with sft.habits=epoch
    # (2026-12-06); held-out greedy 10% vs 0% at 220 steps against 400 (2026-12-03)
    epochs: int = 30
    batch_size: int = 4  # demonstrations per optimizer step
    lr: float = 2e-3  # peak; linear warm-up, then cosine decay to 10% over the run
    warmup_steps: int = 5
    # habits RL can choose between (rl.demos): the share of demonstrations whose expert explores before
    # acting (where the task names the files), and of renames that run the tests in the same command
    explore_fraction: float = 0.5
    chain_fraction: float = 0.5
    # "task": one habit per task, drawn once, which the policy learns by heart (P(explore) 0.00-0.99 per held-out
    # task, experiments/probes/habit_probe.py); "epoch": the expert records every habit of each task and SFT draws one anew
    # each time it shows the task, so the habit is a coin (0.53-0.78) RL can weigh: RL on fresh tasks then moved the
    # held-out renames to acting at once and chaining their tests (docs/experiments/, "Fresh tasks for RL")
    habits: str = "epoch"
    fresh_names: bool = True  # every epoch shows each demonstration with new names (rl.augment)
    first_turns: int = 8  # per step, also this many first turns of demonstrations with new names (fresh_names only)
    # SFT has the machine to itself: on 2 cores one worker with 2 threads steps in ~1.8 s, two data-parallel
    # workers with 1 thread each in ~2.4 s (the optimizer step twice, the gradient all-reduce, waits; 2026-12-04).
    # On a cluster set workers = cluster.trainer_workers and threads = the cores per worker.
    workers: int = 1
    threads: int = 2


@dataclass
class RLSection:
    steps: int = 24
    # with negative_weight=0 and tasks.rl_tasks=fresh: 6e-4 mis-copied the held-out renames' names (13.8% -> 8.1%),
    # 3e-4 kept them (docs/experiments/, "Fresh tasks for RL"). With every advantage in, 2e-4 already broke calls (2026-12-04)
    lr: float = 3e-4
    # start from SFT's AdamW moments, not a fresh AdamW (whose first steps move every weight by ~lr)
    keep_sft_optimizer: bool = True
    eta: int = 1  # staleness bound (0 = synchronous)
    group_size: int = 4
    batch_groups: int = 4
    rollout_slots: int = 16
    rollout_timeout_s: float = 120.0
    estimator: str = "grpo"  # "grpo" | "drgrpo" | "rloo"
    # scales negative advantages (0: learn only from attempts that beat their group). At rl.lr=6e-4 after a 600-step
    # SFT, 0 kept held-out success (12.2% -> 13.4%) and cut turns per solved task by 29%, where 1 broke the policy
    # (12.2% -> 3.0%; configs/fast-habits.yaml, 2026-12-06). At 3e-4 on fresh tasks, 0 cut held-out turns per solved
    # task in one run of three (-30%; -7%, -4%), 0.5 (failures pushed down at half their weight) in two of two (-32%,
    # -13%) with success up 1.9 and 3.1 points (docs/experiments/, "Fresh tasks for RL")
    negative_weight: float = 0.5
    # an attempt that beat its group is not trained on its turns whose tool calls failed (a malformed call, an
    # unknown tool or argument, a missing file), so learning from the winners does not raise the broken turns a
    # solved episode passed through. Off: after the demo's SFT solved training episodes hold few (5 of 204 turns;
    # 83 of 754 after a 600-step SFT), and one run with it is no evidence either way (2026-12-06, stop 30)
    skip_error_turns: bool = False
    drop_zero_variance: bool = False
    # which task next: "learnable" favours task families where a group is likely to both succeed and fail
    # (rl.curriculum), "uniform" takes every task once per pass
    task_sampling: str = "learnable"
    task_sampling_floor: float = 0.1  # every family keeps at least this sampling weight
    temperature: float = 1.0
    max_tokens: int = 256  # per turn
    max_turns: int = 6
    # one weight per episode however long (seq_mean), and a KL anchor to the SFT policy
    loss: LossConfig = field(default_factory=lambda: LossConfig(off_policy="tis", reduction="seq_mean", kl_coef=0.05))
    # costs only on solved episodes: with costs on failures too, the policy learnt to end every episode at once
    reward: RewardConfig = field(default_factory=lambda: RewardConfig(cost_per_turn=0.02, cost_per_tool_error=0.02,
                                                                      costs_on="solved"))
    # Kimi k1.5's length reward on turns (rl.rewards.speed_bonus): among a group's solved attempts the one with
    # the fewest turns gets +speed_bonus/2, the one with the most -speed_bonus/2; 0 = off
    speed_bonus: float = 1.0
    routing_replay: bool = True


@dataclass
class EvalSection:
    # 160 episodes on the 20 held-out tasks (one moves the rate by 0.6 points; ~2 min per checkpoint on 2 cores):
    # at 80, the same checkpoint measured 10.0% and 13.75% (2026-12-03)
    attempts: int = 8
    temperature: float = 1.0  # the policy RL trains samples at rl.temperature; 0 = greedy
    max_tokens: int = 256
    jobs: int = 10


@dataclass
class ClusterSection:
    address: str = ""  # "" = RAY_ADDRESS or a local Ray started here
    num_cpus: float = 4.0  # logical CPUs of the local Ray (never the physical count)
    sandbox_slots: int = 64
    engines: int = 1
    engine_threads: int = 2
    # how long a weight broadcast waits for an engine that does not answer (restarting, or its node gone with no
    # room elsewhere) before the run goes on without it; it loads the newest checkpoint itself when it is back
    engine_wait_s: float = 300.0
    trainer_workers: int = 2
    trainer_cpus: float = 0.5  # logical CPUs per trainer worker
    rollout_workers: int = 2
    rollout_cpus: float = 0.25  # logical CPUs per rollout worker
    # extra logical resources per actor, to pin roles to nodes on a cluster, e.g. {"rollout": 1}
    rollout_resources: dict[str, float] = field(default_factory=dict)
    engine_resources: dict[str, float] = field(default_factory=dict)
    trainer_resources: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainRunConfig:
    name: str = "demo"
    tasks: TasksSection = field(default_factory=TasksSection)
    model: ModelSection = field(default_factory=ModelSection)
    sft: SFTSection = field(default_factory=SFTSection)
    rl: RLSection = field(default_factory=RLSection)
    eval: EvalSection = field(default_factory=EvalSection)
    cluster: ClusterSection = field(default_factory=ClusterSection)
    sandbox: SandboxConfig = field(default_factory=lambda: SandboxConfig(timeout_s=30.0, memory_mb=1024))


def policy_usage(config: TrainRunConfig) -> dict[str, str]:
    """How this run's policy checkpoints are meant to be used, written into each of them (checkpoint.usage)."""
    return {"prompt": config.model.prompt, "tool_grammar": config.model.tool_grammar}


def episode_config(config: TrainRunConfig):
    """The agent harness's settings for RL's rollouts, the demonstrations and the evaluations."""

    return EpisodeConfig(budgets=Budgets(max_turns=config.rl.max_turns, max_tool_calls=4 * config.rl.max_turns,
                                         wall_clock_s=config.rl.rollout_timeout_s / 2),
                         tools=ToolConfig(max_output_chars=4000), reward=config.rl.reward, prompt=config.model.prompt)
