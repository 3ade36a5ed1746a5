"""`codefleet train`: tasks -> expert demonstrations -> SFT -> asynchronous RL on Ray -> held-out evaluation.

Stages (each skipped on `--resume` when its output exists, see run_dir.py):

1. tasks: `n_train` tasks from the training templates and `n_eval` from the
   held-out templates of the bundled families (`tasks.generate`).
2. demonstrations: the scripted expert solves the training tasks through the
   real harness in real sandboxes (`recipe.demos`).
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

The run directory may be a path or an fsspec URL (`--out s3://bucket/run`, run_dir.py): the stages write
their records with `RunDir.write` / `publish` and pass checkpoints on as `RunDir.checkpoint(...)`, which is a
URL for a URL run; whoever reads a checkpoint, on whatever node, takes `storage.local_copy` of it, and whoever
writes one writes into `storage.staged_dir` (the trainer workers, `init_model`, `train_rl._rl_start`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time

import torch
import yaml

from codefleet.chat import formats
from codefleet.chat.tokenizer import default_tokenizer
from codefleet.config import to_dict
from codefleet.fleet.ray_init import ray_running
from codefleet.fleet.trainer_group import TrainerGroup
from codefleet.model import checkpoint, kernels
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.recipe.augment import fresh_names
from codefleet.recipe.config import TrainRunConfig, episode_config, policy_usage
from codefleet.recipe.config_check import check_config, nothing_to_resume
from codefleet.recipe.demos import Demos, expert_demos
from codefleet.recipe.evaluate import compare, evaluate
from codefleet.recipe.run_dir import Metrics, RunDir, RunError, log
from codefleet.recipe.train_rl import check_run_gpus, describe, reinforce
from codefleet.rl.trainer import TrainConfig
from codefleet.store import records, safe_files, storage
from codefleet.store.parquet import RolloutWriter, rollout_record
from codefleet.tasks.generate import generate_tasks
from codefleet.tasks.spec import load_tasks

# -- stages -----------------------------------------------------------------------------


def make_tasks(run: RunDir, config: TrainRunConfig):
    """The demonstrated training tasks, the tasks RL attempts and the held-out tasks."""

    t = config.tasks
    fresh = t.n_train if t.rl_tasks == "fresh" and not t.train_dir else 0  # no more of your own tasks to draw
    sets = {}
    for name, n, split, seed in (
        ("train", t.n_train, "train", t.seed),
        ("rl-fresh", fresh, "train", t.seed + 1),
        ("eval", t.n_eval, "test", t.seed),
    ):
        folder = run.path("tasks", name)
        if given := {"train": t.train_dir, "eval": t.eval_dir}.get(name):
            try:
                sets[name] = load_tasks(given)
            except (OSError, ValueError) as e:
                raise RunError(f"tasks.{name}_dir: {e}") from None
            if not sets[name]:
                raise RunError(
                    f"tasks.{name}_dir {given!r} holds no tasks; make some with `codefleet tasks "
                    "generate` or `codefleet tasks import`"
                )
        elif not n:
            sets[name] = []
        elif run.fetch(f"tasks/{name}") and safe_files.listdir_beneath(run.root, folder):  # a link: refused
            sets[name] = load_tasks(folder)
        else:  # new instances for RL are never a demonstrated task drawn again
            demonstrated = frozenset(task.instruction for task in sets["train"]) if name == "rl-fresh" else frozenset()
            sets[name] = generate_tasks(
                folder,
                n=n,
                seed=seed,
                families=t.families,
                difficulty=t.difficulty,
                split=split,
                more_domains=False,
                exclude=demonstrated,
                root=run.root,
            )
            run.publish(f"tasks/{name}")
    return sets["train"], sets["rl-fresh"] if fresh else sets["train"], sets["eval"]


def init_model(run: RunDir, config: TrainRunConfig, tokenizer) -> str:
    """The checkpoint SFT starts from: `model.init` as it is, or a fresh `model.size` model written once."""
    if config.model.init:
        return config.model.init
    path = run.checkpoint("init")
    if storage.exists(storage.join(path, checkpoint.CONFIG_FILE)):
        return path
    preset = getattr(ModelConfig, config.model.size, None)
    if preset is None:
        raise RunError(f"model.size={config.model.size!r} is not a preset; use tiny, small or medium")
    torch.manual_seed(config.model.seed)
    model = Transformer(
        preset(vocab_size=tokenizer.vocab_size, max_seq_len=config.model.max_seq_len, copy=config.model.copy)
    )
    with storage.staged_dir(path, last=(checkpoint.CONFIG_FILE,)) as local:
        checkpoint.describe(local, tokenizer, **policy_usage(config))
        checkpoint.save(model, local)  # config.json last: the stage is done when it exists
    return path


def demonstrations(run: RunDir, config: TrainRunConfig, tasks, tokenizer):
    if (saved := run.read("demos.json")) is not None:
        return records.loads(saved, Demos)
    started = time.perf_counter()
    expert = dataclasses.replace(episode_config(config), budgets=None)  # the task's own budgets, not RL's
    demos = expert_demos(
        tasks,
        tokenizer,
        config.model.max_seq_len,
        config.sandbox,
        expert,
        explore_fraction=config.sft.explore_fraction,
        chain_fraction=config.sft.chain_fraction,
        seed=config.tasks.seed,
        all_habits=True,
    )
    run.write("demos.json", records.dumps(demos))
    took_s = time.perf_counter() - started
    habits = (
        f", {sum(len({id(c) for c in v.values()}) for v in demos.variants)} episodes of their habits"
        if demos.variants
        else ""
    )
    log(
        f"{len(demos.examples)} expert demonstrations ({demos.tokens} tokens{habits}) in {took_s:.0f} s;"
        f" {len(demos.unsolved)} unsolved, {len(demos.too_long)} longer than the context, dropped"
        + (f"; {len(demos.no_patch)} tasks without a reference patch (RL only)" if demos.no_patch else "")
    )
    for task_id, why in demos.broken.items():
        log(f"task {task_id} is left out of the run, its set-up fails: {why}")
    return demos


def sft(run: RunDir, config: TrainRunConfig, demos, init: str, metrics: Metrics, tokenizer) -> str:
    path = run.checkpoint("sft")
    if run.exists("sft.done"):
        return path
    if not demos.examples:
        raise RunError(
            "no expert demonstration solved its task; check `codefleet tasks check` on the task set"
            + (
                f" ({len(demos.no_patch)} of its tasks have no reference patch for the expert to replay)"
                if demos.no_patch
                else ""
            )
        )
    c = config.sft
    total_steps = c.epochs * -(-len(demos.examples) // c.batch_size)
    schedule = TrainConfig(lr=c.lr, seed=config.model.seed, warmup_steps=c.warmup_steps, decay_steps=total_steps)
    group = TrainerGroup(
        c.workers,
        checkpoint=init,
        config=schedule,
        num_cpus_per_worker=config.trainer.cpus,
        resources_per_worker=config.trainer.resources,
        threads_per_worker=c.threads,
        num_gpus_per_worker=config.trainer.gpus,
        backend=config.trainer.backend,
    )
    try:
        rng = random.Random(config.model.seed)
        order = list(range(len(demos.examples)))
        step, started = 0, time.perf_counter()
        for epoch in range(c.epochs):
            rng.shuffle(order)
            for i in range(0, len(order), c.batch_size):
                m = group.sft_step(
                    sft_batch(demos, order[i : i + c.batch_size], c, rng, tokenizer, config.model.max_seq_len)
                )
                step += 1
                metrics.log("sft", step, m)
                log(
                    f"sft epoch {epoch + 1}/{c.epochs} step {step}: loss {m.get('loss', m.get('ce', 0)):.3f} "
                    f"({time.perf_counter() - started:.0f} s)"
                )
        group.save(path)
        describe(path, tokenizer, text_from=config.model.init, **policy_usage(config))
    finally:
        group.shutdown()
    run.write("sft.done", b"")
    return path


def sft_batch(demos, picked: list[int], c, rng: random.Random, tokenizer, max_seq_len: int) -> list:
    """One SFT step's examples: demonstrations `picked`, with fresh names when `c.fresh_names`
    (recipe.augment), and `c.first_turns` first turns of random demonstrations, each with fresh names (the
    task and the expert's first answer: ~150 tokens that teach copying names from the task, the skill
    every later turn builds on, at a fifth of a whole demonstration's cost). Demonstrations recorded with
    all their habits show a habit drawn now, each time (recipe.demos)."""

    def conversation(j: int) -> list[dict]:
        return demos.conversation(j, rng, c.explore_fraction, c.chain_fraction)

    if not c.fresh_names:
        if not demos.variants:
            return [demos.examples[j] for j in picked]
        return [demos.encode(tokenizer, conversation(j)) for j in picked]

    def renamed(j: int, turns: int | None = None):
        messages = fresh_names(conversation(j), rng)
        if turns is not None:
            first = next(i for i, m in enumerate(messages) if m.get("role") == "assistant")
            messages = messages[: first + turns]
        ids, mask = demos.encode(tokenizer, messages)
        return (ids, mask) if len(ids) <= max_seq_len else demos.examples[j]  # new names past the context

    return [renamed(j) for j in picked] + [
        renamed(rng.randrange(len(demos.conversations)), turns=1) for _ in range(c.first_turns)
    ]


# -- the run ----------------------------------------------------------------------------


def evaluate_checkpoints(run: RunDir, config: TrainRunConfig, eval_tasks, checkpoints: dict[str, str]) -> dict:
    """Each checkpoint's report in eval/LABEL.json, its episodes in the rollout store eval/LABEL-rollouts."""
    e = config.eval
    results = {}
    for label, path in checkpoints.items():
        out = f"eval/{label}.json"
        grammar = config.model.tool_grammar
        settings = dataclasses.asdict(e) | ({"tool_grammar": grammar} if grammar != "off" else {})
        # this checkpoint, evaluated so, before a crash (a resume may change both)
        if (saved := run.read(out)) is not None:
            done = json.loads(saved)
            if done.get("checkpoint") == path and done.get("settings") == settings:
                results[label] = done
                continue
        log(f"evaluating the {label} checkpoint on {len(eval_tasks)} held-out tasks")
        store = run.durable("eval", f"{label}-rollouts")
        # an evaluation a crash cut short starts over; neither the removal nor the store follows a link below the
        # run directory (a planted eval/ or eval/LABEL-rollouts is refused or removed as a link, never entered)
        storage.remove(store, root=run.location)
        writer = RolloutWriter(store, beneath=run.location)
        index = {t.id: i for i, t in enumerate(eval_tasks)}

        def on_task(task, trajectories, label=label, writer=writer, index=index):
            writer.append(
                [
                    rollout_record(
                        t, run=f"{config.name}-{label}", step=0, group=index[task.id], attempt=i, split="eval"
                    )
                    for i, t in enumerate(trajectories)
                ]
            )

        report, _ = evaluate(
            path, eval_tasks, e, config.sandbox, episode_config(config), on_task=on_task, tool_grammar=grammar
        )
        solved_turns = sorted(a["turns"] for ts in report.per_task.values() for a in ts if a["solved"])
        results[label] = {**report.summary(), "settings": settings, "solved_turns": solved_turns}
        if warning := report.clock_warning():
            log(f"{label}: {warning} (eval.jobs, eval.attempts, controller.rollout_timeout_s)")
        run.write(out, json.dumps(results[label], indent=2, sort_keys=True).encode())
    return results


def results_table(results: dict) -> str:
    def fmt(x, spec):
        return "-" if x is None else format(x, spec)

    lines = [
        f"{'checkpoint':<10} {'success':>8} {'turns/solved':>13} {'wall s/solved':>14} {'turns':>6} "
        f"{'calls/turn':>10} {'tool errors':>11} {'wall s':>7}"
    ]
    for label, r in results.items():
        lines.append(
            f"{label:<10} {r['success_rate']:>8.1%} {fmt(r['turns_per_solved'], '.2f'):>13} "
            f"{fmt(r['wall_s_per_solved'], '.2f'):>14} {r['turns']:>6.2f} {r['tool_calls_per_turn']:>10.2f} "
            f"{r.get('tool_errors', 0.0):>11.2f} {r['wall_s']:>7.2f}"
        )
    return "\n".join(lines)


def train(config: TrainRunConfig, out: str, resume: bool = False, progress: bool = True) -> dict:
    """Run the pipeline into `out`, or, with `resume`, go on with the run there (`config` from
    `resumed_config(out, ...)`); returns the evaluation results."""
    run = RunDir(out)
    check_config(config)
    if not resume:
        try:
            if run.exists("config.yaml"):
                raise RunError(f"{out} already holds a run; pass --resume to continue it, or choose another --out")
            os.makedirs(run.root, exist_ok=True)
            storage.makedirs(run.location)
        except OSError as e:
            raise RunError(f"cannot make the run directory {out} ({e.strerror or e}); choose another --out") from None
        run.write_format()
    elif not run.exists("config.yaml"):
        raise nothing_to_resume(out)
    else:
        run.check_format()
    run.lock()  # one process per run: two would overwrite each other's groups and checkpoints
    try:
        if resume:
            run.latest()  # a damaged RL checkpoint is reported now, not after the stages before RL
        return _train(run, config, progress)
    finally:
        run.unlock()


def _log_kernels() -> None:
    """Say which native CPU kernels this machine has: without them SFT, RL and the engine run their PyTorch
    paths, the same results but slower (the first thing to check when a run is slower than docs/benchmarks.md)."""
    native = {"training": kernels.moe_train(), "decode": kernels.decode_layer(), "experts": kernels.moe_experts()}
    missing = [name for name, op in native.items() if op is None]
    if missing:
        log(
            f"native CPU kernels missing ({', '.join(missing)}): their PyTorch paths run instead, slower; "
            "`python -m codefleet.model.kernels` says why"
        )
    else:
        log(f"native CPU kernels: {', '.join(native)}; torch threads per process: {torch.get_num_threads()}")


class _Phases:
    """Wall-clock seconds per phase of a run, in the order the phases first ran (a phase may run in parts)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def done(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = round(self.seconds.get(phase, 0.0) + now - self._last, 1)
        self._last = now


def _train(run: RunDir, config: TrainRunConfig, progress: bool) -> dict:
    t = config.tasks  # your task directories, absolute: a resume may start elsewhere
    t.train_dir, t.eval_dir = (os.path.abspath(d) if d else "" for d in (t.train_dir, t.eval_dir))
    config.model.init = storage.absolute(config.model.init) if config.model.init else ""
    run.write("config.yaml", yaml.safe_dump(to_dict(config), sort_keys=False).encode())  # with a resume's changes
    started = time.perf_counter()
    phases = _Phases()
    _log_kernels()
    # the start checkpoint's tokenizer and chat template (chat.formats), else codefleet's
    tokenizer = (
        formats.for_checkpoint(storage.local_copy(config.model.init, skip=checkpoint.TENSOR_SUFFIXES))[0]
        if config.model.init
        else default_tokenizer()
    )
    train_tasks, rl_tasks, eval_tasks = make_tasks(run, config)
    init = init_model(run, config, tokenizer)
    phases.done("set-up")
    demos = demonstrations(run, config, train_tasks, tokenizer)
    phases.done("demonstrations")
    metrics = Metrics(run)
    cl = config.cluster
    with ray_running(cl.num_cpus, {"sandbox": cl.sandbox_slots}, cl.address):
        phases.done("set-up")
        try:
            check_run_gpus(config)
            sft_ckpt = sft(run, config, demos, init, metrics, tokenizer)
            phases.done("sft")
            sft_hash = checkpoint.tensor_hash(storage.local_copy(sft_ckpt))
            log(f"sft checkpoint {sft_ckpt}: tensor hash {sft_hash}")
            rl_tasks = [t for t in rl_tasks if t.id not in demos.broken]
            if not rl_tasks:
                raise RunError(
                    f"the set-up of every training task fails (e.g. {next(iter(demos.broken.values()))}); "
                    "fix the tasks' setup commands and start a new run"
                )
            rl_ckpt = reinforce(run, config, rl_tasks, sft_ckpt, metrics, progress)
            phases.done("rl")
        finally:
            metrics.plot()
            metrics.close()
    results = {}
    for label, path in (("sft", sft_ckpt), ("rl", rl_ckpt)):
        results.update(evaluate_checkpoints(run, config, eval_tasks, {label: path}))
        phases.done(f"evaluation of {label}")
    summary = {
        "results": results,
        "wall_s": round(time.perf_counter() - started, 1),
        "run_dir": run.location,
        "rl_vs_sft": compare(results["sft"], results["rl"]),
        "phases_s": phases.seconds,
        "sft_tensor_hash": sft_hash,
    }
    run.write("results.json", json.dumps(summary, indent=2, sort_keys=True).encode())
    return summary
