"""The slot KV cache and batched sampling, without a model: exact against plain attention and plain softmax."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from codefleet.inference.cache import CacheFullError, SlotKVCache
from codefleet.inference.sampling import SamplingParams, sample_next

H, HKV, D = 4, 2, 8


def reference(q_BHTD, k_BHTD, v_BHTD):
    """Causal attention over one sequence's whole history, kv heads repeated (HF repeat_kv convention)."""
    G = q_BHTD.shape[1] // k_BHTD.shape[1]
    k, v = k_BHTD.repeat_interleave(G, 1), v_BHTD.repeat_interleave(G, 1)
    Tq, Tk = q_BHTD.shape[2], k.shape[2]
    mask = torch.ones(Tq, Tk, dtype=torch.bool).tril(diagonal=Tk - Tq)
    return F.scaled_dot_product_attention(q_BHTD, k, v, attn_mask=mask)


def test_prefill_of_different_lengths_then_decode_matches_full_attention():
    torch.manual_seed(0)
    cache = SlotKVCache(n_layers=2, n_slots=4, n_kv_heads=HKV, head_dim=D, max_len=32)
    lengths = [5, 3, 7]
    T = max(lengths)
    q, k, v = torch.randn(3, H, T, D), torch.randn(3, HKV, T, D), torch.randn(3, HKV, T, D)
    cache.begin([0, 1, 2], [0, 0, 0], lengths, T)
    out = cache.attend(1, q, k, v)
    cache.end()
    assert cache.lengths[:3] == lengths
    history = []
    for b, n in enumerate(lengths):
        ref = reference(q[b : b + 1, :, :n], k[b : b + 1, :, :n], v[b : b + 1, :, :n])
        torch.testing.assert_close(out[b : b + 1, :, :n], ref, rtol=0, atol=1e-6)
        history.append((q[b : b + 1, :, :n], k[b : b + 1, :, :n], v[b : b + 1, :, :n]))
    for _ in range(3):  # decode steps: each row at its own length
        q1, k1, v1 = torch.randn(3, H, 1, D), torch.randn(3, HKV, 1, D), torch.randn(3, HKV, 1, D)
        cache.begin([0, 1, 2], list(cache.lengths[:3]), [1, 1, 1], 1)
        out = cache.attend(1, q1, k1, v1)
        cache.end()
        for b in range(3):
            hq, hk, hv = history[b]
            history[b] = (
                torch.cat([hq, q1[b : b + 1]], 2),
                torch.cat([hk, k1[b : b + 1]], 2),
                torch.cat([hv, v1[b : b + 1]], 2),
            )
            ref = reference(*history[b])[:, :, -1:]
            torch.testing.assert_close(out[b : b + 1], ref, rtol=0, atol=1e-6)
    assert cache.lengths[:3] == [n + 3 for n in lengths]


def test_unpacked_slots_gather_and_moved_slots_keep_their_history():
    torch.manual_seed(1)
    cache = SlotKVCache(n_layers=1, n_slots=4, n_kv_heads=HKV, head_dim=D, max_len=16)
    q, k, v = torch.randn(1, H, 4, D), torch.randn(1, HKV, 4, D), torch.randn(1, HKV, 4, D)
    cache.begin([3], [0], [4], 4)
    cache.attend(0, q, k, v)
    cache.end()
    cache.move(3, 1)
    assert cache.lengths[1] == 4 and cache.lengths[3] == 0
    q1, k1, v1 = torch.randn(1, H, 1, D), torch.randn(1, HKV, 1, D), torch.randn(1, HKV, 1, D)
    cache.begin([1], [4], [1], 1)  # slot 1 alone: not the packed prefix [0], so the cache gathers
    out = cache.attend(0, q1, k1, v1)
    cache.end()
    ref = reference(torch.cat([q, q1], 2), torch.cat([k, k1], 2), torch.cat([v, v1], 2))[:, :, -1:]
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


def test_a_sequence_past_max_len_is_refused_with_advice():
    cache = SlotKVCache(n_layers=1, n_slots=1, n_kv_heads=HKV, head_dim=D, max_len=4)
    with pytest.raises(CacheFullError, match="raise max_seq_len"):
        cache.begin([0], [4], [1], 1)


def test_greedy_top_k_1_and_tiny_top_p_pick_the_argmax_and_logprobs_are_temperature_1():
    torch.manual_seed(2)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=1.3, top_p=1e-6),
        SamplingParams(temperature=0.01),
        SamplingParams(temperature=1e-40),
    ]  # float32 logits / 1e-40 overflow: below MIN_TEMPERATURE is greedy
    logits = torch.cat([logits, logits[:1]])
    tokens, logprobs = sample_next(logits, params, [None] * 5, torch.Generator().manual_seed(0))
    assert tokens.tolist() == logits.argmax(-1).tolist()
    expected = torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, expected)  # the model's own logprob, whatever the temperature


def test_seeded_rows_sample_the_same_alone_or_batched_and_follow_the_distribution():
    torch.manual_seed(3)
    logits = torch.randn(3, 20)
    seeded = SamplingParams(temperature=1.0, seed=7)

    def gen(seed):
        return torch.Generator().manual_seed(seed)

    alone = [sample_next(logits[1:2], [seeded], [gen(7)])[0].item() for _ in range(2)]
    batched = sample_next(logits, [SamplingParams()] * 3, [None, gen(7), None], gen(0))[0][1].item()
    assert alone[0] == alone[1] == batched
    # top-k 3 never leaves the three best tokens, and the draws follow their renormalised probabilities
    row = logits[0:1].expand(4000, 20)
    params = [SamplingParams(top_k=3)] * 4000
    draws = sample_next(row, params, [None] * 4000, gen(1))[0]
    best3 = logits[0].topk(3).indices
    assert set(draws.tolist()) <= set(best3.tolist())
    freq = torch.stack([(draws == t).float().mean() for t in best3])
    torch.testing.assert_close(freq, torch.softmax(logits[0, best3], 0), atol=0.03, rtol=0)


def test_sampling_params_say_what_is_wrong():
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0).validate()
    with pytest.raises(ValueError, match="max_tokens must be a positive integer"):
        SamplingParams(max_tokens=0).validate()
    with pytest.raises(ValueError, match="seed must be a signed 64-bit integer"):
        SamplingParams(seed=2**63).validate()
    SamplingParams(seed=-(2**63)).validate()
