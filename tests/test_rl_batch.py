"""Engine rollouts -> RLBatch -> rl_loss: the first step is on-policy (ratio 1) and raises the logprob of
tokens with positive advantage; collate pads and keeps the routing."""

import pytest
import torch

from codefleet.inference.engine import Engine
from codefleet.inference.sampling import SamplingParams
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.rl.batch import Sample, collate, rl_loss
from codefleet.rl.logprobs import forward_logprobs
from codefleet.rl.losses import LossConfig


def _cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=4, top_k=2, d_expert=16
    )


def test_collate_pads_and_masks_by_hand():
    s0 = Sample([1, 2, 3], [0, 1, 1], [0.0, -0.5, -0.25], 1.0, [[0, 1, 2, 3]] * 3)
    s1 = Sample([4, 5], [0, 1], [9.0, -2.0], -1.0, [[1, 2, 3, 0]] * 2)
    batch = collate([s0, s1], n_moe_layers=2, top_k=2)
    assert batch.tokens_BT.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert batch.mask_BT.tolist() == [[0, 1, 1], [0, 1, 0]]
    assert batch.behave_logprobs_BT.tolist() == [[0.0, -0.5, -0.25], [0.0, -2.0, 0.0]]  # 0 off the mask
    assert batch.advantages_B.tolist() == [1.0, -1.0]
    assert batch.routing_replay[1][1].tolist() == [[3, 0], [3, 0], [0, 1]]  # layer 1 of sample 1, padded
    assert collate([s0, Sample([4, 5], [0, 1], [0.0, -2.0], -1.0)], 2, 2).routing_replay is None
    with pytest.raises(ValueError, match="first token"):
        collate([Sample([1, 2], [1, 1], [0.0, 0.0], 1.0)])


@pytest.mark.parametrize("replay", [False, True])
def test_rl_step_on_engine_rollouts_is_on_policy_and_moves_logprobs_with_the_advantage(replay):
    torch.manual_seed(0)
    model = Transformer(_cfg())
    prompts = [[5, 17, 33, 2], [8, 40, 61, 9, 12]]
    results = Engine(model.eval(), max_batch=2, max_seq_len=64).generate(
        prompts, [SamplingParams(max_tokens=6, temperature=1.0, seed=i) for i in range(2)]
    )
    samples = [
        Sample(
            p + r.token_ids,
            [0] * len(p) + [1] * len(r.token_ids),
            [0.0] * len(p) + r.logprobs,
            adv,
            r.prompt_routed_experts + r.routed_experts,
        )
        for p, r, adv in zip(prompts, results, (1.0, -1.0))
    ]
    batch = collate(samples, n_moe_layers=2, top_k=2)
    model.train()
    loss, metrics = rl_loss(model, batch, LossConfig(), routing_replay=replay)
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["clip_frac"] == 0
    assert metrics["aux_loss"] > 0
    before = forward_logprobs(model, batch.tokens_BT, batch.mask_BT).logprobs_BT.detach()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loss.backward()
    opt.step()
    with torch.no_grad():
        after = forward_logprobs(model, batch.tokens_BT, batch.mask_BT).logprobs_BT
    n0, n1 = batch.mask_BT.sum(-1).tolist()
    assert (after[0] - before[0]).sum() / n0 > 0  # advantage +1: its sampled tokens became likelier
    assert (after[1] - before[1]).sum() / n1 < 0  # advantage -1: less likely
    with pytest.raises(ValueError, match="no routing"):
        rl_loss(model, collate(samples), routing_replay=True)
