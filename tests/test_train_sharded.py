"""The sharded trainer (rl.sharded, TRAINERS "fsdp2_ep") behind `TrainerGroup` and `codefleet train`.

Fast: a 2-worker group steps like one in-process `Trainer` on the whole batch, publishes the same weights whole
and in buckets, saves a normal checkpoint (its DCP shards beside) and resumes from it exactly.
Slow: `codefleet train` from a tiny Qwen3-MoE Hugging Face directory with `trainer.backend=fsdp2_ep`,
SFT then RL with bucketed weight sync, against the same run with the "dp" trainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import ray
import torch
from test_rl_trainer import _cfg, _examples, _model, _samples

from codefleet.fleet import TrainerGroup
from codefleet.fleet.trainer_worker import SHARDED_STATE
from codefleet.fleet.weight_sync import BucketReceiver
from codefleet.model import checkpoint
from codefleet.rl.trainer import TrainConfig, Trainer

CONFIG = TrainConfig(lr=3e-3, micro_batch_tokens=40)
BACKEND = "fsdp2_ep"
TOL = 1e-5


def _assert_close(a: dict, b: dict, atol: float = TOL) -> None:
    assert a.keys() == b.keys()
    worst, name = max((float((a[k].float() - b[k].float()).abs().max()), k) for k in a)
    assert worst <= atol, (name, worst)


def _bucketed(group: TrainerGroup) -> dict[str, torch.Tensor]:
    buckets = group.publish_buckets(bucket_mb=0.01)  # many small buckets, tensors cut across them
    receiver = BucketReceiver()
    receiver.begin(buckets.plans)
    for plan, refs in zip(buckets.plans, buckets.refs):
        for bucket, ref in zip(plan.buckets, refs):
            receiver.add(bucket, ray.get(ref))
    return {k: v.clone() for k, v in receiver.state_dict().items()}


def test_a_sharded_group_steps_publishes_saves_and_resumes_like_the_dp_trainer(ray_session, tmp_path):
    single = Trainer(_model(CONFIG.seed, balance="aux"), TrainConfig(lr=3e-3, micro_batch_tokens=40))
    group = TrainerGroup(2, model_config=_cfg(balance="aux"), config=CONFIG, num_cpus_per_worker=0.25, backend=BACKEND)
    try:
        examples, samples = _examples(6, seed=1), _samples(single.model, 6, seed=2)
        m = group.sft_step(examples)
        single.forward_backward(examples, "sft")
        single.optim_step()
        group.rl_step(samples)
        single.forward_backward(samples, "rl")
        expected = single.optim_step()
        assert group.version == 2 and abs(m["tokens"] - sum(sum(mask[1:]) for _, mask in examples)) == 0
        ref, version = group.publish()
        assert version == 2
        whole = {k: v.clone() for k, v in ray.get(ref).items()}
        _assert_close(whole, single.weights())
        _assert_close(_bucketed(group), whole, atol=0)

        path = str(tmp_path / "ckpt")
        group.save(path)
        assert os.path.isdir(os.path.join(path, SHARDED_STATE))
        assert checkpoint.read_metadata(path)["policy_version"] == 2
        _assert_close(checkpoint.load(path).state_dict(), whole, atol=0)

        more = _samples(single.model, 4, seed=3)
        after = group.rl_step(more)
        resumed = TrainerGroup(2, checkpoint=path, config=CONFIG, num_cpus_per_worker=0.25, backend=BACKEND)
        try:
            assert resumed.version == 2
            again = resumed.rl_step(more)
            assert again["grad_norm"] == pytest.approx(after["grad_norm"], abs=TOL)
            _assert_close(ray.get(resumed.publish()[0]), ray.get(group.publish()[0]), atol=0)
        finally:
            resumed.shutdown()
        assert expected["version"] == 2.0
    finally:
        group.shutdown()


def test_the_run_config_names_a_trainer_backend_and_a_weight_sync_that_exist():
    from codefleet.config import from_dict
    from codefleet.recipe.config import TrainRunConfig
    from codefleet.recipe.config_check import check_config
    from codefleet.recipe.train import RunError

    def config(backend: str = "dp", weight_sync: str = "whole"):
        sections = {"trainer": {"backend": backend}, "weight_sync": {"method": weight_sync}}
        return from_dict(TrainRunConfig, {**sections, "rl": {"loss": {"kl_coef": 0.0}}})

    for backend in ("dp", "fsdp2", "fsdp2_ep"):
        check_config(config(backend, weight_sync="buckets"))
    with pytest.raises(RunError, match="trainer.backend must be one of .*fsdp2_ep"):
        check_config(config("fsdp3"))
    with pytest.raises(RunError, match="weight_sync.method must be whole, buckets or collective"):
        check_config(config(weight_sync="pieces"))
    with_kl = config("fsdp2_ep")
    with_kl.rl.loss.kl_coef = 0.05
    check_config(with_kl)  # the KL reference is sharded and saved like the policy


# ---- codefleet train end to end --------------------------------------------------------------

TINY = [
    "tasks.n_train=3",
    "tasks.n_eval=1",
    "tasks.families=[config]",
    "sft.epochs=1",
    "sft.batch_size=3",
    "rl.steps=3",
    "controller.group_size=2",
    "controller.batch_groups=1",
    "controller.rollout_slots=2",
    "rl.max_tokens=24",
    "rl.max_turns=2",
    "eval.max_tokens=24",
    "eval.attempts=1",
    "cluster.num_cpus=4",
    "model.prompt=full",
    "model.max_seq_len=4096",
    "rl.loss.kl_coef=0.05",
    "trainer.workers=2",
    "sft.workers=2",
    "weight_sync.method=buckets",
    "weight_sync.bucket_mb=1",
    "controller.eta=0",  # nothing lags: the engine/trainer logprob gap is numerics alone
    "rl.reward.costs_on=all",
    "rl.reward.cost_per_s=0.01",
]  # unsolved attempts differ too: steps train
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _train(out: str, init: str, backend: str, *more: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "codefleet.cli",
            "train",
            "--out",
            out,
            "--no-progress",
            f"model.init={init}",
            *TINY,
            f"trainer.backend={backend}",
            *more,
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=800,
    )
    assert done.returncode == 0, (backend, done.stderr[-3000:])
    return time.perf_counter() - started


def _metrics(out: str, stage: str) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if r["stage"] == stage]


@pytest.mark.slow
@pytest.mark.timeout(900)  # about 75 s on 2 cores (both runs)
def test_codefleet_train_with_the_expert_parallel_trainer_matches_the_dp_trainer(tmp_path):
    from transformers import AutoModelForCausalLM  # optional heavy dependency

    from codefleet.bench.tiny_hf import make_tiny_hf

    init = make_tiny_hf(str(tmp_path / "tiny"), arch="qwen3_moe")
    runs = {b: str(tmp_path / b) for b in ("fsdp2_ep", "dp")}
    # the expert-parallel run also colocates its 2 ranks with 2 engines (fleet.placement): they take turns
    more = {"fsdp2_ep": ["placement.layout=colocated", "engine.count=2"], "dp": []}
    took = {b: _train(out, init, b, *more[b]) for b, out in runs.items()}
    print("wall s per run:", took)
    sft = {b: _metrics(out, "sft") for b, out in runs.items()}  # the same data from the same weights: one loss
    assert [r["loss"] for r in sft["fsdp2_ep"]] == pytest.approx([r["loss"] for r in sft["dp"]], abs=1e-4)
    rl = {b: _metrics(out, "rl") for b, out in runs.items()}
    for b, rows in rl.items():
        assert [int(r["step"]) for r in rows] == [1, 2, 3] and not any(r["skipped"] for r in rows), (b, rows)
        assert all(r["routing_replay_frac"] == 1.0 for r in rows), (b, rows)
        assert all(r["lag_max"] == 0 for r in rows), (b, rows)
        # exp(trainer - engine logprob) on the sampled tokens (tis): 1 up to numerics when nothing lags
        assert all(abs(r["is_weight_mean"] - 1) <= 1e-4 for r in rows), (b, [r["is_weight_mean"] for r in rows])
    print("is_weight_mean:", {b: [r["is_weight_mean"] for r in rows] for b, rows in rl.items()})
    assert all(r["engines_asleep_s"] > 0 for r in rl["fsdp2_ep"]) and "engines_asleep_s" not in rl["dp"][0]
    for name in ("sft", "rl-step-000003"):  # older RL checkpoints are pruned
        path = os.path.join(runs["fsdp2_ep"], "checkpoints", name)
        AutoModelForCausalLM.from_pretrained(path)
        assert os.path.isdir(os.path.join(path, SHARDED_STATE))
    assert checkpoint.read_metadata(path)["policy_version"] == 3
    with open(os.path.join(runs["fsdp2_ep"], "results.json")) as f:
        assert "rl" in json.load(f)["results"]
