"""Sharded training on 2 CPU ranks (gloo): expert parallelism equals the unsharded MoE layer, an FSDP2 step
equals the single-process step, DCP checkpoints resume exactly and consolidate to loadable checkpoints.

Each test spawns 2 processes (`torch.multiprocessing.spawn`, a file store); the rank functions assert
themselves, so a failed comparison in either rank fails the test with its traceback."""

import copy
import os
import random
import signal
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from codefleet.contracts import TRAINERS
from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.expert_parallel import ExpertParallelMoE
from codefleet.model.moe import MoE
from codefleet.model.transformer import Transformer
from codefleet.rl.batch import Sample
from codefleet.rl.logprobs import forward_logprobs
from codefleet.rl.losses import LossConfig
from codefleet.rl.sharded import ShardedTrainer, consolidate
from codefleet.rl.trainer import TrainConfig, Trainer, sft_units

TOL = 1e-5


def _spawn(fn, tmp_path, *args) -> None:
    """Run `fn(rank, *args)` on 2 gloo ranks and wait for both."""
    store = str(tmp_path / f"store-{random.randrange(1 << 30)}")
    mp.spawn(_entry, args=(fn, store, args), nprocs=2, join=True)


def _entry(rank: int, fn, store: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )  # a test that desynchronises fails instead of hanging
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()
    # The rank's work is done and checked (a failure raised above). What is left is the interpreter's exit, in
    # which torch's C++ teardown aborted one run in about five here ("terminate called without an active
    # exception", after both ranks had destroyed their group): leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Within TOL, relative to the larger of 1 and the reference's largest entry (sums over ranks add in
    another order)."""
    err = (a - b).abs().max().item() if a.numel() else 0.0
    scale = max(1.0, b.abs().max().item() if b.numel() else 0.0)
    assert err <= TOL * scale, f"{what}: max abs difference {err:.2e} > {TOL} x {scale:.2f}"


# ---- expert parallelism --------------------------------------------------------------------------------


def _ep_rank(rank: int) -> None:
    for replay, shared in [("none", 1), ("random", 0), ("one-rank", 1)]:
        _ep_case(rank, replay, shared)


def _ep_case(rank: int, replay: str, shared: int) -> None:
    torch.manual_seed(0)
    cfg = ModelConfig.tiny(d_model=32, n_experts=8, top_k=2, d_expert=16, n_shared_experts=shared, d_shared=24)
    moe = MoE(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    N = 24
    x_ND = torch.randn(2 * N, cfg.d_model)
    g_ND = torch.randn(2 * N, cfg.d_model)
    replay_NK = None
    if replay == "random":
        replay_NK = torch.rand(2 * N, cfg.n_experts).topk(cfg.top_k).indices
    elif replay == "one-rank":  # every slot on rank 0's experts: rank 1 receives nothing
        replay_NK = torch.rand(2 * N, cfg.n_experts // 2).topk(cfg.top_k).indices
    ep = ExpertParallelMoE.from_moe(moe)
    # the unsharded layer on the whole batch
    x_ref = x_ND.clone().requires_grad_()
    ref = moe(x_ref, replay_NK)
    (ref.y_ND * g_ND).sum().backward()
    # this rank's half of the tokens through the EP layer
    half = slice(rank * N, (rank + 1) * N)
    x_ep = x_ND[half].clone().requires_grad_()
    out = ep(x_ep, None if replay_NK is None else replay_NK[half])
    (out.y_ND * g_ND[half]).sum().backward()
    assert torch.equal(out.experts_NK, ref.experts_NK[half])
    _close(out.y_ND, ref.y_ND[half], "forward")
    _close(x_ep.grad, x_ref.grad[half], "input gradient")
    e0, e1 = ep.expert_range
    for name in ("w_gate_up_EDG", "w_down_EFD"):  # the owner's gradient already covers every rank's tokens
        grad = getattr(ep, name).grad  # None where no slot came to this rank (then the reference's is 0)
        _close(torch.zeros_like(getattr(ep, name)) if grad is None else grad, getattr(moe, name).grad[e0:e1], name)
    replicated = {n: p for n, p in ep.named_parameters() if not n.startswith("w_")}
    assert replicated and ("shared.up.weight" in replicated) == bool(shared)
    for name, p in replicated.items():  # router / shared: data-parallel, summed across ranks
        dist.all_reduce(p.grad)
        _close(p.grad, dict(moe.named_parameters())[name].grad, name)


def test_expert_parallel_equals_unsharded_moe(tmp_path):
    """Forward, input and weight gradients of the EP=2 layer equal the unsharded layer's: routed by the router,
    replaying random routing (R3), and replaying routing that sends every slot to one rank."""
    _spawn(_ep_rank, tmp_path)


# ---- the FSDP2 trainer -----------------------------------------------------------------------------------


def _cfg(**overrides) -> ModelConfig:
    # router losses off: they are per-micro-batch statistics, so only CE / policy gradients are batch-invariant
    base = dict(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        n_experts=4,
        top_k=2,
        d_expert=16,
        n_shared_experts=1,
        d_shared=16,
        max_seq_len=64,
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
    )
    return ModelConfig.tiny(**{**base, **overrides})


def _examples(n: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [rng.randrange(1, 64) for _ in range(rng.randrange(3, 9))]
        out.append((prompt + prompt, [0] * len(prompt) + [1] * len(prompt)))
    return out


def _samples(model: Transformer, n: int, seed: int = 0) -> list[Sample]:
    """RL samples with the model's own logprobs as behaviour and its own routing (for R3)."""
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
        out.append(Sample(tokens, mask, [x * 1.01 for x in lp], 1.0 if i % 2 else -0.5, per_token))
    return out


def _same_weights(got: dict, expected: dict, what: str) -> None:
    assert got.keys() == expected.keys(), f"{what}: different tensors"
    for k in expected:
        _close(got[k], expected[k], f"{what}: {k}")


def _fsdp_step_rank(rank: int) -> None:
    for backend, loss in [
        ("fsdp2", LossConfig(off_policy="decoupled")),
        ("fsdp2_ep", LossConfig(off_policy="tis")),
        ("fsdp2", LossConfig(kl_coef=0.5)),
        ("fsdp2_ep", LossConfig(kl_coef=0.5)),
    ]:
        _fsdp_step_case(rank, TRAINERS.get(backend), loss)


def _fsdp_step_case(rank: int, trainer_class, loss: LossConfig) -> None:
    """Two steps (SFT, then RL with routing replay and an off-policy correction or a KL reference) on unequal
    halves of the batch, with different micro-batch counts per rank, equal the single-process steps on the
    whole batch."""
    cfg = TrainConfig(lr=1e-2, micro_batch_tokens=24, loss=loss)
    torch.manual_seed(0)
    single = Trainer(Transformer(_cfg()), cfg)
    sharded = trainer_class(copy.deepcopy(single.model), cfg)
    local_experts = [p.shape[0] for p in sharded.experts.values()]
    assert local_experts == ([2, 2] * 2 if trainer_class.expert_parallel else []), local_experts  # 4 experts, 2 here
    examples = _examples(6)
    cut_ex, cut_s = (slice(0, 4), slice(0, 4)) if rank == 0 else (slice(4, 6), slice(4, 5))  # rank 1: fewer
    single.forward_backward_sft(examples)
    sharded.forward_backward_sft(examples[cut_ex], total_tokens=sft_units(examples))
    _same_step(sharded, single, "the SFT step")
    samples = _samples(single.model, 5, seed=1)
    ref = single.forward_backward_rl(samples)
    got = sharded.forward_backward_rl(samples[cut_s])  # total_tokens: summed across the ranks
    assert got["routing_replay_frac"] == 1.0
    total = torch.tensor([got["loss"]])
    dist.all_reduce(total)
    assert abs(float(total) - ref["loss"]) < TOL, (float(total), ref["loss"])
    _same_step(sharded, single, "the RL step")


def _same_step(sharded: ShardedTrainer, single: Trainer, what: str) -> None:
    """The gradient norms (Adam alone would hide a gradient scaled by a constant) and the weights after it."""
    norm, expected = sharded.optim_step()["grad_norm"], single.optim_step()["grad_norm"]
    assert abs(norm - expected) <= TOL * max(1.0, expected), f"{what}: gradient norm {norm} != {expected}"
    _same_weights(sharded.weights(), single.weights(), f"after {what}")


def test_fsdp2_step_equals_single_process_step(tmp_path):
    """FSDP2 alone ("fsdp2") and with the experts split across the ranks ("fsdp2_ep"), each also with a KL
    reference."""
    _spawn(_fsdp_step_rank, tmp_path)


# ---- sharded checkpoints -------------------------------------------------------------------------------

CKPT_CFG = TrainConfig(lr=1e-2, micro_batch_tokens=24)


def _sft_step(trainer: ShardedTrainer, rank: int, seed: int) -> None:
    examples = _examples(6, seed=seed)
    trainer.forward_backward_sft(examples[rank::2], total_tokens=sft_units(examples))
    trainer.optim_step()


def _save_then_die_rank(rank: int, backend: str, start: str | None, ckpt: str, record: str) -> None:
    """Step, save, record the saved weights and the next step's, then rank 1 is SIGKILLed."""
    if start is None:
        torch.manual_seed(0)
        trainer = TRAINERS.get(backend)(Transformer(_cfg(balance="bias", n_experts=8)), CKPT_CFG)
    else:
        trainer = TRAINERS.get(backend).load(start, CKPT_CFG)
    _sft_step(trainer, rank, seed=1)
    trainer.save(ckpt)
    saved = trainer.weights()
    _sft_step(trainer, rank, seed=2)
    after = trainer.weights()  # a collective, like every trainer call
    if rank == 0:
        torch.save({"saved": saved, "next": after}, record)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)


def _resume_rank(rank: int, backend: str, ckpt: str, record: str) -> None:
    expected = torch.load(record)
    trainer = TRAINERS.get(backend).load(ckpt, CKPT_CFG)
    assert trainer.version == 1
    _same_weights(trainer.weights(), expected["saved"], "resumed")
    _sft_step(trainer, rank, seed=2)
    got = trainer.weights()
    for k, v in expected["next"].items():  # same shards, same optimizer state, same data: bit-identical
        assert torch.equal(got[k], v), f"the step after resuming differs in {k}"


def _run_until_killed(tmp_path, *args) -> None:
    with pytest.raises(mp.ProcessExitedException, match="SIGKILL"):
        _spawn(_save_then_die_rank, tmp_path, *args)


def test_sharded_checkpoint_resumes_after_sigkill_and_consolidates(tmp_path):
    """With expert parallelism too ("fsdp2_ep"): the experts and their Adam moments are saved as row blocks."""
    ckpt, record = str(tmp_path / "ckpt"), str(tmp_path / "record.pt")
    _run_until_killed(tmp_path, "fsdp2_ep", None, ckpt, record)
    _spawn(_resume_rank, tmp_path, "fsdp2_ep", ckpt, record)  # fresh processes
    out = consolidate(ckpt, str(tmp_path / "whole"))
    expected = torch.load(record)["saved"]
    _same_weights(checkpoint.load(out).state_dict(), expected, "consolidated")
    assert checkpoint.read_metadata(out)["policy_version"] == 1


def _reference_round_trip_rank(rank: int, ckpt: str) -> None:
    cfg = TrainConfig(lr=1e-2, micro_batch_tokens=24, loss=LossConfig(kl_coef=0.5))
    torch.manual_seed(0)
    trainer = TRAINERS.get("fsdp2_ep")(Transformer(_cfg(n_experts=8)), cfg)
    reference = trainer._full_state(trainer.reference)
    _sft_step(trainer, rank, seed=1)  # the policy moves away from the reference
    trainer.save(ckpt)
    torch.manual_seed(1)  # the resumed trainer starts from other random weights
    resumed = TRAINERS.get("fsdp2_ep").load(ckpt, cfg)
    _same_weights(resumed._full_state(resumed.reference), reference, "the resumed KL reference")
    _same_weights(resumed.weights(), trainer.weights(), "the resumed policy")
    assert not torch.equal(resumed.weights()["layers.0.ffn.w_down_EFD"], reference["layers.0.ffn.w_down_EFD"])


def test_a_kl_reference_under_expert_parallelism_saves_and_resumes(tmp_path):
    _spawn(_reference_round_trip_rank, tmp_path, str(tmp_path / "ckpt"))


def test_hf_checkpoint_trains_sharded_and_consolidates_to_hf(tmp_path):
    """Start from a tiny Qwen3-MoE HF directory; the consolidated result loads in codefleet and transformers."""
    transformers = pytest.importorskip("transformers")
    from codefleet.bench.tiny_hf import make_tiny_hf

    hf_dir = make_tiny_hf(str(tmp_path / "hf"), arch="qwen3_moe")
    ckpt, record = str(tmp_path / "ckpt"), str(tmp_path / "record.pt")
    _run_until_killed(tmp_path, "fsdp2", hf_dir, ckpt, record)
    out = consolidate(ckpt, str(tmp_path / "hf-out"))
    expected = torch.load(record)["saved"]
    ours = checkpoint.load(out)
    _same_weights(ours.state_dict(), expected, "consolidated HF")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens_1T = torch.tensor([[5, 9, 14, 3, 27, 8, 11]])
    with torch.no_grad():
        _close(theirs(tokens_1T).logits, ours(tokens_1T).logits_BTV, "transformers' logits vs ours")
