"""The native CPU kernels (model/kernels.py, model/csrc/): equal to their PyTorch definitions, clear errors."""

import pytest
import torch
import torch.nn.functional as F

from codefleet.inference import fast
from codefleet.inference.cache import SlotKVCache
from codefleet.model import kernels
from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
from codefleet.model.moe import MoE
from codefleet.model.transformer import Transformer


def _op():
    op = kernels.moe_experts()
    assert op is not None, "the moe_experts kernel did not build (scripts/setup.sh installs g++ and builds it)"
    return op


def _reference(x_ND, experts_NK, weights_NK, w_gate_up_EDG, w_down_EFD, e0=0):
    """The definition: each token's weighted sum of its SwiGLU experts' outputs (experts of this shard only)."""
    E, F_ = w_down_EFD.shape[0], w_down_EFD.shape[1]
    y_ND = torch.zeros_like(x_ND)
    for n in range(x_ND.shape[0]):
        for k, e in enumerate(experts_NK[n].tolist()):
            if 0 <= e - e0 < E:
                h = x_ND[n] @ w_gate_up_EDG[e - e0]
                y_ND[n] += weights_NK[n, k] * ((F.silu(h[:F_]) * h[F_:]) @ w_down_EFD[e - e0])
    return y_ND


def _inputs(E, D, F_, N, K, seed=0):
    g = torch.Generator().manual_seed(seed)
    experts_NK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(N)])
    return (
        torch.randn(N, D, generator=g),
        experts_NK,
        torch.rand(N, K, generator=g),
        torch.randn(E, D, 2 * F_, generator=g) * 0.05,
        torch.randn(E, F_, D, generator=g) * 0.05,
    )


@pytest.mark.parametrize(
    "E,D,F_,N,K", [(16, 192, 192, 32, 2), (16, 192, 192, 1, 2), (5, 100, 40, 9, 3), (3, 32, 16, 4, 1)]
)
def test_moe_experts_equals_the_swiglu_experts_it_fuses(E, D, F_, N, K):
    """Full tiles (the tiny config's shapes), one token, and shapes that leave partial tiles."""
    x, experts, weights, w_gate_up, w_down = _inputs(E, D, F_, N, K)
    y = _op()(x, experts, weights, *kernels.pack_experts(w_gate_up, w_down), 0)
    torch.testing.assert_close(y, _reference(x, experts, weights, w_gate_up, w_down), atol=1e-5, rtol=1e-5)


def test_an_expert_shard_computes_only_its_experts():
    """Weights of experts 4..7 of 12: slots routed elsewhere are skipped (a token with none gets zeros)."""
    x, experts, weights, w_gate_up, w_down = _inputs(12, 64, 32, 10, 2, seed=3)
    experts[0] = torch.tensor([0, 9])  # nothing on this shard
    y = _op()(x, experts, weights, *kernels.pack_experts(w_gate_up[4:8], w_down[4:8]), 4)
    torch.testing.assert_close(
        y, _reference(x, experts, weights, w_gate_up[4:8], w_down[4:8], e0=4), atol=1e-5, rtol=1e-5
    )
    assert torch.equal(y[0], torch.zeros(64))


def test_a_tokens_result_does_not_depend_on_the_other_tokens():
    """Each dot product runs over k in order on its own row: the same bits alone or in any batch."""
    x, experts, weights, w_gate_up, w_down = _inputs(16, 192, 192, 32, 2, seed=1)
    packed = kernels.pack_experts(w_gate_up, w_down)
    y = _op()(x, experts, weights, *packed, 0)
    for i in (0, 5, 31):
        alone = _op()(x[i : i + 1], experts[i : i + 1], weights[i : i + 1], *packed, 0)
        assert torch.equal(alone[0], y[i])


def test_bad_inputs_are_refused_with_the_reason():
    op = _op()
    x, experts, weights, w_gate_up, w_down = _inputs(4, 8, 4, 2, 2)
    gate_up, down = kernels.pack_experts(w_gate_up, w_down)
    with pytest.raises(RuntimeError, match="fp32"):
        op(x.double(), experts, weights, gate_up, down, 0)
    with pytest.raises(RuntimeError, match="packed gate_up"):  # unpacked weights
        op(x, experts, weights, w_gate_up, w_down, 0)
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        op(x[:, :6].contiguous(), experts, weights, gate_up, down, 0)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(x, experts, weights, gate_up.transpose(2, 3), down, 0)


def test_the_moe_layer_gives_the_same_output_with_and_without_the_kernel(monkeypatch):
    torch.manual_seed(2)
    moe = MoE(ModelConfig.tiny()).eval()
    with torch.no_grad():
        for p in moe.parameters():  # a layer alone is not initialised (Transformer.reset_parameters does that)
            p.normal_(0.0, 0.05)
    for n in (1, 3, 32, 1000):  # decode sizes and a prefill
        x = torch.randn(n, 192)
        with torch.inference_mode():
            fused = fast.moe(moe, x).y_ND
            monkeypatch.setattr(fast, "KERNEL_SLOTS", 0)
            plain = fast.moe(moe, x).y_ND
            monkeypatch.undo()
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CODEFLEET_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with pytest.raises(kernels.KernelBuildError, match="compiling moe_experts.cpp failed"):
        kernels.build("moe_experts")
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.tmp"))  # nothing half-built left
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(kernels.KernelBuildError, match="cannot run the C\\+\\+ compiler"):
        kernels.build("moe_experts")


# ---- the decode step's attention half and router (csrc/decode_layer.cpp) -------------------------------------


def _decode_steps(model, slots, prompts, steps):
    """Prefill each prompt into its slot (the Python path: T > 1), then decode `steps` fixed tokens per row;
    every decode step's logits and routing, and the cache."""
    cfg = model.config
    cache = SlotKVCache(cfg.n_layers, 6, cfg.n_kv_heads, cfg.head_dim, 32)
    lengths = [len(p) for p in prompts]
    T = max(lengths)
    tokens_BT = torch.tensor([p + [0] * (T - len(p)) for p in prompts])
    logits, routing = [], []
    with torch.inference_mode():
        cache.begin(slots, [0] * len(slots), lengths, T)
        model(
            tokens_BT,
            torch.arange(T).expand(len(slots), T),
            cache=cache,
            logits_at_B=torch.tensor(lengths) - 1,
            fast=fast,
        )
        cache.end()
        g = torch.Generator().manual_seed(5)
        for _ in range(steps):
            starts = [cache.lengths[s] for s in slots]
            cache.begin(slots, starts, [1] * len(slots), 1)
            out = model(
                torch.randint(16, cfg.vocab_size, (len(slots), 1), generator=g),
                torch.tensor(starts)[:, None],
                cache=cache,
                return_routing=True,
                fast=fast,
            )
            cache.end()
            logits.append(out.logits_BTV)
            routing.append(torch.stack(out.routed_experts))
    return logits, routing, cache


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"first_dense_layers": 1, "n_shared_experts": 1},
        {"router_score": "sigmoid", "router_renorm": False, "balance": "bias"},
    ],
)
def test_a_native_decode_step_equals_the_python_one(monkeypatch, overrides):
    """The decode step's blocks in native calls (`fast.blocks`) against the Python path (cache.attend, the
    Python router), over slots that are not packed; a dense layer and a shared expert take their modules."""
    assert kernels.decode_layer() is not None, "the decode_layer kernel did not build"
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(copy=CopyConfig(prev_tokens=0), **overrides)).eval()
    if "balance" in overrides:
        for block in model.layers[model.config.first_dense_layers :]:
            block.ffn.router.expert_bias_E.normal_(0.0, 0.05)
    slots, prompts = [4, 1, 2], [[20, 21, 22, 23, 24], list(range(30, 39)), [40, 41]]
    native = _decode_steps(model, slots, prompts, 4)
    monkeypatch.setattr(kernels, "decode_layer", lambda: None)
    python = _decode_steps(model, slots, prompts, 4)
    for a, b in zip(native[0], python[0]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(native[1], python[1]):
        assert torch.equal(a, b)
    torch.testing.assert_close(native[2].k, python[2].k, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(native[2].v, python[2].v, atol=1e-6, rtol=1e-5)
    assert native[2].lengths == python[2].lengths


def test_decode_attention_refuses_a_position_outside_the_cache():
    attention, _ = kernels.decode_layer()
    cfg = ModelConfig.tiny()
    model = Transformer(cfg).eval()
    cache = SlotKVCache(cfg.n_layers, 2, cfg.n_kv_heads, cfg.head_dim, 8)
    attn = model.layers[0].attn
    w_qkv = torch.cat([attn.wq.weight, attn.wk.weight, attn.wv.weight]).detach()
    args = (
        torch.randn(1, cfg.d_model),
        model.layers[0].attn_norm.weight.detach(),
        w_qkv,
        attn.wo.weight.detach(),
        model.layers[0].ffn_norm.weight.detach(),
        model.rotary_table(8, "cpu"),
        cache.k,
        cache.v,
        0,
    )
    with pytest.raises(RuntimeError, match="outside the cache"):
        attention(*args, torch.tensor([0]), torch.tensor([8]), cfg.n_heads, cfg.norm_eps)
    with pytest.raises(RuntimeError, match="fp32"):
        attention(args[0].double(), *args[1:], torch.tensor([0]), torch.tensor([3]), cfg.n_heads, cfg.norm_eps)


# ---- the training kernels (csrc/moe_train.cpp) ---------------------------------------------------------------


def _train_ops():
    ops = kernels.moe_train()
    assert ops is not None, "the moe_train kernel did not build (scripts/setup.sh installs g++ and builds it)"
    return ops


def _autograd_reference(x, experts, weights, w_gate_up, w_down, e0=0):
    """Outputs and gradients (x, weights, gate_up, down) of the definition, by autograd."""
    leaves = [t.clone().requires_grad_() for t in (x, weights, w_gate_up, w_down)]
    y = _reference(leaves[0], experts, leaves[1], leaves[2], leaves[3], e0)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    return y.detach(), dy, torch.autograd.grad(y, leaves, dy)


@pytest.mark.parametrize(
    "E,D,F_,N,K,e0,chunk",
    [
        (16, 64, 32, 40, 4, 0, 4096),  # one chunk
        (16, 64, 32, 40, 4, 0, 7),  # a chunk per expert or two
        (8, 48, 24, 30, 3, 2, 16),  # an expert shard: experts 2..5 of 8
    ],
)
def test_moe_train_forward_and_backward_equal_autograd_of_the_definition(E, D, F_, N, K, e0, chunk):
    x, experts, weights, w_gate_up, w_down = _inputs(E, D, F_, N, K, seed=4)
    local = slice(e0, E) if e0 == 0 else slice(e0, e0 + 4)
    w_gate_up, w_down = w_gate_up[local].contiguous(), w_down[local].contiguous()
    y_ref, dy, (dx_ref, dweights_ref, dgu_ref, ddn_ref) = _autograd_reference(
        x, experts, weights, w_gate_up, w_down, e0
    )
    forward, backward = _train_ops()
    y, saved = forward(x, experts, weights, w_gate_up, w_down, e0, chunk)
    dx, dweights, dgu, ddn = backward(dy, x, experts, weights, w_gate_up, w_down, e0, saved, chunk)
    for got, want in [(y, y_ref), (dx, dx_ref), (dweights, dweights_ref), (dgu, dgu_ref), (ddn, ddn_ref)]:
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


def test_moe_train_experts_nobody_chose_get_zero_gradients():
    x, experts, weights, w_gate_up, w_down = _inputs(6, 32, 16, 12, 2, seed=5)
    experts[:] = torch.tensor([1, 4])  # every token picks experts 1 and 4
    forward, backward = _train_ops()
    y, saved = forward(x, experts, weights, w_gate_up, w_down, 0, 4096)
    _, _, dgu, ddn = backward(torch.ones_like(y), x, experts, weights, w_gate_up, w_down, 0, saved, 4096)
    idle = [0, 2, 3, 5]
    assert torch.equal(dgu[idle], torch.zeros_like(dgu[idle])) and torch.equal(ddn[idle], torch.zeros_like(ddn[idle]))
    assert dgu[1].abs().sum() > 0 and ddn[4].abs().sum() > 0


def test_moe_train_does_not_depend_on_the_thread_count():
    x, experts, weights, w_gate_up, w_down = _inputs(16, 64, 32, 64, 4, seed=6)
    forward, backward = _train_ops()
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            y, saved = forward(x, experts, weights, w_gate_up, w_down, 0, 64)
            results.append([y, *backward(torch.ones_like(y), x, experts, weights, w_gate_up, w_down, 0, saved, 64)])
    finally:
        torch.set_num_threads(before)
    for one, two in zip(*results):
        torch.testing.assert_close(one, two, atol=1e-6, rtol=1e-6)


def test_moe_train_bad_inputs_are_refused_with_the_reason():
    forward, backward = _train_ops()
    x, experts, weights, w_gate_up, w_down = _inputs(4, 8, 4, 3, 2)
    with pytest.raises(RuntimeError, match="fp32"):
        forward(x.double(), experts, weights, w_gate_up, w_down, 0, 64)
    with pytest.raises(RuntimeError, match="shapes do not agree"):
        forward(x[:, :6].contiguous(), experts, weights, w_gate_up, w_down, 0, 64)
    with pytest.raises(RuntimeError, match="contiguous"):
        forward(x, experts, weights, w_gate_up.transpose(1, 2), w_down, 0, 64)
    with pytest.raises(RuntimeError, match="chunk_slots"):
        forward(x, experts, weights, w_gate_up, w_down, 0, 0)
    y, saved = forward(x, experts, weights, w_gate_up, w_down, 0, 64)
    with pytest.raises(RuntimeError, match="what the forward returned"):
        backward(y, x, experts, weights, w_gate_up, w_down, 0, saved[:-1], 64)
    with pytest.raises(RuntimeError, match="dy must be like x"):
        backward(y[:2].contiguous(), x, experts, weights, w_gate_up, w_down, 0, saved, 64)
