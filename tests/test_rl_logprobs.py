"""forward_logprobs equals token_logprobs of a full forward; engine routing converts to the model's replay;
the trainer's logprobs (with and without replay) equal the engine's on the engine's own rollouts."""

import torch

from codefleet.inference.engine import Engine
from codefleet.inference.sampling import SamplingParams
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer, token_logprobs
from codefleet.rl.logprobs import forward_logprobs, routing_replay_tensors


def _cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=97,
        d_model=32,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        head_dim=8,
        n_experts=4,
        top_k=2,
        d_expert=16,
        first_dense_layers=1,
        d_dense=48,
    )


def test_forward_logprobs_equals_token_logprobs_of_a_full_forward():
    torch.manual_seed(0)
    model = Transformer(_cfg())
    tokens_BT = torch.randint(0, 97, (2, 9))
    mask_BT = torch.ones(2, 9)
    mask_BT[1, 6:] = 0
    out = forward_logprobs(model, tokens_BT, mask_BT)
    with torch.no_grad():
        full = model(tokens_BT)
    expected = token_logprobs(full.logits_BTV[:, :-1], tokens_BT[:, 1:])
    torch.testing.assert_close(out.logprobs_BT[0, 1:], expected[0])
    torch.testing.assert_close(out.logprobs_BT[1, 1:6], expected[1, :5])
    assert out.logprobs_BT[:, 0].tolist() == [0.0, 0.0] and out.logprobs_BT[1, 6:].abs().sum() == 0
    torch.testing.assert_close(out.aux_loss, full.aux_loss)
    assert out.logprobs_BT.requires_grad  # the trainer backpropagates through it


def test_engine_routing_converts_to_the_models_replay_tensors():
    torch.manual_seed(0)
    model = Transformer(_cfg())
    tokens_BT = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        routed = model(tokens_BT, return_routing=True).routed_experts  # 2 MoE layers of [B, T, K]
    # the engine's per-token records, flat layer-major as in Turn.routed_experts; row 1 is 2 tokens short
    per_token = [
        [[e for layer in range(2) for e in routed[layer][b, t].tolist()] for t in range(7 - 2 * b)] for b in range(2)
    ]
    replay = routing_replay_tensors(per_token, n_moe_layers=2, top_k=2, T=7)
    assert len(replay) == 2 and replay[0].shape == (2, 7, 2)
    assert torch.equal(replay[1][0], routed[1][0]) and torch.equal(replay[0][1, :5], routed[0][1, :5])
    assert replay[0][1, 5:].tolist() == [[0, 1], [0, 1]]  # missing tokens: any valid experts
    nested = [[routed[layer][0, t].tolist() for layer in range(2)] for t in range(7)]  # engine Result form [t][l][k]
    assert all(torch.equal(a, b[:1]) for a, b in zip(routing_replay_tensors([nested], 2, 2), routed))
    # replaying the model's own routing gives the same logprobs; forcing other experts changes them
    mask = torch.ones(2, 7)
    plain = forward_logprobs(model, tokens_BT, mask).logprobs_BT
    same = forward_logprobs(model, tokens_BT, mask, routing_replay=replay).logprobs_BT
    torch.testing.assert_close(same[0], plain[0])
    torch.testing.assert_close(same[1, :5], plain[1, :5])
    other = [(r + 1) % 4 for r in routed]
    assert not torch.allclose(forward_logprobs(model, tokens_BT, mask, routing_replay=other).logprobs_BT, plain)


def test_trainer_logprobs_equal_the_engines_on_its_rollouts_with_and_without_replay():
    torch.manual_seed(0)
    model = Transformer(_cfg()).eval()
    prompts = [[5, 17, 33, 2], [8, 40, 61, 9, 12, 70, 3]]
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i) for i in range(2)]
    results = Engine(model, max_batch=2, max_seq_len=64).generate(prompts, params)
    seqs = [p + r.token_ids for p, r in zip(prompts, results)]
    T = max(len(s) for s in seqs)
    tokens_BT = torch.zeros(2, T, dtype=torch.long)
    mask_BT = torch.zeros(2, T)
    for b, (p, s) in enumerate(zip(prompts, seqs)):
        tokens_BT[b, : len(s)] = torch.tensor(s)
        mask_BT[b, len(p) : len(s)] = 1  # the completion tokens
    replay = routing_replay_tensors([r.prompt_routed_experts + r.routed_experts for r in results], 2, 2, T)
    for routing in (None, replay):
        with torch.no_grad():
            lp_BT = forward_logprobs(model, tokens_BT, mask_BT, routing_replay=routing).logprobs_BT
        for b, (p, r) in enumerate(zip(prompts, results)):
            got = lp_BT[b, len(p) : len(p) + len(r.token_ids)]
            assert (got - torch.tensor(r.logprobs)).abs().max() <= 1e-4
