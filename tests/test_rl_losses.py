"""PPO-clip, clip-higher, reductions, decoupled PPO, truncated IS, k3 KL and GSPO against hand-computed values."""

import math

import pytest
import torch

from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.rl.losses import LossConfig, add_moe_losses, kl_k2, kl_k3, masked_reduce, policy_loss

ln = math.log


def _lp(values) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32, requires_grad=True)


def test_ppo_clip_inside_and_outside_the_bounds_by_hand():
    # behaviour logprobs 0, so ratio = exp(logp) = r; eps_low 0.2 -> [0.8, ...], eps_high 0.3 -> [..., 1.3]
    r = [1.1, 1.5, 0.5, 0.5, 1.5, 0.9]
    adv = torch.tensor([[1.0, 1.0, 1.0, -1.0, -1.0, -1.0]])
    # -min(rA, clip(r)A):  -1.1 | -min(1.5, 1.3) = -1.3 (clipped) | -min(0.5, 0.8) = -0.5 |
    #                       -min(-0.5, -0.8) = 0.8 (clipped) | -min(-1.5, -1.3) = 1.5 | 0.9
    per_token = torch.tensor([-1.1, -1.3, -0.5, 0.8, 1.5, 0.9])
    logp = _lp([ln(x) for x in r])
    loss, m = policy_loss(logp, torch.zeros(1, 6), adv, torch.ones(1, 6), LossConfig(eps_low=0.2, eps_high=0.3))
    torch.testing.assert_close(loss, per_token.mean())
    assert abs(loss.item() - 0.05) < 1e-6
    assert m["clip_frac"] == pytest.approx(2 / 6) and m["clip_high_frac"] == pytest.approx(1 / 6)
    assert m["clip_low_frac"] == pytest.approx(1 / 6) and m["ratio_mean"] == pytest.approx(1.0)
    assert m["entropy"] == 0  # every sampled token had probability 1 under the behaviour policy
    loss.backward()
    # d/dlogp of -rA/6 is -rA/6 where unclipped, 0 where the clipped term is taken
    expected = torch.tensor([[-1.1, 0.0, -0.5, 0.0, 1.5, 0.9]]) / 6
    torch.testing.assert_close(logp.grad, expected)


def test_asymmetric_bounds_clip_high_and_low_separately():
    logp = _lp([ln(1.25), ln(0.75)])
    adv = torch.tensor([[1.0, -1.0]])
    ones = torch.ones(1, 2)
    # clip-higher (0.2, 0.3): 1.25 < 1.3 is kept (-1.25); 0.75 < 0.8 clips at 0.8: -min(-0.75, -0.8) = 0.8
    loss, m = policy_loss(logp, torch.zeros(1, 2), adv, ones, LossConfig(eps_low=0.2, eps_high=0.3))
    torch.testing.assert_close(loss, torch.tensor((-1.25 + 0.8) / 2))
    assert m["clip_high_frac"] == 0 and m["clip_low_frac"] == 0.5
    # symmetric (0.2, 0.2): 1.25 clips at 1.2
    loss, m = policy_loss(logp, torch.zeros(1, 2), adv, ones, LossConfig(eps_low=0.2, eps_high=0.2))
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 0.8) / 2))
    assert m["clip_high_frac"] == 0.5
    # wide low bound (0.3, 0.3): 0.75 is inside [0.7, 1.3]: -min(-0.75, -0.75) = 0.75
    loss, _ = policy_loss(logp, torch.zeros(1, 2), adv, ones, LossConfig(eps_low=0.3, eps_high=0.3))
    torch.testing.assert_close(loss, torch.tensor((-1.25 + 0.75) / 2))


def test_token_mean_and_seq_mean_differ_on_unequal_lengths():
    # ratio 1 everywhere, so each masked token's loss is -A: sequence 0 has one token (-1), sequence 1 three (+1)
    logp = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])  # one advantage per sequence
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    token, _ = policy_loss(logp, torch.zeros(2, 3), adv, mask, LossConfig(reduction="token_mean"))
    seq, _ = policy_loss(logp, torch.zeros(2, 3), adv, mask, LossConfig(reduction="seq_mean"))
    torch.testing.assert_close(token, torch.tensor((-1 + 3) / 4))  # 0.5
    torch.testing.assert_close(seq, torch.tensor((-1 + 1) / 2))  # 0
    x = torch.tensor([[2.0, 9.0, 9.0], [1.0, 2.0, 3.0]])
    torch.testing.assert_close(masked_reduce(x, mask, "token_mean"), torch.tensor(8 / 4))
    torch.testing.assert_close(masked_reduce(x, mask, "seq_mean"), torch.tensor((2 + 2) / 2))


def _stale_tokens():
    # behaviour 0; prox - behave = log w with w = 1.2, 3, 0.5; logp - prox = log r with r = 1.1, 1, 1.5
    behave = torch.zeros(1, 3)
    prox = torch.tensor([[ln(1.2), ln(3.0), ln(0.5)]])
    logp = (prox + torch.tensor([[ln(1.1), 0.0, ln(1.5)]])).requires_grad_(True)
    return logp, behave, prox


def test_entropy_is_the_sampled_tokens_mean_surprisal_over_the_mask():
    behave = torch.tensor([[ln(0.5), ln(0.25), ln(0.01)]])  # the last token is a tool output: masked out
    _, m = policy_loss(_lp([0.0, 0.0, 0.0]), behave, torch.tensor([1.0]), torch.tensor([[1.0, 1.0, 0.0]]))
    assert m["entropy"] == pytest.approx((ln(2) + ln(4)) / 2)


def test_decoupled_ppo_drops_tokens_over_the_cap_by_hand():
    logp, behave, prox = _stale_tokens()
    cfg = LossConfig(eps_low=0.2, eps_high=0.2, off_policy="decoupled", is_cap=2.0)
    loss, m = policy_loss(logp, behave, torch.tensor([1.0]), torch.ones(1, 3), cfg, prox_logprobs_BT=prox)
    # 1.2 * -1.1 = -1.32 | w = 3 > cap: dropped (0) | 0.5 * -min(1.5, 1.2) = -0.6 ; mean over 3 tokens
    torch.testing.assert_close(loss, torch.tensor((-1.32 + 0.0 - 0.6) / 3))
    assert m["is_dropped_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_mean"] == pytest.approx((1.2 + 0 + 0.5) / 3)
    loss.backward()  # the weight is a constant: d/dlogp = -w r A / 3 where unclipped
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.2 * 1.1 / 3, 0.0, 0.0]]))


def test_truncated_importance_sampling_caps_the_weight_by_hand():
    logp, behave, prox = _stale_tokens()
    cfg = LossConfig(eps_low=0.2, eps_high=0.2, off_policy="tis", is_cap=2.0)
    loss, m = policy_loss(logp, behave, torch.tensor([1.0]), torch.ones(1, 3), cfg, prox_logprobs_BT=prox)
    # -1.32 | min(3, 2) * -1 = -2 | -0.6
    torch.testing.assert_close(loss, torch.tensor((-1.32 - 2.0 - 0.6) / 3))
    assert m["is_weight_mean"] == pytest.approx((1.2 + 2.0 + 0.5) / 3)
    with pytest.raises(ValueError, match="prox_logprobs_BT"):
        policy_loss(logp, behave, torch.tensor([1.0]), torch.ones(1, 3), cfg)


def test_kl_k3_by_hand_and_added_with_its_coefficient():
    logp = torch.tensor([[ln(0.5), ln(0.3)]])
    ref = torch.tensor([[ln(0.25), ln(0.3)]])
    # d = ref - logp = ln 0.5: exp(d) - d - 1 = 0.5 + ln 2 - 1 ; identical policies give 0
    k3 = ln(2) - 0.5
    torch.testing.assert_close(kl_k3(logp, ref), torch.tensor([[k3, 0.0]]))
    # zero advantages: the policy term is 0, the loss is kl_coef * mean k3
    loss, m = policy_loss(
        logp, logp, torch.tensor([0.0]), torch.ones(1, 2), LossConfig(kl_coef=0.1), ref_logprobs_BT=ref
    )
    torch.testing.assert_close(loss, torch.tensor(0.1 * k3 / 2))
    assert m["kl"] == pytest.approx(k3 / 2)
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        policy_loss(logp, logp, torch.tensor([0.0]), torch.ones(1, 2), LossConfig(kl_coef=0.1))


def test_kl_k2_by_hand_and_its_gradient_is_linear_in_the_log_ratio():
    # a token the reference finds 8x likelier than the policy: k3's gradient is 1 - exp(ref - logp) = -7 per unit
    # logp, k2's is logp - ref = -ln 8
    logp = torch.tensor([[ln(0.1), ln(0.3)]], requires_grad=True)
    ref = torch.tensor([[ln(0.8), ln(0.3)]])
    torch.testing.assert_close(kl_k2(logp, ref), torch.tensor([[0.5 * ln(8) ** 2, 0.0]]))
    loss, m = policy_loss(
        logp,
        logp.detach(),
        torch.tensor([0.0]),
        torch.ones(1, 2),
        LossConfig(kl_coef=1.0, kl_estimator="k2"),
        ref_logprobs_BT=ref,
    )
    assert m["kl"] == pytest.approx(0.5 * ln(8) ** 2 / 2)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-ln(8) / 2, 0.0]]))
    k3_logp = logp.detach().clone().requires_grad_()
    policy_loss(
        k3_logp, k3_logp.detach(), torch.tensor([0.0]), torch.ones(1, 2), LossConfig(kl_coef=1.0), ref_logprobs_BT=ref
    )[0].backward()
    torch.testing.assert_close(k3_logp.grad, torch.tensor([[(1 - 8.0) / 2, 0.0]]))
    with pytest.raises(ValueError, match="k3, k2"):
        LossConfig(kl_estimator="k1")


def test_gspo_sequence_ratio_clipped_per_sequence_by_hand():
    # log-ratios (behaviour 0): sequence 0 masked tokens 0.1, 0.3 (the 5.0 is masked out) -> s = e^0.2
    #                           sequence 1: 0.03, -0.03, 0.06 -> s = e^0.02
    logp = torch.tensor([[0.1, 0.3, 5.0], [0.03, -0.03, 0.06]], requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    cfg = LossConfig(eps_low=0.1, eps_high=0.1, ratio_level="sequence")
    loss, m = policy_loss(logp, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask, cfg)
    # sequence 0: A = +1, e^0.2 = 1.2214 > 1.1 -> -1.1 (clipped); sequence 1: A = -1, -min(-e^0.02, -e^0.02) = e^0.02
    torch.testing.assert_close(loss, torch.tensor((-1.1 + math.exp(0.02)) / 2))
    assert m["clip_frac"] == 0.5 and m["ratio_mean"] == pytest.approx((math.exp(0.2) + math.exp(0.02)) / 2)
    loss.backward()
    # only sequence 1 has a gradient: d/dlogp_t of e^mean / 2 = e^0.02 / 3 / 2 per token
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0], [math.exp(0.02) / 6] * 3]))
    with pytest.raises(ValueError, match="GSPO"):
        LossConfig(ratio_level="sequence", off_policy="tis")


def test_gspo_kl_is_per_sequence_so_micro_batches_add_up_to_the_batch():
    # k3 per token of sequence 0 (one masked token) and sequence 1 (two): GSPO averages each sequence first
    logp = torch.zeros(2, 2)
    ref = torch.tensor([[ln(0.5), 0.0], [ln(0.5), ln(2.0)]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    k3 = kl_k3(logp, ref)
    seq = [k3[0, 0], (k3[1, 0] + k3[1, 1]) / 2]
    cfg = LossConfig(ratio_level="sequence", kl_coef=1.0)
    zero = torch.zeros(2)
    loss, m = policy_loss(logp, logp, zero, mask, cfg, ref_logprobs_BT=ref)
    assert m["kl"] == pytest.approx(float(seq[0] + seq[1]) / 2)
    one = slice(0, 1), slice(1, 2)  # one sequence each, weighted by their units (one sequence)
    halves = [policy_loss(logp[i], logp[i], zero[i], mask[i], cfg, ref_logprobs_BT=ref[i])[0] for i in one]
    torch.testing.assert_close(loss, (halves[0] + halves[1]) / 2)


def test_bad_config_names_the_allowed_values():
    with pytest.raises(ValueError, match="token_mean, seq_mean"):
        LossConfig(reduction="sum")


def test_moe_losses_are_added_from_the_model_output():
    cfg = ModelConfig(
        vocab_size=50, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, n_experts=4, top_k=2, d_expert=8
    )
    torch.manual_seed(0)
    out = Transformer(cfg)(torch.randint(0, 50, (2, 5)))
    base = torch.tensor(1.5)
    total = add_moe_losses(base, out)
    assert out.aux_loss.item() > 0 and out.z_loss.item() > 0
    torch.testing.assert_close(total, base + out.aux_loss + out.z_loss)
