"""`codefleet train`: tasks -> expert demonstrations -> SFT -> asynchronous RL on Ray -> held-out evaluation.

Stages (each skipped on `--resume` when its output exists, see run_dir.py):

1. tasks: `n_train` tasks from the training templates and `n_eval` from the
   held-out templates of the bundled families (`tasks.generate`).
2. demonstrations: the scripted expert solves the training tasks through the
   real harness in real sandboxes (`rl.demos`).
3. SFT: a freshly initialised MoE policy learns the demonstrations
   (`TrainerGroup.sft_step`, data-parallel over `sft.workers`).
4. RL: the controller (`fleet.controller`) admits groups of `group_size`
   attempts under the staleness bound `eta`; rollout workers run the agent
   harness in sandboxes forked from each task's prepared sandbox, with the
   engine actors as policy; a finished group is persisted, then buffered;
   the trainer takes `batch_groups` groups per step, computes group-relative
   advantages, runs the policy loss (off-policy correction for stale tokens,
   routing replay), publishes the weights through the object store to the
   engines (in-flight episodes continue on the new weights) and checkpoints.
5. evaluation of the SFT and the RL checkpoints on the held-out tasks, and a
   table of success, turns and wall clock per solved task.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import sys
import time

import yaml

from codefleet.config import to_dict
from codefleet.fleet.ray_init import init_ray
from codefleet.fleet.run_dir import Metrics, RunDir, atomic_write
from codefleet.fleet.staleness import Group
from codefleet.fleet.train_config import TrainRunConfig


class RunError(RuntimeError):
    """The run cannot go on; the message says what to do."""


def _log(message: str) -> None:
    print(f"[codefleet train] {message}", file=sys.stderr, flush=True)


def check_config(config: TrainRunConfig) -> None:
    """Refuse a configuration that would fail later (after minutes of SFT), with the field to change."""
    from codefleet.agent.prompts import PROMPTS
    from codefleet.model.config import ModelConfig
    from codefleet.rl.advantages import ESTIMATORS
    from codefleet.rl.curriculum import MODES as SAMPLING_MODES
    from codefleet.tasks.families import FAMILIES

    t, r, cl = config.tasks, config.rl, config.cluster
    problems = [
        (t.n_train >= 1 and t.n_eval >= 1, "tasks.n_train and tasks.n_eval must be >= 1"),
        (not set(t.families) - set(FAMILIES), f"tasks.families must be among {', '.join(sorted(FAMILIES))}"),
        (config.model.size in ("tiny", "small", "medium") and hasattr(ModelConfig, config.model.size),
         "model.size must be tiny, small or medium"),
        (r.estimator in ESTIMATORS, f"rl.estimator must be one of {', '.join(ESTIMATORS)}"),
        (r.group_size >= 2, "rl.group_size must be >= 2: group-relative advantages need two attempts"),
        (0 <= r.negative_weight <= 1, "rl.negative_weight must be in [0, 1]"),
        (r.rollout_slots >= r.group_size, "rl.rollout_slots must hold at least one group (>= rl.group_size)"),
        (r.steps >= 0 and r.eta >= 0 and r.batch_groups >= 1, "rl.steps, rl.eta >= 0 and rl.batch_groups >= 1"),
        (cl.trainer_workers >= 1 and cl.engines >= 1 and cl.rollout_workers >= 1,
         "cluster.trainer_workers, cluster.engines and cluster.rollout_workers must be >= 1"),
        (config.sft.epochs >= 1 and config.sft.batch_size >= 1, "sft.epochs and sft.batch_size must be >= 1"),
        (config.sft.workers >= 1 and config.sft.threads >= 1, "sft.workers and sft.threads must be >= 1"),
        (0 <= config.sft.explore_fraction <= 1 and 0 <= config.sft.chain_fraction <= 1,
         "sft.explore_fraction and sft.chain_fraction must be in [0, 1]"),
        (config.model.copy_scope in ("all", "prompt"), "model.copy_scope must be 'all' or 'prompt'"),
        (config.model.prompt in PROMPTS, f"model.prompt must be one of {', '.join(PROMPTS)}"),
        (r.task_sampling in SAMPLING_MODES, f"rl.task_sampling must be one of {', '.join(SAMPLING_MODES)}"),
    ]
    bad = [message for ok, message in problems if not ok]
    if bad:
        raise RunError("invalid configuration: " + "; ".join(bad))


# -- stages -----------------------------------------------------------------------------


def make_tasks(run: RunDir, config: TrainRunConfig):
    from codefleet.tasks.generate import generate_tasks
    from codefleet.tasks.spec import load_tasks

    t = config.tasks
    sets = {}
    for split, n in (("train", t.n_train), ("test", t.n_eval)):
        folder = run.path("tasks", "train" if split == "train" else "eval")
        if os.path.isdir(folder) and os.listdir(folder):
            sets[split] = load_tasks(folder)
        else:
            sets[split] = generate_tasks(folder, n=n, seed=t.seed, families=t.families, difficulty=t.difficulty,
                                         split=split, more_domains=t.more_domains)
    return sets["train"], sets["test"]


STRUCTURE = "`\"'{}[](),:"  # model.copy_words_only: tokens holding these are never copied


def init_model(run: RunDir, config: TrainRunConfig, tokenizer) -> str:
    import torch

    from codefleet.model import checkpoint
    from codefleet.model.config import ModelConfig
    from codefleet.model.transformer import Transformer

    path = run.path("checkpoints", "init")
    if os.path.isfile(os.path.join(path, checkpoint.CONFIG_FILE)):
        return path
    preset = getattr(ModelConfig, config.model.size, None)
    if preset is None:
        raise RunError(f"model.size={config.model.size!r} is not a preset; use tiny, small or medium")
    torch.manual_seed(config.model.seed)
    blocked = tokenizer.ids_containing(STRUCTURE) if config.model.copy_words_only else []
    model = Transformer(preset(vocab_size=tokenizer.vocab_size, max_seq_len=config.model.max_seq_len,
                               copy_head=config.model.copy_head, copy_scope=config.model.copy_scope,
                               copy_match=config.model.copy_match, copy_blocked=blocked))
    checkpoint.save(model, path)
    return path


def demonstrations(run: RunDir, config: TrainRunConfig, tasks, tokenizer):
    from codefleet.rl.demos import expert_demos

    path = run.path("demos.pkl")
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return pickle.load(f)
    started = time.perf_counter()
    expert = dataclasses.replace(_episode_config(config), budgets=None)  # the task's own budgets, not RL's
    demos = expert_demos(tasks, tokenizer, config.model.max_seq_len, config.sandbox, expert,
                         explore_fraction=config.sft.explore_fraction, chain_fraction=config.sft.chain_fraction,
                         seed=config.tasks.seed)
    atomic_write(path, pickle.dumps(demos))
    took_s = time.perf_counter() - started
    _log(f"{len(demos.examples)} expert demonstrations ({demos.tokens} tokens) in {took_s:.0f} s;"
         f" {len(demos.unsolved)} unsolved, {len(demos.too_long)} longer than the context, dropped")
    return demos


def sft(run: RunDir, config: TrainRunConfig, demos, init: str, metrics: Metrics, tokenizer) -> str:
    from codefleet.fleet.trainer_group import TrainerGroup
    from codefleet.rl.trainer import TrainConfig

    path = run.path("checkpoints", "sft")
    if os.path.isfile(run.path("sft.done")):
        return path
    if not demos.examples:
        raise RunError("no expert demonstration solved its task; check `codefleet tasks check` on the task set")
    c, cl = config.sft, config.cluster
    total_steps = c.epochs * -(-len(demos.examples) // c.batch_size)
    schedule = TrainConfig(lr=c.lr, seed=config.model.seed, warmup_steps=c.warmup_steps, decay_steps=total_steps)
    group = TrainerGroup(c.workers, checkpoint=init, config=schedule, num_cpus_per_worker=cl.trainer_cpus,
                         resources_per_worker=cl.trainer_resources, threads_per_worker=c.threads)
    try:
        rng = random.Random(config.model.seed)
        order = list(range(len(demos.examples)))
        step, started = 0, time.perf_counter()
        for epoch in range(c.epochs):
            rng.shuffle(order)
            for i in range(0, len(order), c.batch_size):
                m = group.sft_step(sft_batch(demos, order[i:i + c.batch_size], c, rng, tokenizer,
                                             config.model.max_seq_len))
                step += 1
                metrics.log("sft", step, m)
                _log(f"sft epoch {epoch + 1}/{c.epochs} step {step}: loss {m.get('loss', m.get('ce', 0)):.3f} "
                     f"({time.perf_counter() - started:.0f} s)")
        group.save(path)
    finally:
        group.shutdown()
    atomic_write(run.path("sft.done"), b"")
    return path


def sft_batch(demos, picked: list[int], c, rng: random.Random, tokenizer, max_seq_len: int) -> list:
    """One SFT step's examples: demonstrations `picked`, with fresh names when `c.fresh_names`
    (rl.augment), and `c.first_turns` first turns of random demonstrations, each with fresh names (the
    task and the expert's first answer: ~150 tokens that teach copying names from the task, the skill
    every later turn builds on, at a fifth of a whole demonstration's cost)."""
    from codefleet.rl.augment import fresh_names

    if not (c.fresh_names and len(getattr(demos, "conversations", ())) == len(demos.examples)):  # older runs
        return [demos.examples[j] for j in picked]

    def renamed(j: int, turns: int | None = None):
        messages = fresh_names(demos.conversations[j], rng)
        if turns is not None:
            first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
            messages = messages[:first + turns]
        ids, mask = demos.encode(tokenizer, messages)
        return (ids, mask) if len(ids) <= max_seq_len else demos.examples[j]  # new names past the context

    return ([renamed(j) for j in picked]
            + [renamed(rng.randrange(len(demos.conversations)), turns=1) for _ in range(c.first_turns)])


def _episode_config(config: TrainRunConfig):
    from codefleet.agent.episode import EpisodeConfig
    from codefleet.agent.tools import ToolConfig
    from codefleet.types import Budgets

    return EpisodeConfig(budgets=Budgets(max_turns=config.rl.max_turns, max_tool_calls=4 * config.rl.max_turns,
                                         wall_clock_s=config.rl.rollout_timeout_s / 2),
                         tools=ToolConfig(max_output_chars=4000), reward=config.rl.reward, prompt=config.model.prompt)


def _rl_start(src: str, dst: str, keep_optimizer: bool) -> str:
    """Where RL starts: `src`'s weights as policy version 0, with `src`'s AdamW state when `keep_optimizer`.

    A fresh AdamW's first steps move every weight that has a gradient by about the learning rate, whatever
    the gradient's size (m / sqrt(v) is ±1 after one step); on the tiny default that alone cost held-out
    success (docs/training.md). The SFT moments scale RL's first updates by what SFT's gradients were."""
    import torch

    from codefleet.model import checkpoint
    from codefleet.rl.trainer import TRAINER_FILE

    if not os.path.isfile(os.path.join(dst, checkpoint.CONFIG_FILE)):  # the config is written last
        os.makedirs(dst, exist_ok=True)
        state_file = os.path.join(src, TRAINER_FILE)
        if keep_optimizer and os.path.isfile(state_file):
            state = torch.load(state_file, weights_only=True)
            torch.save({**state, "version": 0}, os.path.join(dst, TRAINER_FILE))
        checkpoint.save(checkpoint.load(src), dst)
    return dst


# -- RL ---------------------------------------------------------------------------------


def rollout_stats(groups: list[Group]) -> dict[str, float]:
    trajectories = [r.payload["trajectory"] for g in groups for r in g.rollouts]
    n = max(len(trajectories), 1)
    solved = [t for t in trajectories if t.checks and t.checks.all_passed]
    turns = sum(t.n_turns for t in trajectories)
    return {"reward_mean": sum(t.reward for t in trajectories) / n, "success_rate": len(solved) / n,
            "turns_mean": turns / n, "tool_calls_per_turn": sum(t.n_tool_calls for t in trajectories) / max(turns, 1),
            "completion_tokens": sum(turn.completion_tokens for t in trajectories for turn in t.turns),
            "rollouts": len(trajectories)}


def training_samples(groups: list[Group], advantages: list[list[float]]) -> tuple[list, int]:
    """The RL samples of these groups with their advantages, and how many attempts had no token to train on
    (an attempt that ended before the policy's first turn is scored, so its reward is in the group's
    advantages, but it has no sequence: training on it would fail the whole step)."""
    from codefleet.rl.batch import Sample

    samples, empty = [], 0
    for g, adv_G in zip(groups, advantages):
        for r, adv in zip(g.rollouts, adv_G):
            s = r.payload["sample"]
            if not s["tokens"]:
                empty += 1
                continue
            samples.append(Sample(s["tokens"], s["loss_mask"], s["behave_logprobs"], adv, s["routed_experts"]))
    return samples, empty


class RLTrainer:
    """The controller's TrainerClient: advantages, one RL step, weights to the engines, a checkpoint."""

    def __init__(self, group, engines, run: RunDir, metrics: Metrics, config: TrainRunConfig, progress=None,
                 sampler=None):
        self.group, self.engines, self.run, self.metrics = group, engines, run, metrics
        self.config, self.progress = config, progress
        self.controller = None  # set once the controller exists (its buffer state goes into checkpoints)
        self.sampler = sampler  # the task sampler (rl.curriculum): its per-family success estimates go into the metrics
        self.started = time.perf_counter()
        self.tokens = 0

    def train(self, batch) -> dict[str, float]:
        import torch

        from codefleet.fleet.inference import broadcast_weights
        from codefleet.rl.advantages import compute_advantages, weigh_negatives

        rewards_NG = torch.tensor([[r.reward for r in g.rollouts] for g in batch.groups])
        adv_NG = weigh_negatives(compute_advantages(rewards_NG, self.config.rl.estimator),
                                 self.config.rl.negative_weight)
        samples, empty = training_samples(batch.groups, adv_NG.tolist())
        step_started = time.perf_counter()
        m = dict(self.group.rl_step(samples))
        m["empty_samples"] = empty
        weights_ref, version = self.group.publish()
        broadcast_weights(self.engines, weights_ref, version)
        self.group.save(self.run.rl_checkpoint(version))
        state = self.controller.buffer_state()
        kept = {k: state[k] for k in ("consumed_ids", "lags", "next_group_id", "next_batch")}
        self.run.commit_checkpoint(version, kept, [r.rollout_id for r in batch.rollouts])
        self.run.prune(version)
        stats = rollout_stats(batch.groups)
        self.tokens += stats["completion_tokens"]
        m.update(stats, train_s=time.perf_counter() - step_started, lag_max=max(batch.lags, default=0),
                 lag_mean=sum(batch.lags) / max(len(batch.lags), 1),
                 tokens_per_s=self.tokens / (time.perf_counter() - self.started))
        if self.sampler is not None and self.sampler.mode != "uniform":
            m.update({f"task_p/{k}": v["p"] for k, v in self.sampler.stats().items()})
        self.metrics.log("rl", version, m)
        if self.progress is not None:
            self.progress.set_postfix(reward=f"{stats['reward_mean']:.2f}", success=f"{stats['success_rate']:.0%}",
                                      tok_s=f"{m['tokens_per_s']:.0f}", lag=f"{m['lag_mean']:.1f}")
            self.progress.update(1)
        return m


def resume_state(run: RunDir, latest: tuple[str, int, dict] | None, batch_groups: int) -> tuple[int, dict | None]:
    """(start version, buffer state) from the newest checkpoint (`run.latest()`) and the accepted groups on disk."""
    groups, bad = run.load_groups()
    for line in bad:
        _log(f"skipping a damaged accepted-group file: {line}")
    if latest is None and not groups:
        return 0, None
    step, state = (latest[1], latest[2]) if latest else (0, {"consumed_ids": [], "lags": []})
    consumed = set(state["consumed_ids"])
    pending = sorted((g for g in groups if not any(r.rollout_id in consumed for r in g.rollouts)),
                     key=lambda g: (g.ticket.deadline, g.group_id))
    ready = []
    for i, g in enumerate(pending):  # trained as soon as possible; deadlines spread so batches stay feasible
        ticket = dataclasses.replace(g.ticket, deadline=max(g.ticket.deadline, step + i // batch_groups))
        ready.append((ticket, list(g.rollouts)))
    next_group_id = max([state.get("next_group_id", 0)] + [g.group_id + 1 for g in groups])
    _log(f"resuming at step {step}: {len(ready)} accepted groups not yet trained are queued again")
    return step, {"next_batch": step, "next_group_id": next_group_id, "ready": ready,
                  "consumed_ids": sorted(consumed), "lags": list(state["lags"])}


def _observe(sampler, group: Group) -> None:
    """Tell the task sampler which attempts of a finished group solved its task."""
    trajectories = [r.payload["trajectory"] for r in group.rollouts]
    sampler.observe(trajectories[0].task_id, [bool(t.checks and t.checks.all_passed) for t in trajectories])


def task_sampler(run: RunDir, config: TrainRunConfig, tasks, skip: int):
    """The RL task stream (`rl.task_sampling`, rl.curriculum); on resume, the curriculum first re-reads how
    the accepted groups did."""
    from codefleet.rl.curriculum import TaskSampler

    c = config.rl
    sampler = TaskSampler(tasks, seed=config.tasks.seed, mode=c.task_sampling, group_size=c.group_size,
                          floor=c.task_sampling_floor, skip=skip)
    if skip and c.task_sampling != "uniform":
        for g in run.load_groups()[0]:
            _observe(sampler, g)
    return sampler


def reinforce(run: RunDir, config: TrainRunConfig, train_tasks, sft_ckpt: str, metrics: Metrics,
              progress: bool = True) -> str:
    from tqdm import tqdm

    from codefleet.analysis.store import RolloutWriter, rollout_record
    from codefleet.fleet.controller import Controller, ControllerConfig
    from codefleet.fleet.inference import start_engines
    from codefleet.fleet.rollouts import AgentGroupRunner, RolloutSpec, start_workers
    from codefleet.fleet.sandbox_fleet import SandboxFleet
    from codefleet.fleet.trainer_group import TrainerGroup
    from codefleet.rl.trainer import TrainConfig

    c, cl = config.rl, config.cluster
    start = _rl_start(sft_ckpt, run.path("checkpoints", "rl-start"), c.keep_sft_optimizer)
    latest = run.latest()
    serving = latest[0] if latest else start
    version, buffer_state = resume_state(run, latest, c.batch_groups)
    if version >= c.steps:
        return serving
    train_config = TrainConfig(lr=c.lr, loss=c.loss, routing_replay=c.routing_replay, seed=config.model.seed)
    group = TrainerGroup(cl.trainer_workers, checkpoint=serving, config=train_config,
                         num_cpus_per_worker=cl.trainer_cpus, resources_per_worker=cl.trainer_resources)
    engines = start_engines(serving, cl.engines, num_cpus=1.0, resources=cl.engine_resources,
                            threads=cl.engine_threads, max_batch=max(c.rollout_slots, 1), version=version)
    fleet = SandboxFleet.start()  # held for the run: a host whose last handle goes away is collected
    spec = RolloutSpec(checkpoint=serving, sandbox=config.sandbox, episode=_episode_config(config),
                       max_tokens=c.max_tokens, temperature=c.temperature, max_seq_len=config.model.max_seq_len)
    workers = start_workers(spec, engines, cl.rollout_workers,
                            slots_per_worker=-(-c.rollout_slots // cl.rollout_workers), num_cpus=cl.rollout_cpus,
                            resources=cl.rollout_resources)
    writer = RolloutWriter(run.path("rollouts"))

    skip = buffer_state["next_group_id"] if buffer_state else 0
    tasks = task_sampler(run, config, train_tasks, skip)

    def on_group(g: Group, dropped: bool) -> None:
        _observe(tasks, g)
        if not dropped:
            run.save_group(g)  # durable before the trainer can see it
        writer.append([rollout_record(r.payload["trajectory"], run=config.name, step=g.ticket.policy_version,
                                      group=g.group_id, attempt=int(r.rollout_id.split("/")[1]),
                                      extra={"dropped": dropped}) for r in g.rollouts])

    bar = tqdm(total=c.steps, initial=version, desc="rl", unit="step", disable=not progress, file=sys.stderr)
    trainer = RLTrainer(group, engines, run, metrics, config, bar, sampler=tasks)
    controller = Controller(
        ControllerConfig(eta=c.eta, rollout_slots=c.rollout_slots, batch_groups=c.batch_groups,
                         group_size=c.group_size, rollout_timeout_s=c.rollout_timeout_s,
                         drop_zero_variance=c.drop_zero_variance),
        AgentGroupRunner(workers), trainer, tasks,
        start_version=version, buffer_state=buffer_state, on_group=on_group)
    trainer.controller = controller
    try:
        report = controller.run(c.steps)
        _log_prefix_cache(engines)
        if c.task_sampling != "uniform":
            _log("task families (attempts, success estimate): " + ", ".join(
                f"{k} {v['attempts']}, {v['p']:.2f}" for k, v in tasks.stats().items()))
    finally:
        bar.close()
        group.shutdown()
        fleet.shutdown()
    _log(f"RL done: {report}")
    return run.latest()[0]


def _log_prefix_cache(engines) -> None:
    """How much prefill the engines' prefix cache saved over the run (the turns of an episode share it)."""
    import ray

    for i, info in enumerate(ray.get([e.info.remote() for e in engines])):
        reused, computed = info["prefix_tokens_reused"], info["prefill_tokens"]
        _log(f"engine {i}: prefix cache supplied {reused} of {reused + computed} prompt tokens "
             f"({reused / max(reused + computed, 1):.0%}, {info['prefix_hits']} hits)")


# -- the run ----------------------------------------------------------------------------


def evaluate_checkpoints(run: RunDir, config: TrainRunConfig, eval_tasks, checkpoints: dict[str, str]) -> dict:
    """Each checkpoint's report in eval/LABEL.json, its episodes in the rollout store eval/LABEL-rollouts."""
    import shutil

    from codefleet.analysis.store import RolloutWriter, rollout_record
    from codefleet.fleet.evaluate import EvalConfig, evaluate

    e = config.eval
    results = {}
    for label, path in checkpoints.items():
        out = run.path("eval", f"{label}.json")
        if os.path.isfile(out):
            with open(out) as f:
                results[label] = json.load(f)
            continue
        _log(f"evaluating the {label} checkpoint on {len(eval_tasks)} held-out tasks")
        store = run.path("eval", f"{label}-rollouts")
        shutil.rmtree(store, ignore_errors=True)  # an evaluation a crash cut short starts over
        writer = RolloutWriter(store)
        index = {t.id: i for i, t in enumerate(eval_tasks)}

        def on_task(task, trajectories, label=label, writer=writer):
            writer.append([rollout_record(t, run=f"{config.name}-{label}", step=0, group=index[task.id],
                                          attempt=i, split="eval") for i, t in enumerate(trajectories)])

        report, _ = evaluate(path, eval_tasks, EvalConfig(attempts=e.attempts, temperature=e.temperature,
                                                          max_tokens=e.max_tokens, jobs=e.jobs),
                             config.sandbox, _episode_config(config), on_task=on_task)
        results[label] = report.summary()
        atomic_write(out, json.dumps(results[label], indent=2, sort_keys=True).encode())
    return results


def results_table(results: dict) -> str:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [f"{'checkpoint':<10} {'success':>8} {'turns/solved':>13} {'wall s/solved':>14} {'turns':>6} "
             f"{'calls/turn':>10} {'tool errors':>11} {'wall s':>7}"]
    for label, r in results.items():
        lines.append(f"{label:<10} {r['success_rate']:>8.1%} {fmt(r['turns_per_solved'], '.2f'):>13} "
                     f"{fmt(r['wall_s_per_solved'], '.2f'):>14} {r['turns']:>6.2f} {r['tool_calls_per_turn']:>10.2f} "
                     f"{r.get('tool_errors', 0.0):>11.2f} {r['wall_s']:>7.2f}")
    return "\n".join(lines)


def train(config: TrainRunConfig, out: str, resume: bool = False, progress: bool = True) -> dict:
    """Run (or resume) the whole pipeline into `out`; returns the evaluation results."""
    import ray

    from codefleet.model.tokenizer import default_tokenizer

    run = RunDir(out)
    saved = run.path("config.yaml")
    if resume:
        if not os.path.isfile(saved):
            raise RunError(f"{out} has no config.yaml: nothing to resume; start a run with --out {out}")
        from codefleet.config import from_dict

        with open(saved) as f:
            config = from_dict(TrainRunConfig, yaml.safe_load(f))
    check_config(config)
    if not resume:
        if os.path.isfile(saved):
            raise RunError(f"{out} already holds a run; pass --resume to continue it, or choose another --out")
        os.makedirs(run.root, exist_ok=True)
        atomic_write(saved, yaml.safe_dump(to_dict(config), sort_keys=False).encode())
    started = time.perf_counter()
    tokenizer = default_tokenizer()
    train_tasks, eval_tasks = make_tasks(run, config)
    init = init_model(run, config, tokenizer)
    demos = demonstrations(run, config, train_tasks, tokenizer)
    metrics = Metrics(run)
    cl = config.cluster
    own_ray = init_ray(cl.num_cpus, {"sandbox": cl.sandbox_slots}, cl.address)
    try:
        sft_ckpt = sft(run, config, demos, init, metrics, tokenizer)
        rl_ckpt = reinforce(run, config, train_tasks, sft_ckpt, metrics, progress)
    finally:
        metrics.plot()
        metrics.close()
        if own_ray:
            ray.shutdown()
    results = evaluate_checkpoints(run, config, eval_tasks, {"sft": sft_ckpt, "rl": rl_ckpt})
    summary = {"results": results, "wall_s": round(time.perf_counter() - started, 1), "run_dir": run.root}
    atomic_write(run.path("results.json"), json.dumps(summary, indent=2, sort_keys=True).encode())
    return summary
