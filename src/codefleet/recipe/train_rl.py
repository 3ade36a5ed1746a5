"""The RL stage of `codefleet train` (recipe/train.py): the trainer the controller drives, the task stream,
and the wiring of engines, rollout workers, sandboxes and trainer workers for one run.

Checkpoints are named by `RunDir.checkpoint` / `rl_checkpoint`: a URL when the run directory is one. They
cross to the actors as they are (TrainerGroup, engines, rollout workers), each of which reads its own
`storage.local_copy`; the driver does the same where it reads one (`_rl_start`, the tokenizer of RLTrainer)
and edits a written one through `describe`."""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch
from tqdm import tqdm

from codefleet.agent.reward import solved
from codefleet.chat import formats
from codefleet.chat.tokenizer import TOKENIZER_FILE, Tokenizer, default_tokenizer
from codefleet.fleet.controller import Controller
from codefleet.fleet.gpus import check_gpus
from codefleet.fleet.inference import start_engines
from codefleet.fleet.placement import Placement, Role
from codefleet.fleet.policy_actors import PolicyActors
from codefleet.fleet.rollouts import AgentGroupRunner, RolloutSpec, start_workers, stop_workers
from codefleet.fleet.sandbox_fleet import SandboxFleet
from codefleet.fleet.staleness import Group
from codefleet.fleet.trainer_group import TrainerGroup
from codefleet.model import checkpoint
from codefleet.recipe.config import TrainRunConfig, episode_config, policy_usage
from codefleet.recipe.curriculum import TaskSampler
from codefleet.recipe.run_dir import Metrics, RunDir, RunError, log
from codefleet.rl.advantages import compute_advantages, weigh_negatives
from codefleet.rl.batch import Sample
from codefleet.rl.rewards import speed_bonus
from codefleet.rl.trainer import TRAINER_FILE, TrainConfig
from codefleet.store import storage
from codefleet.store.parquet import RolloutWriter, rollout_record

ENGINE_CPUS = 1.0  # logical CPUs per engine actor (its threads are engine.threads)


def _rl_start(src: str, dst: str) -> str:
    """Where RL starts: `src`'s weights as policy version 0, with `src`'s AdamW state.

    A fresh AdamW's first steps move every weight that has a gradient by about the learning rate, whatever
    the gradient's size (m / sqrt(v) is ±1 after one step); on the tiny default that alone cost held-out
    success (docs/experiments/). The SFT moments scale RL's first updates by what SFT's gradients were."""
    if not storage.exists(storage.join(dst, checkpoint.CONFIG_FILE)):  # the config is written last
        src = storage.local_copy(src)
        with storage.staged_dir(dst, last=(checkpoint.CONFIG_FILE,)) as out:
            # checkpoints/rl-start is made, and every file written in, through safe_files (checkpoint.make_dir,
            # write_file): a link planted there or as one of its files is refused, never written through
            checkpoint.make_dir(out)
            state_file = os.path.join(src, TRAINER_FILE)
            if os.path.isfile(state_file):
                state = {**torch.load(state_file, weights_only=True), "version": 0}
                checkpoint.write_file(out, TRAINER_FILE, lambda f: torch.save(state, f))
            has_own = os.path.isfile(os.path.join(src, TOKENIZER_FILE))
            checkpoint.describe(
                out, Tokenizer.load(src) if has_own else default_tokenizer(), text_from=src, **checkpoint.usage(src)
            )
            checkpoint.save(checkpoint.load(src), out)
    return dst


def describe(path: str, tokenizer: Tokenizer, text_from: str = "", **usage: str) -> None:
    """`checkpoint.describe` of the checkpoint the trainer workers wrote at `path` (a URL too: its metadata.json
    is edited in a local copy and uploaded back with the tokenizer files)."""
    with storage.editing(path, fetch=(checkpoint.METADATA_FILE,)) as local:
        text = storage.local_copy(text_from, skip=checkpoint.TENSOR_SUFFIXES) if text_from else ""
        checkpoint.describe(local, tokenizer, text_from=text, **usage)


def rollout_stats(groups: list[Group]) -> dict[str, float]:
    trajectories = [r.trajectory for g in groups for r in g.rollouts]
    n = max(len(trajectories), 1)
    solved = [t for t in trajectories if t.checks and t.checks.all_passed]
    turns = sum(t.n_turns for t in trajectories)
    return {
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "success_rate": len(solved) / n,
        "turns_mean": turns / n,
        "tool_calls_per_turn": sum(t.n_tool_calls for t in trajectories) / max(turns, 1),
        "completion_tokens": sum(turn.completion_tokens for t in trajectories for turn in t.turns),
        "rollouts": len(trajectories),
    }


def training_samples(groups: list[Group], advantages: list[list[float]]) -> tuple[list, int]:
    """The RL samples of these groups with their advantages, and how many attempts had no token to train on
    (an attempt that ended before the policy's first turn is scored, so its reward is in the group's
    advantages, but it has no sequence: training on it would fail the whole step)."""
    samples, empty = [], 0
    for g, adv_G in zip(groups, advantages, strict=True):
        for r, adv in zip(g.rollouts, adv_G, strict=True):
            seq = r.trajectory.sequence
            if seq is None or not seq.ids:
                empty += 1
                continue
            samples.append(Sample(seq.ids, seq.loss_mask, seq.logprobs, adv, seq.routed_experts))
    return samples, empty


def group_speed_bonus(groups: list[Group], rl):
    """rl.rewards.speed_bonus of these groups' attempts, by their turns and whether the reward counts them solved."""
    trajectories = [[r.trajectory for r in g.rollouts] for g in groups]
    turns_NG = torch.tensor([[t.n_turns for t in ts] for ts in trajectories])
    solved_NG = torch.tensor([[solved(t, rl.reward) for t in ts] for ts in trajectories])
    return speed_bonus(turns_NG, solved_NG, rl.speed_bonus)


class RLTrainer:
    """The controller's TrainerClient: advantages, one RL step, weights to the engines, a checkpoint.

    The policy's actors (`fleet.policy_actors.PolicyActors`: the engines and the trainer group) do the work on
    Ray: they put colocated engines to sleep and wake them, choose the weight sync and fall back from it, and
    replace a trainer worker that dies mid-step, so the step is redone on the same batch. This class says what a
    step is and what the run directory keeps of it."""

    def __init__(
        self,
        actors: PolicyActors,
        run: RunDir,
        metrics: Metrics,
        config: TrainRunConfig,
        progress=None,
        sampler=None,
        start: str | None = None,
    ):
        self.actors, self.run, self.metrics, self.start = actors, run, metrics, start
        # written into every checkpoint beside the weights: the start checkpoint's own (chat.formats)
        self.tokenizer = (
            formats.for_checkpoint(storage.local_copy(start, skip=checkpoint.TENSOR_SUFFIXES))[0]
            if start
            else default_tokenizer()
        )
        self.config, self.progress = config, progress
        self.sampler = sampler  # the task sampler (recipe.curriculum): its per-family success estimates, in metrics
        self.started = time.perf_counter()
        self.tokens = 0

    def train(self, batch) -> dict[str, float]:
        actors = self.actors
        rewards_NG = torch.tensor([[r.reward for r in g.rollouts] for g in batch.groups])
        if self.config.rl.speed_bonus:
            rewards_NG = rewards_NG + group_speed_bonus(batch.groups, self.config.rl)
        adv_NG = weigh_negatives(
            compute_advantages(rewards_NG, self.config.rl.estimator), self.config.rl.negative_weight
        )
        samples, empty = training_samples(batch.groups, adv_NG.tolist())
        step_started = time.perf_counter()
        if actors.colocated:  # the engines sleep while the trainer steps on their devices (fleet.placement)
            actors.sleep()
        m = actors.train_step(samples, batch.trainer_version, self._save, self._last_commit)
        m.update(empty_samples=empty)
        version = actors.version
        state = batch.buffer_state()
        kept = {k: state[k] for k in ("consumed_ids", "lags", "next_group_id", "next_batch")}
        self.run.commit_checkpoint(version, kept, [r.rollout_id for r in batch.rollouts])
        # committed before the engines get the weights: an engine that restarts from now on loads them (LATEST)
        sync_started = time.perf_counter()
        serving, away, version = actors.publish(self.run.rl_checkpoint(version))
        m.update(sync_s=time.perf_counter() - sync_started, sync_fallbacks=actors.sync_fallbacks)
        if actors.colocated:
            actors.wake()
            m.update(engines_asleep_s=time.perf_counter() - step_started)
        actors.keep(serving, away, version)
        self.run.prune(version)
        stats = rollout_stats(batch.groups)
        self.tokens += stats["completion_tokens"]
        m.update(
            stats,
            train_s=time.perf_counter() - step_started,
            lag_max=max(batch.lags, default=0),
            lag_mean=sum(batch.lags) / max(len(batch.lags), 1),
            tokens_per_s=self.tokens / (time.perf_counter() - self.started),
        )
        if self.sampler is not None and self.sampler.mode != "uniform":
            m.update({f"task_p/{k}": v["p"] for k, v in self.sampler.stats().items()})
        self.metrics.log("rl", version, m)
        if self.progress is not None:
            self.progress.set_postfix(
                reward=f"{stats['reward_mean']:.2f}",
                success=f"{stats['success_rate']:.0%}",
                tok_s=f"{m['tokens_per_s']:.0f}",
                lag=f"{m['lag_mean']:.1f}",
            )
            self.progress.update(1)
        return m

    def _save(self, group: TrainerGroup) -> None:
        """The trainer's new version as rl_checkpoint(version), described before LATEST names it."""
        saved = self.run.rl_checkpoint(group.version)
        group.save(saved)
        describe(saved, self.tokenizer, text_from=self.start, **policy_usage(self.config))

    def _last_commit(self) -> str:
        """Where a new trainer group starts when a worker died mid-step: the last committed checkpoint."""
        latest = self.run.latest()
        return latest[0] if latest else self.start


def resume_state(run: RunDir, latest: tuple[str, int, dict] | None, batch_groups: int) -> tuple[int, dict | None]:
    """(start version, buffer state) from the newest checkpoint (`run.latest()`) and the accepted groups on disk."""
    groups, bad = run.load_groups()
    for line in bad:
        log(f"skipping a damaged accepted-group file: {line}")
    if latest is None and not groups:
        return 0, None
    step, state = (latest[1], latest[2]) if latest else (0, {"consumed_ids": [], "lags": []})
    consumed = set(state["consumed_ids"])
    pending = sorted(
        (g for g in groups if not any(r.rollout_id in consumed for r in g.rollouts)),
        key=lambda g: (g.ticket.deadline, g.group_id),
    )
    ready = []
    for i, g in enumerate(pending):  # trained as soon as possible; deadlines spread so batches stay feasible
        ticket = dataclasses.replace(g.ticket, deadline=max(g.ticket.deadline, step + i // batch_groups))
        ready.append((ticket, list(g.rollouts)))
    next_group_id = max([state.get("next_group_id", 0)] + [g.group_id + 1 for g in groups])
    log(f"resuming at step {step}: {len(ready)} accepted groups not yet trained are queued again")
    return step, {
        "next_batch": step,
        "next_group_id": next_group_id,
        "ready": ready,
        "consumed_ids": sorted(consumed),
        "lags": list(state["lags"]),
    }


def _observe(sampler, group: Group) -> None:
    """Tell the task sampler which attempts of a finished group solved its task."""
    trajectories = [r.trajectory for r in group.rollouts]
    sampler.observe(trajectories[0].task_id, [bool(t.checks and t.checks.all_passed) for t in trajectories])


def task_sampler(run: RunDir, config: TrainRunConfig, tasks, skip: int):
    """The RL task stream (`rl.task_sampling`, recipe.curriculum); on resume, the curriculum first re-reads how
    the accepted groups did."""

    c = config.rl
    sampler = TaskSampler(
        tasks,
        seed=config.tasks.seed,
        mode=c.task_sampling,
        group_size=config.controller.group_size,
        floor=c.task_sampling_floor,
        skip=skip,
    )
    if skip and c.task_sampling != "uniform":
        for g in run.load_groups()[0]:
            _observe(sampler, g)
    return sampler


def check_run_gpus(config: TrainRunConfig) -> None:
    """Refuse (RunError) a run whose engines and trainer workers, which RL runs together, ask for more GPUs than
    the Ray cluster has: their actors would wait forever. Called before any actor starts."""
    try:
        check_gpus(
            {
                f"{config.engine.count} engines x {config.engine.gpus:g} GPU": config.engine.count * config.engine.gpus,
                f"{config.trainer.workers} trainer workers x {config.trainer.gpus:g} GPU": config.trainer.workers
                * config.trainer.gpus,
            }
        )
    except ValueError as e:
        raise RunError(str(e)) from None


def start_policy(
    run: RunDir, config: TrainRunConfig, serving: str, version: int, train_config: TrainConfig, placement: Placement
) -> PolicyActors:
    """The policy's actors of the RL stage: a trainer group and the engines on the checkpoint `serving` at
    `version`, in `placement`; a trainer group that loses a worker is replaced from a checkpoint."""

    def new_group(checkpoint: str) -> TrainerGroup:
        return TrainerGroup(
            config.trainer.workers,
            checkpoint=checkpoint,
            config=train_config,
            num_cpus_per_worker=config.trainer.cpus,
            resources_per_worker=config.trainer.resources,
            num_gpus_per_worker=config.trainer.gpus,
            backend=config.trainer.backend,
            placement=placement.trainer,
        )

    group = new_group(serving)
    engines = start_engines(
        serving,
        config.engine.count,
        num_cpus=ENGINE_CPUS,
        resources=config.engine.resources,
        threads=config.engine.threads,
        max_batch=max(config.controller.rollout_slots, 1),
        version=version,
        restart_from=run.durable("checkpoints", "LATEST"),
        backend=config.engine.backend,
        record_routing=config.rl.routing_replay,
        num_gpus=config.engine.gpus,
        placement=placement.engines,
    )
    return PolicyActors(
        group,
        engines,
        new_group=new_group,
        weight_sync=config.weight_sync.method,
        bucket_mb=config.weight_sync.bucket_mb,
        engine_wait_s=config.engine.wait_s,
        colocated=config.placement.layout == "colocated",
        log=log,
    )


def reserve_placement(config: TrainRunConfig) -> Placement:
    """The placement groups of the RL stage's engines and trainer workers (`placement.layout`); RunError when
    the cluster cannot hold them."""
    try:
        return Placement.reserve(
            config.engine.count,
            config.trainer.workers,
            Role(ENGINE_CPUS, config.engine.gpus, config.engine.resources),
            Role(config.trainer.cpus, config.trainer.gpus, config.trainer.resources),
            colocated=config.placement.layout == "colocated",
            timeout_s=config.placement.wait_s,
        )
    except ValueError as e:
        raise RunError(str(e)) from None


def start_rollout_workers(config: TrainRunConfig, serving: str, actors: PolicyActors) -> list:
    """The rollout workers that run the agent harness against the policy's engines, `controller.rollout_slots`
    attempts at once over `rollouts.workers` workers."""
    c, ctl = config.rl, config.controller
    spec = RolloutSpec(
        checkpoint=serving,
        sandbox=config.sandbox,
        episode=episode_config(config),
        max_tokens=c.max_tokens,
        temperature=c.temperature,
        max_seq_len=config.model.max_seq_len,
        tool_grammar=config.model.tool_grammar,
    )
    return start_workers(
        spec,
        actors.engines,
        config.rollouts.workers,
        slots_per_worker=-(-ctl.rollout_slots // config.rollouts.workers),
        num_cpus=config.rollouts.cpus,
        resources=config.rollouts.resources,
    )


def group_callbacks(run: RunDir, config: TrainRunConfig, tasks: TaskSampler, writer: RolloutWriter):
    """The controller's `on_group` (the task sampler learns how the group did; an accepted group is saved for
    the trainer, every attempt goes to the rollout store) and `on_broken` (the task leaves the stream)."""

    def on_group(g: Group, dropped: bool) -> None:
        _observe(tasks, g)
        if not dropped:
            run.save_group(g)  # durable before the trainer can see it
        writer.append(
            [
                rollout_record(
                    r.trajectory,
                    run=config.name,
                    step=g.ticket.policy_version,
                    group=g.group_id,
                    attempt=int(r.rollout_id.split("/")[1]),
                    extra={"dropped": dropped},
                )
                for r in g.rollouts
            ]
        )

    def on_broken(task, why: str) -> None:
        log(f"leaving task {task.id} out of RL: {why}")
        tasks.exclude(task.id)

    return on_group, on_broken


def reinforce(
    run: RunDir, config: TrainRunConfig, train_tasks, sft_ckpt: str, metrics: Metrics, progress: bool = True
) -> str:
    c, ctl = config.rl, config.controller
    start = _rl_start(sft_ckpt, run.checkpoint("rl-start"))
    latest = run.latest()
    serving = latest[0] if latest else start
    version, buffer_state = resume_state(run, latest, ctl.batch_groups)
    if version >= c.steps:
        return serving
    train_config = TrainConfig(lr=c.lr, loss=c.loss, routing_replay=c.routing_replay, seed=config.model.seed)
    placement = reserve_placement(config)
    actors = start_policy(run, config, serving, version, train_config, placement)
    fleet = SandboxFleet.start()  # held for the run: a host whose last handle goes away is collected
    workers = start_rollout_workers(config, serving, actors)
    writer = RolloutWriter(run.durable("rollouts"))

    skip = buffer_state["next_group_id"] if buffer_state else 0
    tasks = task_sampler(run, config, train_tasks, skip)
    on_group, on_broken = group_callbacks(run, config, tasks, writer)
    bar = tqdm(total=c.steps, initial=version, desc="rl", unit="step", disable=not progress, file=sys.stderr)
    trainer = RLTrainer(actors, run, metrics, config, bar, sampler=tasks, start=start)
    controller = Controller(
        ctl,
        AgentGroupRunner(workers),
        trainer,
        tasks,
        start_version=version,
        buffer_state=buffer_state,
        on_group=on_group,
        on_broken=on_broken,
    )
    try:
        report = controller.run(c.steps)
        if report.ended_by == "no_more_items":
            raise RunError(
                f"RL stopped at step {report.version} of {c.steps}: every training task was left "
                f"out because its set-up fails (last: {report.last_task_error})"
            )
        actors.prefix_cache_report()
        if c.task_sampling != "uniform":
            log(
                "task families (attempts, success estimate): "
                + ", ".join(f"{k} {v['attempts']}, {v['p']:.2f}" for k, v in tasks.stats().items())
            )
    finally:
        bar.close()
        actors.shutdown()  # the trainer group in use: a worker that died was replaced
        stop_workers(workers)  # first: an episode still running would start sandboxes on a fleet shutting down
        fleet.shutdown()
        placement.remove()  # and with it the engines and trainer workers placed in it
    log(f"RL done: {report}")
    return run.latest()[0]
