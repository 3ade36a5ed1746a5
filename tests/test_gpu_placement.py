"""GPUs for the engine and trainer actors (fleet.gpus), on the shared Ray session, which has no GPU: what the
actors ask Ray for, the refusals that replace a hang or a late failure, and that without GPUs the trainer stays
on CPU. The GPU path itself runs in `codefleet bench gpucheck` (scripts/gpu_check.sh)."""

from __future__ import annotations

import pytest
import torch
from test_rl_trainer import _cfg, _model, _samples

from codefleet.fleet.gpus import actor_options
from codefleet.fleet.inference import start_engines
from codefleet.fleet.trainer_group import TrainerGroup
from codefleet.recipe.config import TrainRunConfig, load_train_config
from codefleet.recipe.config_check import check_config
from codefleet.recipe.run_dir import RunError
from codefleet.recipe.train_rl import check_run_gpus
from codefleet.rl.logprobs import forward_logprobs
from codefleet.rl.trainer import TrainConfig, Trainer

CPUS = 0.25  # per worker: other tests share the session's 2 CPUs


def test_actor_options_carry_num_gpus_only_when_asked():
    assert actor_options(1.0, {"engine_node": 1}) == {"num_cpus": 1.0, "resources": {"engine_node": 1}}
    assert actor_options(0.5, None, 0.0) == {"num_cpus": 0.5, "resources": {}}
    assert actor_options(1.0, {"trainer_node": 1}, 0.5) == {
        "num_cpus": 1.0,
        "resources": {"trainer_node": 1},
        "num_gpus": 0.5,
    }
    for bad in (2.0, -0.5):
        with pytest.raises(ValueError, match="one GPU at most"):
            actor_options(1.0, None, bad)


def test_config_fields_reach_the_gpu_check(ray_session):
    config = load_train_config(
        None, ["engine.backend=vllm", "engine.count=4", "engine.gpus=0.5", "trainer.workers=2", "trainer.gpus=1"]
    )
    assert (config.engine.gpus, config.trainer.gpus) == (0.5, 1.0)
    check_config(config)  # a valid layout
    with pytest.raises(
        RunError,
        match=r"asks for 4 GPUs \(4 engines x 0.5 GPU \(2\) \+ 2 trainer workers x 1 GPU "
        r"\(2\)\) but the Ray cluster has 0",
    ):
        check_run_gpus(config)
    check_run_gpus(TrainRunConfig())  # no GPUs asked: nothing to check


def test_config_refuses_gpus_the_backends_cannot_use():
    for overrides, message in (
        (["engine.gpus=1"], "needs engine.backend=vllm"),
        (["trainer.gpus=0.5", "trainer.workers=2"], "NCCL refuses"),
        (["engine.backend=vllm", "engine.gpus=2"], r"must be in \[0, 1\]"),
    ):
        with pytest.raises(RunError, match=message):
            check_config(load_train_config(None, overrides))


def test_the_codefleet_engine_refuses_a_gpu(tmp_path):
    with pytest.raises(ValueError, match="codefleet engine runs on CPU only.*engine.backend=vllm"):
        start_engines(str(tmp_path), 1, backend="codefleet", num_gpus=0.5)


def test_engines_and_trainers_asking_for_missing_gpus_are_refused(ray_session):
    with pytest.raises(ValueError, match=r"asks for 1 GPUs \(2 engines x 0.5 GPU \(1\)\) but the Ray cluster has 0"):
        start_engines("/nonexistent", 2, num_cpus=CPUS, backend="vllm", num_gpus=0.5)
    with pytest.raises(
        ValueError,
        match=r"asks for 1 GPUs \(1 trainer workers x 1 GPU \(1\)\) but the Ray cluster "
        "has 0",
    ):
        TrainerGroup(1, model_config=_cfg(), num_cpus_per_worker=CPUS, num_gpus_per_worker=1.0)
    with pytest.raises(ValueError, match="NCCL refuses two ranks on one GPU"):
        TrainerGroup(2, model_config=_cfg(), num_cpus_per_worker=CPUS, num_gpus_per_worker=0.5)


def test_a_worker_without_a_gpu_trains_on_cpu_and_scores_as_the_trainer(ray_session):
    config = TrainConfig(lr=3e-3, micro_batch_tokens=40)
    group = TrainerGroup(1, model_config=_cfg(), config=config, num_cpus_per_worker=CPUS)
    try:
        assert group.device_info() == [{"device": "cpu", "name": "cpu", "peak_mem_gb": None}]
        torch.manual_seed(config.seed)
        local = Trainer(_model(seed=config.seed), config)  # the worker's initialisation
        samples = _samples(local.model, 5, seed=1)
        got = group.logprobs(samples)
        torch.testing.assert_close(
            torch.tensor(sum(got, [])), torch.tensor(sum(local.logprobs(samples), [])), atol=1e-6, rtol=0
        )
        for s, lps in zip(samples, got):  # aligned with the tokens, 0 where nothing is trained
            tokens_1T, mask_1T = torch.tensor([s.tokens]), torch.tensor([s.loss_mask])
            with torch.no_grad():
                want = forward_logprobs(local.model.eval(), tokens_1T, mask_1T).logprobs_BT[0]
            local.model.train()
            assert len(lps) == len(s.tokens) and lps[:2] == [0.0, 0.0]
            torch.testing.assert_close(torch.tensor(lps), want, atol=1e-6, rtol=0)
    finally:
        group.shutdown()
