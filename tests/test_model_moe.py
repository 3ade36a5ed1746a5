"""The MoE layer against a naive per-token loop, routing replay, losses by hand, balancing, sharding; its
inference dispatch (`fast.moe`) against the same loop.

Every test runs twice: with the native training kernel (`kernels.moe_train`, what CPU training uses when it is
built) and with the PyTorch grouped path it replaces (GPUs, machines without a compiler)."""

import math

import pytest
import torch
import torch.nn.functional as F

from codefleet.inference import fast
from codefleet.model import kernels
from codefleet.model.config import ModelConfig
from codefleet.model.moe import MoE, _gmm_padded


@pytest.fixture(autouse=True, params=["native", "pytorch"])
def training_path(request, monkeypatch):
    if request.param == "native":
        assert kernels.moe_train() is not None, "the moe_train kernel did not build (scripts/setup.sh builds it)"
    else:
        monkeypatch.setattr(kernels, "moe_train", lambda: None)
    return request.param


def _moe(seed: int = 0, tile_slots: int = 4096, **overrides) -> MoE:
    torch.manual_seed(seed)
    base = {"d_model": 16, "n_experts": 8, "top_k": 2, "d_expert": 8, "d_shared": 12}
    moe = MoE(ModelConfig(**{**base, **overrides}))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.3)
    moe.tile_slots = tile_slots
    return moe


def _naive(moe: MoE, x_ND: torch.Tensor, replay_NK=None) -> torch.Tensor:
    """Per token, per chosen expert, in plain PyTorch: the definition the fast path must match."""
    cfg = moe.config
    logits_NE = x_ND @ moe.router.weight_ED.t()
    scores_NE = logits_NE.softmax(-1) if cfg.router_score == "softmax" else logits_NE.sigmoid()
    select_NE = scores_NE + moe.router.expert_bias_E if cfg.balance == "bias" else scores_NE
    experts_NK = select_NE.topk(cfg.top_k, -1).indices if replay_NK is None else replay_NK
    Fh = cfg.d_expert
    rows = []
    for n in range(x_ND.shape[0]):
        w = scores_NE[n, experts_NK[n]]
        if cfg.router_renorm:
            w = w / w.sum()
        y = torch.zeros_like(x_ND[n])
        for j, e in enumerate(experts_NK[n].tolist()):
            h = x_ND[n] @ moe.w_gate_up_EDG[e]
            y = y + w[j] * ((F.silu(h[:Fh]) * h[Fh:]) @ moe.w_down_EFD[e])
        if moe.shared is not None:
            y = y + moe.shared(x_ND[n])
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"router_score": "sigmoid"},
        {"router_score": "sigmoid", "router_renorm": False, "top_k": 3},
        {"n_shared_experts": 2, "tile_slots": 5},  # several tiles of whole experts
        {"top_k": 1, "tile_slots": 1},
        {"d_expert": 6},  # rows of 6 floats are not 16-byte aligned: the padded-bmm fallback runs
    ],
)
def test_matches_naive_loop_outputs_and_grads(overrides):
    moe = _moe(**overrides)
    x_ND = torch.randn(24, 16, requires_grad=True)
    out = moe(x_ND)
    ref_ND = _naive(moe, x_ND)
    torch.testing.assert_close(out.y_ND, ref_ND, atol=1e-5, rtol=1e-5)
    dy_ND = torch.randn_like(ref_ND)
    params = [x_ND] + list(moe.parameters())
    got = torch.autograd.grad(out.y_ND, params, dy_ND)
    want = torch.autograd.grad(ref_ND, params, dy_ND)
    for (name, _), g, w in zip([("x", None)] + list(moe.named_parameters()), got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"grad of {name}: {m}")


def test_padded_bmm_fallback_equals_grouped_mm():
    torch.manual_seed(0)
    a, w, b = torch.randn(10, 4), torch.randn(3, 4, 8), torch.randn(10, 8)
    offs = torch.tensor([3, 3, 10], dtype=torch.int32)  # an empty group in the middle
    ref = torch.cat([a[:3] @ w[0], a[3:] @ w[2]])
    torch.testing.assert_close(_gmm_padded(a, w, offs), ref)
    dw = _gmm_padded(a.t(), b, offs)
    torch.testing.assert_close(dw, torch.stack([a[:3].t() @ b[:3], torch.zeros(4, 8), a[3:].t() @ b[3:]]))


def test_dropless_when_every_token_picks_the_same_expert():
    moe = _moe(balance="bias", tile_slots=4)
    moe.router.expert_bias_E[5] = 100.0  # every token's first choice
    x_ND = torch.randn(64, 16)
    out = moe(x_ND)
    assert (out.experts_NK == 5).any(-1).all()
    torch.testing.assert_close(out.y_ND, _naive(moe, x_ND), atol=1e-5, rtol=1e-5)
    forced = torch.full((64, 2), 3)
    forced[:, 1] = 6
    torch.testing.assert_close(moe(x_ND, forced).y_ND, _naive(moe, x_ND, forced), atol=1e-5, rtol=1e-5)


def test_replay_reproduces_exactly_and_router_still_learns():
    moe = _moe()
    x_ND = torch.randn(32, 16)
    first = moe(x_ND)
    replayed = moe(x_ND, first.experts_NK)
    assert torch.equal(replayed.y_ND, first.y_ND)
    assert torch.equal(replayed.experts_NK, first.experts_NK)
    other = (first.experts_NK + 1) % 8
    assert not torch.allclose(moe(x_ND, other).y_ND, first.y_ND)
    moe.zero_grad()
    moe(x_ND, other).y_ND.square().sum().backward()
    assert moe.router.weight_ED.grad.abs().sum() > 0


def test_aux_and_z_loss_by_hand():
    c = 2.0
    moe = _moe(d_model=4, n_experts=4, top_k=1, aux_loss_coef=0.5, z_loss_coef=0.1)
    with torch.no_grad():
        moe.router.weight_ED.copy_(c * torch.eye(4))
    # token n -> expert n: f_e = 1/4 and P_e = 1/4, so aux = coef * E * 4 * 1/16 = coef
    out = moe(torch.eye(4))
    lse = math.log(math.exp(c) + 3)
    assert out.aux_loss.item() == pytest.approx(0.5, rel=1e-6)
    assert out.z_loss.item() == pytest.approx(0.1 * lse**2, rel=1e-6)
    # every token -> expert 0: f = [1, 0, 0, 0], P_0 = e^c / (e^c + 3)
    out = moe(torch.eye(4)[[0, 0, 0, 0]])
    assert out.aux_loss.item() == pytest.approx(0.5 * 4 * math.exp(c) / (math.exp(c) + 3), rel=1e-6)
    assert _moe(balance="none").forward(torch.randn(4, 16)).aux_loss.item() == 0.0


def _imbalance(moe: MoE, x_ND: torch.Tensor) -> float:
    counts = torch.bincount(moe(x_ND).experts_NK.reshape(-1), minlength=moe.config.n_experts).float()
    return (counts.max() / counts.mean()).item()


def test_bias_balancing_moves_load_toward_uniform():
    moe = _moe(balance="bias", bias_update_rate=0.01, router_score="sigmoid")
    torch.manual_seed(1)
    v = torch.randn(16)
    with torch.no_grad():
        moe.router.weight_ED[0] += v / v.norm()
        moe.router.weight_ED[1] += v / v.norm()
    x_ND = torch.randn(256, 16) + 2 * v  # experts 0 and 1 win almost every token
    before = _imbalance(moe, x_ND)
    moe.train()
    with torch.no_grad():
        for _ in range(150):
            moe(x_ND)
            moe.update_bias()
    assert moe.router.load_E.sum() == 0  # reset by update_bias
    moe.eval()
    after = _imbalance(moe, x_ND)
    assert before > 3.0 and after < 2.0, (before, after)  # 4.0 -> ~1.7 here


def _shards(full: MoE) -> list[MoE]:
    """Experts 0-2 and 3-7 of `full` as two shards with its router (and shared expert)."""
    shards = []
    for e0, e1 in [(0, 3), (3, 8)]:
        shard = MoE(full.config, expert_range=(e0, e1))
        state = {
            k: v
            for k, v in full.state_dict().items()
            if not k.startswith("w_") and (k.startswith("router") or shard.shared is not None)
        }
        state["w_gate_up_EDG"] = full.w_gate_up_EDG[e0:e1]
        state["w_down_EFD"] = full.w_down_EFD[e0:e1]
        shard.load_state_dict(state)
        shards.append(shard)
    return shards


def test_expert_shards_sum_to_the_full_layer():
    full = _moe(n_shared_experts=1)
    x_ND = torch.randn(40, 16)
    total = torch.zeros(40, 16)
    for shard in _shards(full):
        total += shard(x_ND).y_ND
    torch.testing.assert_close(total, full(x_ND).y_ND, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "n_tokens, overrides",
    [
        (1, {}),  # 2 slots: each slot gathers its expert's weights
        (2, {"router_score": "sigmoid", "router_renorm": False}),
        (24, {}),  # padded bmm over the experts
        (24, {"n_shared_experts": 1, "top_k": 3}),
        (24, {"pad_waste_small": 0.5}),  # the padding would be too wasteful: the grouped path
        (600, {"d_expert": 6}),  # past small_slots * pad_waste_small: the grouped path
    ],
)
def test_inference_dispatch_matches_the_naive_loop(n_tokens, overrides, monkeypatch):
    if "pad_waste_small" in overrides:
        monkeypatch.setattr(fast, "PAD_WASTE_SMALL", overrides.pop("pad_waste_small"))
    moe = _moe(**overrides)
    x_ND = torch.randn(n_tokens, 16)
    with torch.inference_mode():
        out = fast.moe(moe, x_ND)
    assert out.aux_loss is None and out.z_loss is None  # no router losses at inference
    with torch.no_grad():
        ref_ND = _naive(moe, x_ND)
        replayed = fast.moe(moe, x_ND, out.experts_NK)
        assert replayed.aux_loss is not None  # no_grad alone still reports the losses
    torch.testing.assert_close(out.y_ND, ref_ND, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(replayed.y_ND, out.y_ND, atol=0, rtol=0)
    assert torch.equal(out.experts_NK, moe(x_ND).experts_NK)  # the same routing as the training path


@pytest.mark.parametrize("n_tokens", [1, 20])
def test_inference_dispatch_of_expert_shards_sums_to_the_full_layer(n_tokens):
    full = _moe(n_shared_experts=1)
    x_ND = torch.randn(n_tokens, 16)
    total = torch.zeros(n_tokens, 16)
    with torch.inference_mode():
        for shard in _shards(full):
            total += fast.moe(shard, x_ND).y_ND
        torch.testing.assert_close(total, fast.moe(full, x_ND).y_ND, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(total, _naive(full, x_ND).detach(), atol=1e-5, rtol=1e-5)
