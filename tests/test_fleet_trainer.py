"""The data-parallel TrainerGroup on the shared Ray session: two gloo workers take the same step as one
in-process Trainer on the full batch, publish weights an engine serves, save/load, and fail clearly."""

import dataclasses
import json

import pytest
import ray
import torch
from test_rl_trainer import _cfg, _examples, _model, _samples

from codefleet.fleet import TrainerGroup, TrainerWorkerError
from codefleet.fleet.trainer_group import merge_metrics, shard_by_tokens
from codefleet.inference.engine import Engine
from codefleet.inference.sampling import SamplingParams
from codefleet.rl.logprobs import forward_logprobs
from codefleet.rl.trainer import TrainConfig, Trainer
from codefleet.types import TokenSequence, Trajectory

CONFIG = TrainConfig(lr=3e-3, micro_batch_tokens=40)
CPUS = 0.25  # per worker: other tests share the session's 2 CPUs
BIAS = "layers.1.ffn.router.expert_bias_E"  # balance="bias": moved by the expert loads summed over the workers


def _worker_weights(group: TrainerGroup) -> list[dict[str, torch.Tensor]]:
    return [ray.get(w.weights.options(num_returns=2).remote()[1]) for w in group.workers]


def _assert_close(a: dict, b: dict, atol: float) -> None:
    """Weights equal up to atol; the selection bias is left out: the loads it follows count padding tokens,
    and the padding depends on how the batch was split."""
    assert a.keys() == b.keys()
    for k in a:
        if not k.endswith("expert_bias_E"):
            torch.testing.assert_close(a[k], b[k], atol=atol, rtol=0, msg=k)


@pytest.fixture(scope="module")
def group(ray_session):
    g = TrainerGroup(2, model_config=_cfg(balance="bias"), config=CONFIG, num_cpus_per_worker=CPUS)
    yield g
    g.shutdown()


@pytest.fixture(scope="module")
def single():
    """The same model and config in-process, stepped on the same full batches."""
    return Trainer(_model(CONFIG.seed, balance="bias"), CONFIG)


def test_shard_and_merge_by_hand():
    assert shard_by_tokens([5, 1, 4, 3], 2) == [[0, 1], [2, 3]]  # 5+1 vs 4+3
    assert shard_by_tokens([2], 3) == [[0], [], []]
    merged = merge_metrics(
        [
            {"loss": 1.0, "loss_units": 3.0, "ce": 2.0, "version": 4.0},
            {"loss": 0.5, "loss_units": 1.0, "ce": 6.0, "version": 4.0},
        ]
    )
    assert merged["loss"] == 1.5 and merged["loss_units"] == 4.0 and merged["ce"] == 3.0 and merged["version"] == 4.0


def test_two_workers_take_the_one_batch_step(group, single):
    before = single.weights()
    examples = _examples(7, seed=1)
    with pytest.raises(ValueError, match="example 0"):  # validated on the driver; the group stays usable
        group.sft_step([([1], [1])] + examples)
    m = group.sft_step(examples)
    s = single.forward_backward_sft(examples)
    single.optim_step()
    assert group.version == single.version == 1
    assert m["loss"] == pytest.approx(s["loss"], abs=1e-5) and m["tokens"] == s["tokens"]
    w0, w1 = _worker_weights(group)
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k  # both workers applied the same step, and the same bias update
    assert w0[BIAS].abs().max() > 0
    _assert_close(w0, single.weights(), atol=1e-5)
    assert not torch.allclose(w0["embed.weight"], before["embed.weight"], atol=1e-4)

    # another policy's rollouts with its routing: off-policy, and replayed (the selection bias plays no part)
    samples = _samples(_model(3), 5, seed=2)
    m = group.rl_step(samples)
    s = single.forward_backward_rl(samples)
    single.optim_step()
    assert m["routing_replay_frac"] == 1.0 and m["loss"] == pytest.approx(s["loss"], abs=1e-5)
    assert m["version"] == group.version == 2 and m["skipped"] == 0.0
    w0, w1 = _worker_weights(group)
    for k in w0:
        assert torch.equal(w0[k], w1[k]), k
    _assert_close(w0, single.weights(), atol=1e-5)

    # every advantage 0 (groups that all failed): the step is counted, no weight moves (the router losses alone
    # would move every weight a full Adam step)
    flat = [dataclasses.replace(s, advantage=0.0) for s in _samples(_model(3), 4, seed=3)]
    m = group.rl_step(flat)
    assert m["skipped"] == 1.0 and m["grad_norm"] == 0.0 and m["version"] == group.version == 3
    for w in _worker_weights(group):
        for k in w0:
            assert torch.equal(w[k], w0[k]), k
    single.skip_step()

    # nothing sampled at all (every attempt ended before the policy's first turn, as a chaos soak made happen): the
    # same, where it used to stop the run, and a resume would stop again on the same batch
    unsampled = [dataclasses.replace(s, loss_mask=[0] * len(s.loss_mask)) for s in _samples(_model(3), 2, seed=4)]
    m = group.rl_step(unsampled)
    assert m["skipped"] == 1.0 and m["version"] == group.version == 4
    for w in _worker_weights(group):
        for k in w0:
            assert torch.equal(w[k], w0[k]), k
    single.skip_step()


def test_publish_round_trip_to_an_engine(group, single):
    ref, version = group.publish()
    assert version == group.version
    state = ray.get(ref)
    for k, v in _worker_weights(group)[0].items():
        assert torch.equal(state[k], v), k
    again = ray.get(ref)  # zero-copy: both fetches are views of the same object-store buffer
    assert again["embed.weight"].data_ptr() == state["embed.weight"].data_ptr()

    engine = Engine(_model(seed=7).eval(), max_batch=2, max_seq_len=64)  # different weights until the update
    engine.update_weights(state, version)
    prompt = [5, 17, 33, 2]
    result = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert result.versions == [version] * len(result.token_ids)
    tokens = torch.tensor([prompt + result.token_ids])
    with torch.no_grad():
        expected = forward_logprobs(single.model.eval(), tokens).logprobs_BT[0, len(prompt) :]
    single.model.train()
    torch.testing.assert_close(torch.tensor(result.logprobs), expected, atol=1e-3, rtol=0)


def test_save_then_load_and_resume_in_a_new_group(group, tmp_path):
    path = str(tmp_path / "ckpt")
    group.save(path)
    saved, version = _worker_weights(group)[0], group.version
    group.sft_step(_examples(3, seed=5))
    assert group.version == version + 1
    group.load(path)
    assert group.version == version
    for w in _worker_weights(group):
        for k in saved:
            assert torch.equal(w[k], saved[k]), k
    resumed = TrainerGroup(1, checkpoint=path, config=CONFIG, num_cpus_per_worker=CPUS)  # n=1: no torch.distributed
    try:
        assert resumed.version == version
        examples = _examples(4, seed=6)
        assert resumed.sft_step(examples)["loss"] == pytest.approx(group.sft_step(examples)["loss"], abs=1e-5)
        _assert_close(_worker_weights(resumed)[0], _worker_weights(group)[0], atol=1e-5)
    finally:
        resumed.shutdown()


def test_a_killed_worker_raises_a_clear_error(ray_session):
    g = TrainerGroup(2, model_config=_cfg(), config=CONFIG, num_cpus_per_worker=CPUS)
    try:
        ray.kill(g.workers[1], no_restart=True)
        with pytest.raises(TrainerWorkerError, match=r"rank 1 of 2 died.*last checkpoint"):
            g.sft_step(_examples(4))
        with pytest.raises(TrainerWorkerError, match="unusable.*checkpoint"):
            g.publish()
    finally:
        g.shutdown()


def test_needs_weights_from_somewhere(ray_session):
    with pytest.raises(ValueError, match="checkpoint= .*model_config="):
        TrainerGroup(2)


def test_an_attempt_with_no_tokens_is_scored_but_not_trained_on():
    """An attempt that ended before the policy's first turn keeps its reward (in the advantages) but has no
    sequence; a batch holding one must still train on the others rather than fail the step."""
    from codefleet.fleet.staleness import Group, Rollout, Ticket
    from codefleet.recipe.train_rl import training_samples

    def rollout(i, tokens):
        sequence = TokenSequence(
            tokens, [0] + [1] * (len(tokens) - 1) if tokens else [], [0.0] * len(tokens), [-1] * len(tokens)
        )
        return Rollout(f"0/{i}", 0, 0, float(i), Trajectory("t", [], [], "submit", sequence=sequence))

    group = Group(Ticket(0, 0, 1, 3), [rollout(0, [5, 6, 7]), rollout(1, []), rollout(2, [5, 8])])
    samples, empty = training_samples([group], [[-1.0, 0.0, 1.0]])
    assert empty == 1
    assert [s.tokens for s in samples] == [[5, 6, 7], [5, 8]] and [s.advantage for s in samples] == [-1.0, 1.0]


def test_a_trainer_worker_that_dies_mid_run_is_replaced_and_the_step_redone(ray_session, tmp_path):
    """RL's trainer (train_rl.RLTrainer over fleet.policy_actors.PolicyActors) on real actors: a worker killed
    before a step is an infrastructure failure; a new group starts from the last commit, the same batch is trained
    once, committed and published."""
    from codefleet.chat.tokenizer import default_tokenizer
    from codefleet.fleet.controller import Controller, ControllerConfig
    from codefleet.fleet.inference import start_engines
    from codefleet.fleet.policy_actors import PolicyActors
    from codefleet.fleet.staleness import Group, Rollout
    from codefleet.model import checkpoint
    from codefleet.recipe.config import TrainRunConfig
    from codefleet.recipe.run_dir import Metrics, RunDir
    from codefleet.recipe.train_rl import RLTrainer
    from codefleet.types import Trajectory

    model = _model(vocab_size=default_tokenizer().vocab_size)
    start = str(tmp_path / "run" / "checkpoints" / "rl-start")
    checkpoint.save(model, start)
    run, made = RunDir(str(tmp_path / "run")), []

    def new_group(ckpt):
        made.append(TrainerGroup(1, checkpoint=ckpt, config=CONFIG, num_cpus_per_worker=CPUS))
        return made[-1]

    engines = start_engines(start, 1, num_cpus=0, max_batch=2)
    metrics = Metrics(run)
    config, lines = TrainRunConfig(), []
    actors = PolicyActors(
        new_group(start),
        engines,
        new_group=new_group,
        weight_sync=config.weight_sync.method,
        bucket_mb=config.weight_sync.bucket_mb,
        engine_wait_s=config.engine.wait_s,
        colocated=False,
        log=lines.append,
    )
    trainer = RLTrainer(actors, run, metrics, config, start=start)
    controller = Controller(
        ControllerConfig(eta=1, rollout_slots=2, batch_groups=1, group_size=2), None, trainer, iter(())
    )
    ticket = controller.admission.try_admit(0)
    rollouts = [
        Rollout(
            f"0/{i}",
            0,
            0,
            float(i),
            Trajectory(
                "t",
                [],
                [],
                "submit",
                reward=float(i),
                sequence=TokenSequence(s.tokens, s.loss_mask, s.behave_logprobs, [0] * len(s.tokens), s.routed_experts),
            ),
        )
        for i, s in enumerate(_samples(model, 2))
    ]
    controller.buffer.put(Group(ticket, rollouts))
    batch = controller.buffer.take_batch(1, 0)
    try:
        ray.kill(actors.group.workers[0], no_restart=True)
        m = trainer.train(batch)
        assert len(made) == 2 and actors.group is made[1] and actors.group.version == 1
        assert any("starting a new trainer group from" in line and "redo step 0" in line for line in lines), lines
        assert m["rollouts"] == 2 and run.latest()[:2] == (run.rl_checkpoint(1), 1)
        with open(run.path("trained", "step-000001.json")) as f:
            assert json.load(f) == ["0/0", "0/1"]
        assert ray.get(engines[0].info.remote())["version"] == 1
        assert run.latest()[2]["consumed_ids"] == ["0/0", "0/1"]  # the buffer's state, this batch consumed
    finally:
        metrics.close()
        for g in made:
            g.shutdown()
        ray.kill(engines[0], no_restart=True)
