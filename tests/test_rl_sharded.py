"""Sharded training on 2 CPU ranks (gloo): expert parallelism equals the unsharded MoE layer, an FSDP2 step
equals the single-process step, DCP checkpoints resume exactly and consolidate to loadable checkpoints.

Each test spawns 2 processes (`torch.multiprocessing.spawn`, a file store); the rank functions assert
themselves, so a failed comparison in either rank fails the test with its traceback."""

import random

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from codefleet.model.config import ModelConfig
from codefleet.model.expert_parallel import ExpertParallelMoE
from codefleet.model.moe import MoE

TOL = 1e-5


def _spawn(fn, tmp_path, *args) -> None:
    """Run `fn(rank, *args)` on 2 gloo ranks and wait for both."""
    store = str(tmp_path / f"store-{random.randrange(1 << 30)}")
    mp.spawn(_entry, args=(fn, store, args), nprocs=2, join=True)


def _entry(rank: int, fn, store: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


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
