"""The transformer: RoPE and GQA by definition, causality, cached decode, routing replay, it learns."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from codefleet.inference import fast
from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig, copy_ends
from codefleet.model.rope import apply_rope, rope_cos_sin
from codefleet.model.transformer import RMSNorm, Transformer, token_logprobs


def _small(copy: CopyConfig | None = None, **overrides) -> ModelConfig:
    base = {
        "vocab_size": 97,
        "d_model": 32,
        "n_layers": 3,
        "n_heads": 4,
        "n_kv_heads": 2,
        "head_dim": 8,
        "n_experts": 4,
        "top_k": 2,
        "d_expert": 16,
        "first_dense_layers": 1,
        "d_dense": 48,
        "n_shared_experts": 1,
        "d_shared": 16,
    }
    return ModelConfig(**{**base, **overrides}, copy=copy or CopyConfig())


def _copying(**copy) -> ModelConfig:
    """`_small` with the copy head on and `copy`'s other fields."""
    return _small(CopyConfig(head=True, **copy))


class RefCache:
    """The `cache.attend` seam at its simplest: every row has the same length, keys/values are concatenated."""

    def __init__(self, n_layers: int):
        self.k = [None] * n_layers
        self.v = [None] * n_layers

    def attend(self, layer, q_BHTD, k_BHTD, v_BHTD):
        if self.k[layer] is not None:
            k_BHTD = torch.cat([self.k[layer], k_BHTD], dim=2)
            v_BHTD = torch.cat([self.v[layer], v_BHTD], dim=2)
        self.k[layer], self.v[layer] = k_BHTD, v_BHTD
        T, L = q_BHTD.shape[2], k_BHTD.shape[2]
        mask_TL = torch.ones(T, L, dtype=torch.bool).tril(L - T)
        return F.scaled_dot_product_attention(q_BHTD, k_BHTD, v_BHTD, attn_mask=mask_TL, enable_gqa=True)


def test_rope_keeps_norms_and_depends_only_on_relative_position():
    torch.manual_seed(0)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def rot(x, pos):
        cos, sin = rope_cos_sin(torch.tensor([[pos]]), 16, 10000.0)
        return apply_rope(x, cos, sin)

    torch.testing.assert_close(rot(q, 7).norm(), q.norm())

    def dot(m, n):
        return (rot(q, m) * rot(k, n)).sum()

    torch.testing.assert_close(dot(3, 1), dot(13, 11))
    assert not torch.allclose(dot(3, 1), dot(3, 2))


def test_gqa_attention_equals_repeated_heads_by_hand():
    cfg = _small()
    torch.manual_seed(0)
    model = Transformer(cfg)
    attn = model.layers[0].attn
    B, T = 2, 5
    x_BTD = torch.randn(B, T, cfg.d_model)
    cos, sin = rope_cos_sin(torch.arange(T).expand(B, T), cfg.head_dim, cfg.rope_theta)
    q = apply_rope(attn.wq(x_BTD).view(B, T, 4, 8).transpose(1, 2), cos, sin)
    k = apply_rope(attn.wk(x_BTD).view(B, T, 2, 8).transpose(1, 2), cos, sin).repeat_interleave(2, dim=1)
    v = attn.wv(x_BTD).view(B, T, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(8) + torch.full((T, T), float("-inf")).triu(1)
    want = attn.wo((scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, 32))
    table_BT21D = model.rotary_table(T, "cpu")[torch.arange(T).expand(B, T)]  # what the model passes: cos, signed sin
    torch.testing.assert_close(attn(x_BTD, table_BT21D[:, :, 0], table_BT21D[:, :, 1]), want, atol=1e-5, rtol=1e-5)


def test_rms_norm_is_its_expression_bit_for_bit_in_fp32_forward_and_backward():
    torch.manual_seed(0)
    norm = RMSNorm(32, 1e-6)
    norm.weight.data.normal_(1.0, 0.1)
    x_BTD = torch.randn(3, 7, 32, requires_grad=True)
    dy_BTD = torch.randn(3, 7, 32)
    fused = norm(x_BTD)
    x32 = x_BTD.float()
    want = (x32 * torch.rsqrt(x32.square().mean(-1, keepdim=True) + 1e-6)) * norm.weight
    assert torch.equal(fused, want)
    got, expected = (torch.autograd.grad(y, (x_BTD, norm.weight), dy_BTD) for y in (fused, want))
    assert all(torch.equal(g, w) for g, w in zip(got, expected))


def test_the_fast_paths_fused_projections_equal_the_math():
    """fast.attention (one q/k/v GEMM, RoPE on q and k together) and fast.swiglu (one gate/up GEMM), fp32: the
    same dot products, to float rounding (MKL's blocking and SiLU's vector path may differ by shape)."""
    torch.manual_seed(0)
    model = Transformer(_small()).eval()  # layer 0 dense, layers 1-2 MoE with a shared expert
    for B, T in [(1, 1), (5, 1), (2, 9)]:
        x_BTD = torch.randn(B, T, 32)
        table_BT21D = model.rotary_table(T, "cpu")[torch.arange(T).expand(B, T)]
        cos, sin = table_BT21D[:, :, 0], table_BT21D[:, :, 1]
        with torch.no_grad():
            for block in model.layers:
                torch.testing.assert_close(
                    fast.attention(block.attn, x_BTD, cos, sin), block.attn(x_BTD, cos, sin), atol=1e-6, rtol=1e-5
                )
            x_ND = x_BTD.reshape(B * T, 32)
            for ffn in (model.layers[0].ffn, model.layers[1].ffn.shared):
                torch.testing.assert_close(fast.swiglu(ffn, x_ND), ffn(x_ND), atol=1e-6, rtol=1e-5)


def test_causal_and_positions_default():
    model = Transformer(_small()).eval()
    tokens_BT = torch.randint(0, 97, (2, 12))
    out = model(tokens_BT)
    assert out.logits_BTV.shape == (2, 12, 97)
    changed = tokens_BT.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 97
    torch.testing.assert_close(model(changed).logits_BTV[:, :8], out.logits_BTV[:, :8])
    explicit = model(tokens_BT, positions_BT=torch.arange(12).expand(2, 12)).logits_BTV
    assert torch.equal(explicit, out.logits_BTV)


def test_cached_decode_equals_full_forward():
    cfg = _small()
    model = Transformer(cfg).eval()
    tokens_BT = torch.randint(0, 97, (3, 10))
    with torch.no_grad():  # the engine's path: cached, through the fast path
        full = model(tokens_BT, return_routing=True, fast=fast)
        cache = RefCache(cfg.n_layers)
        steps = [model(tokens_BT[:, :6], cache=cache, return_routing=True, fast=fast)]
        for t in range(6, 10):
            steps.append(
                model(
                    tokens_BT[:, t : t + 1],
                    positions_BT=torch.full((3, 1), t),
                    cache=cache,
                    return_routing=True,
                    prev_BK=tokens_BT[:, t - cfg.copy.prev_tokens : t],
                    fast=fast,
                )
            )
    logits_BTV = torch.cat([s.logits_BTV for s in steps], dim=1)
    torch.testing.assert_close(logits_BTV, full.logits_BTV, atol=1e-5, rtol=1e-5)
    routed = [torch.cat([s.routed_experts[i] for s in steps], dim=1) for i in range(cfg.n_moe_layers)]
    replayed = model(tokens_BT, routing_replay=routed)
    torch.testing.assert_close(replayed.logits_BTV, full.logits_BTV, atol=1e-5, rtol=1e-5)


def test_routing_replay_through_the_model_is_exact_and_router_gets_grads():
    cfg = _small()
    model = Transformer(cfg)
    tokens_BT = torch.randint(0, 97, (2, 16))
    first = model(tokens_BT, return_routing=True)
    assert len(first.routed_experts) == cfg.n_moe_layers == 2
    assert first.routed_experts[0].shape == (2, 16, cfg.top_k)
    again = model(tokens_BT, routing_replay=first.routed_experts, return_routing=True)
    assert torch.equal(again.logits_BTV, first.logits_BTV)
    assert all(torch.equal(a, b) for a, b in zip(again.routed_experts, first.routed_experts))
    (again.logits_BTV.logsumexp(-1).mean() + again.aux_loss + again.z_loss).backward()
    assert model.layers[1].ffn.router.weight_ED.grad.abs().sum() > 0
    assert first.aux_loss.item() > 0 and first.z_loss.item() > 0
    assert model(tokens_BT).routed_experts is None


def test_token_logprobs_and_tied_embeddings():
    logits_BTV = torch.randn(2, 3, 7)
    targets_BT = torch.randint(0, 7, (2, 3))
    want = torch.log_softmax(logits_BTV, -1)[torch.arange(2)[:, None], torch.arange(3), targets_BT]
    torch.testing.assert_close(token_logprobs(logits_BTV, targets_BT), want)
    tied = Transformer(_small(tie_embeddings=True))
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.n_params() == Transformer(_small()).n_params() - 97 * 32


def test_tiny_model_overfits_a_small_batch():
    torch.manual_seed(0)
    cfg = _small(vocab_size=64, d_model=64, n_heads=4, head_dim=16, n_experts=8, d_expert=64, balance="bias")
    model = Transformer(cfg)
    tokens_BT = torch.randint(0, 64, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(50):
        out = model(tokens_BT[:, :-1])
        loss = -token_logprobs(out.logits_BTV, tokens_BT[:, 1:]).mean()
        (loss + out.aux_loss + out.z_loss).backward()
        opt.step()
        opt.zero_grad()
        model.update_router_bias()
        losses.append(loss.item())
    assert losses[0] > 3.5 and losses[-1] < 0.5, losses[::10]
    assert model.layers[1].ffn.router.expert_bias_E.abs().sum() > 0


def test_logits_at_one_position_per_row_equal_the_full_head():
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=300, n_layers=2)).eval()
    tokens_BT = torch.randint(0, 300, (3, 9))
    at_B = torch.tensor([8, 0, 4])
    with torch.no_grad():
        full_BTV = model(tokens_BT).logits_BTV
        some_B1V = model(tokens_BT, logits_at_B=at_B).logits_BTV
    assert some_B1V.shape == (3, 1, 300)
    torch.testing.assert_close(some_B1V[:, 0], full_BTV[torch.arange(3), at_B], atol=1e-5, rtol=1e-5)


def test_inference_head_equals_the_training_head_and_follows_weight_updates():
    """Through the fast path the LM head runs on a prepacked copy of its weight (oneDNN on CPU): the same logits as
    the training path, also after an in-place optimiser step and after load_state_dict replace the weight."""
    torch.manual_seed(0)
    model = Transformer(_small())
    tokens_BT = torch.randint(0, 97, (2, 7))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _step in range(2):
        trained = model(tokens_BT).logits_BTV
        with torch.no_grad():
            torch.testing.assert_close(model(tokens_BT, fast=fast).logits_BTV, trained, atol=1e-5, rtol=1e-5)
        trained.square().mean().backward()  # moves every weight, the head's in place
        optimizer.step()
        optimizer.zero_grad()
    other = Transformer(_small())
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(
            model(tokens_BT, fast=fast).logits_BTV, other(tokens_BT).logits_BTV, atol=1e-5, rtol=1e-5
        )


def test_the_caller_chooses_the_fast_path_and_it_needs_gradients_off():
    """Without `fast` a forward runs the model's own code with or without gradients (the same bits); `fast` is
    refused where gradients are on, since its fused weights keep none."""
    torch.manual_seed(0)
    model = Transformer(_small()).eval()
    tokens_BT = torch.randint(0, 97, (2, 7))
    trained = model(tokens_BT).logits_BTV
    with torch.no_grad():
        assert torch.equal(model(tokens_BT).logits_BTV, trained)
    with pytest.raises(ValueError, match="without gradients"):
        model(tokens_BT, fast=fast)


def test_a_continuing_forward_needs_the_tokens_before_it():
    cfg = _small()
    assert cfg.copy.prev_tokens == 2
    model = Transformer(cfg).eval()
    tokens_BT = torch.randint(0, 97, (2, 8))
    with torch.no_grad():
        cache = RefCache(cfg.n_layers)
        model(tokens_BT[:, :5], cache=cache)
        with pytest.raises(ValueError, match="needs prev_BK"):
            model(tokens_BT[:, 5:6], positions_BT=torch.full((2, 1), 5), cache=cache)
        with pytest.raises(ValueError, match=r"\[2, 2\]"):
            model(tokens_BT[:, 5:6], positions_BT=torch.full((2, 1), 5), cache=cache, prev_BK=tokens_BT[:, 4:5])


def test_previous_tokens_change_the_input_and_a_config_must_name_every_field():
    cfg = _small()
    model = Transformer(cfg).eval()
    tokens_BT = torch.randint(0, 97, (1, 6))
    changed = tokens_BT.clone()
    changed[0, 2] = (changed[0, 2] + 1) % 97
    with torch.no_grad():
        x, y = model.embed_input(tokens_BT), model.embed_input(changed)
    assert torch.equal(x[0, :2], y[0, :2]) and torch.equal(x[0, 5:], y[0, 5:])  # token 2 reaches positions 2-4
    assert not torch.equal(x[0, 3], y[0, 3]) and not torch.equal(x[0, 4], y[0, 4])
    saved = json.loads(cfg.to_json())
    del saved["copy"]["prev_tokens"]  # a config.json from another version, or edited by hand
    with pytest.raises(ValueError, match=r"missing field\(s\) \['copy.prev_tokens'\]"):
        ModelConfig.from_json(json.dumps(saved))
    saved["copy"].update(prev_tokens=2, wings=3)
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['copy.wings'\]"):
        ModelConfig.from_json(json.dumps(saved))


def test_copy_head_output_is_a_mixture_whose_copy_share_lies_on_the_context():
    torch.manual_seed(0)
    model = Transformer(_copying()).eval()
    tokens_BT = torch.randint(0, 40, (2, 12))  # ids 40..96 never occur in the context
    with torch.no_grad():
        mixed_BTV = model(tokens_BT).logits_BTV
        at_B = torch.tensor([11, 3])
        torch.testing.assert_close(
            model(tokens_BT, logits_at_B=at_B).logits_BTV[:, 0], mixed_BTV[torch.arange(2), at_B], atol=1e-5, rtol=1e-5
        )
        copy_head, model.copy = model.copy, None
        plain_BTV = torch.log_softmax(model(tokens_BT).logits_BTV, dim=-1)  # the generator alone
        model.copy = copy_head
        torch.testing.assert_close(mixed_BTV.exp().sum(-1), torch.ones(2, 12))
        # a token absent from the context gets the generator's probability times the same (1 - gate) everywhere
        share_BTV = (mixed_BTV - plain_BTV)[:, :, 40:].exp()
        assert (share_BTV < 0.999).all() and (share_BTV.std(dim=-1) < 1e-4).all()
        model.copy.gate.bias.fill_(40.0)  # gate open: everything is copied, from positions <= t only
        copied_BTV = model(tokens_BT).logits_BTV.exp()
    for b in range(2):
        for t in range(12):
            seen = set(tokens_BT[b, : t + 1].tolist())
            outside = [v for v in range(97) if v not in seen]
            assert copied_BTV[b, t, outside].sum() < 1e-6


def test_copy_ends_give_each_turn_the_prompt_it_was_generated_from():
    turn_mask_BT = torch.tensor([[0, 1, 1, 1, 0, 0, 1, 1, 0], [1, 1, 0, 1, 0, 0, 0, 0, 0]]).bool()
    assert copy_ends(turn_mask_BT).tolist() == [[1, 2, 2, 2, 5, 6, 7, 7, 9], [1, 1, 3, 4, 5, 6, 7, 8, 9]]


def test_copy_scope_prompt_points_only_before_the_current_turn():
    """Gate open: all of p is the copy share. In a turn (targets 6..11) only the prompt's tokens get any."""
    torch.manual_seed(0)
    model = Transformer(_copying(scope="prompt")).eval()
    model.copy.gate.bias.data.fill_(40.0)
    tokens_BT = torch.tensor([[1, 2, 3, 4, 5, 6, 50, 51, 52, 53, 54, 55]])
    turn_mask_BT = torch.zeros(1, 12, dtype=torch.bool)
    turn_mask_BT[0, 6:11] = True  # queries 6..10 predict the turn's tokens 7..11 (token 6 is the prompt's last)
    turn_mask_BT[0, 5] = True  # query 5 predicts the turn's first token, from the prompt tokens[:6]
    with torch.no_grad():
        p_TV = model(tokens_BT, turn_mask_BT=turn_mask_BT).logits_BTV[0].exp()
        every_BTV = model(tokens_BT, turn_mask_BT=torch.zeros_like(turn_mask_BT)).logits_BTV.exp()
    prompt = [1, 2, 3, 4, 5, 6]
    for t in range(5, 11):
        assert p_TV[t, prompt].sum() > 0.999 and p_TV[t, 50:56].sum() < 1e-6
    assert every_BTV[0, 10, 50:56].sum() > 0.01  # outside a turn a query sees its whole past
    with pytest.raises(ValueError, match="turn_mask_BT"):
        model(tokens_BT, targets_BT=tokens_BT)
    assert ModelConfig.from_json(model.config.to_json()).copy.scope == "prompt"
    with pytest.raises(ValueError, match="scope must be 'all' or 'prompt'"):
        CopyConfig(scope="turn")


def test_copy_match_continues_a_copy_where_the_tokens_before_match():
    """Gate open, match weights large: after `7 8` the copy goes to what followed `7 8` in the context."""
    torch.manual_seed(0)
    model = Transformer(_copying(match=True)).eval()
    model.copy.gate.bias.data.fill_(40.0)
    model.copy.match_w.data.fill_(30.0)
    tokens_BT = torch.tensor([[5, 7, 8, 9, 6, 8, 11, 3, 7, 8], [1] * 9 + [2]])
    with torch.no_grad():
        p_BTV = model(tokens_BT).logits_BTV.exp()
        last_BV = model(tokens_BT, logits_at_B=torch.tensor([9, 9])).logits_BTV[:, 0].exp()
    assert p_BTV[0, 9, 9] > 0.99  # `7 8` was followed by 9 (a lone `8` was followed by 9 and by 11)
    torch.testing.assert_close(last_BV, p_BTV[:, 9], atol=1e-5, rtol=1e-5)
    assert p_BTV[0, 0, 5] > 0.999 and p_BTV[1, 0, 1] > 0.999  # a sequence's first token has only itself


def test_copy_head_learns_to_copy_what_the_generator_alone_cannot_in_the_same_steps():
    """Repeat a random sequence: the copy head's gradient comes straight from the target."""

    def final_loss(copy_head: bool) -> float:
        torch.manual_seed(0)
        model = Transformer(_small(CopyConfig(head=copy_head), n_layers=2, first_dense_layers=0))
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        for _ in range(120):
            first = torch.randint(0, 97, (16, 8))
            tokens_BT = torch.cat([first, first], dim=1)
            out = model(tokens_BT)
            loss = -token_logprobs(out.logits_BTV[:, 7:-1], tokens_BT[:, 8:]).mean()
            opt.zero_grad()
            (loss + out.aux_loss + out.z_loss).backward()
            opt.step()
        return loss.item()

    assert final_loss(True) < 1.0 < final_loss(False)  # measured: 0.36 and 2.19


@pytest.mark.parametrize(
    "copy_head,scope,match,blocked",
    [
        (False, "all", False, []),
        (True, "all", False, []),
        (True, "prompt", True, []),
        (True, "prompt", True, list(range(0, 40, 3))),
    ],
    ids=["plain", "copy_head", "copy_prompt_match", "copy_blocked"],
)
def test_target_logprobs_equal_the_full_distributions_and_their_gradients(copy_head, scope, match, blocked):
    torch.manual_seed(0)
    model = Transformer(_small(CopyConfig(head=copy_head, scope=scope, match=match, blocked=blocked)))
    tokens_BT = torch.randint(0, 40, (2, 10))
    targets_BT = torch.randint(0, 97, (2, 10))
    targets_BT[:, :5] = tokens_BT[:, :5]  # some targets occur in the context, some do not
    turns_BT = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 0, 0, 0]]).bool()
    full = token_logprobs(model(tokens_BT, turn_mask_BT=turns_BT).logits_BTV, targets_BT)
    (grad_full,) = torch.autograd.grad(full.sum(), model.lm_head.weight)
    out = model(tokens_BT, targets_BT=targets_BT, turn_mask_BT=turns_BT)
    assert out.logits_BTV is None
    torch.testing.assert_close(out.target_logprobs_BT, full, atol=1e-5, rtol=1e-5)
    (grad_targets,) = torch.autograd.grad(out.target_logprobs_BT.sum(), model.lm_head.weight)
    torch.testing.assert_close(grad_targets, grad_full, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="full forward"):
        model(tokens_BT, targets_BT=targets_BT, logits_at_B=torch.tensor([1, 2]), turn_mask_BT=turns_BT)


def test_blocked_tokens_are_never_copied_unless_nothing_else_is_in_the_context():
    torch.manual_seed(0)
    blocked = [5, 6]
    model = Transformer(_copying(match=True, blocked=blocked))
    tokens_BT = torch.tensor([[5, 6, 7, 5, 8, 6, 9, 5]])
    h_BTD = torch.randn(1, tokens_BT.shape[1], model.config.d_model)
    attn_BTL, tokens_BL = model.copy._attention(h_BTD, h_BTD, tokens_BT)
    on_blocked_BT = (attn_BTL * torch.isin(tokens_BL, torch.tensor(blocked))[:, None, :]).sum(-1).detach()
    assert on_blocked_BT[0, 0] == pytest.approx(1.0) and on_blocked_BT[0, 1] == pytest.approx(1.0)  # only 5, 6 seen
    assert on_blocked_BT[0, 2:].abs().max() == 0  # 7 is in sight from position 2 on
    with pytest.raises(ValueError, match="copy.blocked holds ids outside the vocab"):
        _copying(blocked=[10_000])
