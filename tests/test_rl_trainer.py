"""The pure trainer on a tiny MoE: micro-batching and sharding give the one-batch gradient, SFT learns,
save -> load resumes bit-identically, an RL step with routing replay moves the weights."""

import dataclasses
import random

import pytest
import torch

from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.rl.batch import Sample
from codefleet.rl.losses import LossConfig
from codefleet.rl.trainer import TrainConfig, Trainer, loss_units, pack, sft_units


def _cfg(**overrides) -> ModelConfig:
    # router losses off: they are per-micro-batch statistics, so only the policy/CE gradient is exactly batch-invariant
    base = dict(
        vocab_size=64,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        n_experts=4,
        top_k=2,
        d_expert=32,
        max_seq_len=128,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
    )
    return ModelConfig.tiny(**{**base, **overrides})


def _model(seed: int = 0, **overrides) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(_cfg(**overrides))


def _examples(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """Prompt (mask 0) then an answer (mask 1) that repeats the prompt: learnable, varied lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(3, 9))]
        out.append((prompt + prompt, [0] * len(prompt) + [1] * len(prompt)))
    return out


def _samples(model: Transformer, n: int, seed: int = 0, routing: bool = True) -> list[Sample]:
    """RL samples with the model's own logprobs as behaviour and (optionally) its own routing."""
    from codefleet.rl.logprobs import forward_logprobs

    rng = random.Random(seed)
    out = []
    for i in range(n):
        tokens = [rng.randrange(1, 64) for _ in range(rng.randrange(4, 12))]
        mask = [0, 0] + [1] * (len(tokens) - 2)
        with torch.no_grad():
            tokens_1T = torch.tensor([tokens])
            lp = forward_logprobs(model.eval(), tokens_1T, torch.tensor([mask])).logprobs_BT[0].tolist()
            routed = model(tokens_1T, return_routing=True).routed_experts
        model.train()
        per_token = [[e for layer in routed for e in layer[0, t].tolist()] for t in range(len(tokens))]
        out.append(Sample(tokens, mask, lp, 1.0 if i % 2 else -1.0, per_token if routing else None))
    return out


def _grads(trainer: Trainer) -> list[torch.Tensor]:
    return [g.clone() for g in trainer.gradients()]


def test_pack_and_units_by_hand():
    assert pack([3, 5, 2, 5], max_tokens=10) == [[1, 3], [0, 2]]  # 2 x 5, then 2 x 3
    assert pack([20, 1], max_tokens=8) == [[0], [1]]  # too long: alone
    # one long row and four short ones: greedy would pad a 2 into the 10's micro-batch (20 + 6 + 2 x 3 = 32);
    # the short rows together cost 10 + 3 + 8 + 3 = 24
    assert pack([10, 2, 2, 2, 2], max_tokens=20, overhead=3) == [[0], [1, 2, 3, 4]]
    assert pack([4, 3], max_tokens=100, overhead=0) == [[0], [1]]  # no overhead: no padding at all
    assert pack([4, 3], max_tokens=100, overhead=2) == [[0, 1]]  # 8 + 2 beats 4 + 3 + 2 x 2
    assert sft_units([([1, 2, 3], [1, 1, 0]), ([4, 5], [0, 1])]) == 2  # the first token predicts nothing
    s = [Sample([1, 2, 3], [0, 1, 1], [0.0] * 3, 1.0), Sample([1, 2], [0, 0], [0.0] * 2, 1.0)]
    assert loss_units(s, LossConfig()) == 2
    assert loss_units(s, LossConfig(reduction="seq_mean")) == 2
    assert loss_units(s, LossConfig(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4)) == 1


def test_sft_micro_batches_and_shards_give_the_one_batch_gradient():
    examples = _examples(6)
    one = Trainer(_model(), TrainConfig(micro_batch_tokens=10_000))
    full = one.forward_backward_sft(examples)
    micro = Trainer(_model(), TrainConfig(micro_batch_tokens=20))
    m = micro.forward_backward_sft(examples)
    assert m["micro_batches"] > 3 and full["micro_batches"] == 1
    assert m["loss"] == pytest.approx(full["loss"], abs=1e-5)
    assert m["ce"] == pytest.approx(full["ce"], abs=1e-5)
    for a, b in zip(_grads(one), _grads(micro)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # two "ranks", each with half the batch and the whole step's token count: their sum is the full gradient
    total = sft_units(examples)
    halves = [Trainer(_model(), TrainConfig()) for _ in range(2)]
    halves[0].forward_backward_sft(examples[:2], total_tokens=total)
    halves[1].forward_backward_sft(examples[2:], total_tokens=total)
    for a, g0, g1 in zip(_grads(one), _grads(halves[0]), _grads(halves[1])):
        torch.testing.assert_close(a, g0 + g1, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="whole step"):
        halves[0].forward_backward_sft(examples, total_tokens=1)
    idle = Trainer(_model(), TrainConfig())  # a rank whose shard is empty still joins the sum, with zeros
    assert idle.forward_backward_sft([], total_tokens=total)["loss"] == 0.0
    assert all(not g.any() for g in idle.gradients())


@pytest.mark.parametrize(
    "loss",
    [
        LossConfig(),
        LossConfig(reduction="seq_mean"),
        LossConfig(ratio_level="sequence", eps_low=3e-4, eps_high=4e-4),
        LossConfig(off_policy="decoupled", kl_coef=0.1),
    ],
    ids=["token", "seq", "gspo", "decoupled_kl"],
)
def test_rl_micro_batches_give_the_one_batch_gradient(loss):
    samples = _samples(_model(), 6)
    for i, s in enumerate(samples):  # advantages that do not cancel: the loss at ratio 1 is not exactly 0
        s.advantage = 1.0 if i % 3 else -0.5
    one = Trainer(_model(), TrainConfig(loss=loss, micro_batch_tokens=10_000))
    full = one.forward_backward_rl(samples)
    micro = Trainer(_model(), TrainConfig(loss=loss, micro_batch_tokens=24))
    m = micro.forward_backward_rl(samples)
    assert m["micro_batches"] >= 3 and m["routing_replay_frac"] == 1.0
    assert m["loss"] == pytest.approx(full["loss"], abs=1e-5)
    assert full["loss"] != 0.0
    for a, b in zip(_grads(one), _grads(micro)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_sft_loss_decreases_and_version_counts_steps():
    examples = _examples(8)
    trainer = Trainer(_model(), TrainConfig(lr=3e-3))
    losses = []
    for step in range(6):
        losses.append(trainer.forward_backward_sft(examples)["loss"])
        out = trainer.optim_step()
        assert out["version"] == step + 1 and out["grad_norm"] > 0
    assert trainer.version == 6
    assert losses[-1] < losses[0] - 0.3, losses
    with pytest.raises(RuntimeError, match="forward_backward"):
        trainer.optim_step()  # no gradients since the last step


def test_save_load_resumes_bit_identically(tmp_path):
    examples = _examples(4)
    cfg = TrainConfig(lr=3e-3, loss=LossConfig(kl_coef=0.05))
    a = Trainer(_model(balance="bias"), cfg)
    for _ in range(2):
        a.forward_backward_sft(examples)
        a.optim_step()
    a.save(str(tmp_path / "ckpt"))
    a.save(str(tmp_path / "ckpt"))  # overwrite an existing checkpoint
    b = Trainer.load(str(tmp_path / "ckpt"), cfg)
    assert b.version == a.version == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temporary directories left
    losses: dict[str, list[float]] = {"a": [], "b": []}
    for name, trainer in (("a", a), ("b", b)):
        for _ in range(2):  # the second step depends on the restored AdamW moments
            losses[name].append(trainer.forward_backward_sft(examples)["loss"])
            trainer.optim_step()
    assert losses["a"] == losses["b"]  # bit-identical
    for (k, va), vb in zip(a.weights().items(), b.weights().values()):
        assert torch.equal(va, vb), k
    for pa, pb in zip(a.reference.parameters(), b.reference.parameters()):  # the KL reference survives
        assert torch.equal(pa, pb)


def test_rl_step_with_routing_replay_uses_the_engine_routing_and_changes_weights():
    model = _model()
    samples = _samples(model, 4)
    cfg = TrainConfig(lr=1e-2)
    replay = Trainer(_model(), cfg).forward_backward_rl(samples)
    plain = Trainer(_model(), dataclasses.replace(cfg, routing_replay=False)).forward_backward_rl(samples)
    assert replay["routing_replay_frac"] == 1.0 and plain["routing_replay_frac"] == 0.0
    assert replay["loss"] == pytest.approx(plain["loss"], abs=1e-6)  # the recorded routing is the model's own
    swapped = [
        dataclasses.replace(s, routed_experts=[[3 - e for e in row] for row in s.routed_experts]) for s in samples
    ]
    assert Trainer(_model(), cfg).forward_backward_rl(swapped)["loss"] != pytest.approx(replay["loss"], abs=1e-4)

    trainer = Trainer(_model(), cfg)
    before = trainer.weights()
    m = trainer.forward_backward_rl(samples)
    assert m["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # on-policy first step
    trainer.optim_step()
    after = trainer.weights()
    assert trainer.version == 1
    assert not torch.equal(before["layers.1.ffn.w_gate_up_EDG"], after["layers.1.ffn.w_gate_up_EDG"])
    lp_before = _samples(_model(), 4)  # behaviour logprobs under the initial weights
    lp_after = _samples(trainer.model, 4)
    # the sequences with positive advantage became more likely, those with negative less
    for s0, s1 in zip(lp_before, lp_after):
        delta = sum(s1.behave_logprobs) - sum(s0.behave_logprobs)
        assert delta * s0.advantage > 0, (s0.advantage, delta)


def test_the_learning_rate_schedule_warms_up_then_decays_by_step():
    from codefleet.rl.trainer import TrainConfig

    c = TrainConfig(lr=1.0, warmup_steps=4, decay_steps=14, min_lr_ratio=0.1)
    assert [c.lr_at(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert c.lr_at(4) == 1.0 and abs(c.lr_at(9) - 0.55) < 1e-9 and abs(c.lr_at(14) - 0.1) < 1e-9
    assert c.lr_at(100) == c.lr_at(14)
    assert TrainConfig(lr=0.5).lr_at(1000) == 0.5


def test_rl_starts_at_version_0_with_the_sft_optimizer(tmp_path):
    from codefleet.recipe.train_rl import _rl_start

    sft = Trainer(_model(), TrainConfig(lr=3e-3))
    for _ in range(2):
        sft.forward_backward_sft(_examples(4))
        sft.optim_step()
    sft.save(str(tmp_path / "sft"))
    start = Trainer.load(_rl_start(str(tmp_path / "sft"), str(tmp_path / "rl-start")), TrainConfig(lr=1e-4))
    assert start.version == 0
    for (k, va), vb in zip(sft.weights().items(), start.weights().values()):
        assert torch.equal(va, vb), k
    moments = [s for s in start.optimizer.state_dict()["state"].values()]
    # SFT's AdamW moments, so RL's first update is not a ±lr step for every weight
    assert moments and all(float(s["step"]) == 2 for s in moments)
