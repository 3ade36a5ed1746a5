"""The engine's prefix cache on the real tiny MoE transformer: a multi-turn conversation and a group sharing a
prompt reuse parked keys/values and get the tokens, logprobs and routing of a cold engine; the trainer's
forward agrees over the whole sequence; weight updates and eviction drop what may no longer be reused."""

from __future__ import annotations

import pytest
import torch

from codefleet.inference.engine import Engine
from codefleet.inference.prefix_cache import common_prefix as _common_prefix
from codefleet.inference.sampling import SamplingParams
from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
from codefleet.model.transformer import Transformer, token_logprobs

GREEDY = SamplingParams(max_tokens=10, temperature=0)


@pytest.fixture(scope="module", params=["plain", "copy_head", "copy_prompt_match", "copy_blocked"])
def model(request):
    torch.manual_seed(0)
    copy = {
        "plain": CopyConfig(),
        "copy_head": CopyConfig(head=True),
        "copy_prompt_match": CopyConfig(head=True, scope="prompt", match=True),
        "copy_blocked": CopyConfig(head=True, scope="prompt", match=True, blocked=list(range(16, 600))),
    }[request.param]
    return Transformer(ModelConfig.tiny(copy=copy)).eval()


def pieces(n: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(16, 1000, (length,), generator=g).tolist() for _ in range(n)]


def conversation(engine: Engine, turns: int, seed: int = 0):
    """Each turn's prompt is the previous prompt + the sampled tokens + a new "tool output"."""
    first, *outputs = pieces(turns, 30, seed)
    prompt, results = first, []
    for turn in range(turns):
        result = engine.generate([prompt], GREEDY)[0]
        results.append(result)
        if turn + 1 < turns:
            prompt = prompt + result.token_ids + outputs[turn]
    return results


def test_a_multi_turn_conversation_reuses_its_prefix_and_samples_what_a_cold_engine_samples(model):
    cold = conversation(Engine(model, max_batch=2, max_seq_len=256, prefix_slots=0), turns=4)
    engine = Engine(model, max_batch=2, max_seq_len=256)
    warm = conversation(engine, turns=4)
    for c, w in zip(cold, warm):
        assert w.token_ids == c.token_ids
        assert w.prompt_routed_experts == c.prompt_routed_experts and w.routed_experts == c.routed_experts
        assert (torch.tensor(w.logprobs) - torch.tensor(c.logprobs)).abs().max().item() <= 1e-4
    # turn t reuses everything the previous turn ran: its prompt and every sampled token
    assert [r.cached_tokens for r in warm] == [0] + [len(r.prompt_token_ids) + len(r.token_ids) for r in warm[:-1]]
    assert engine.prefix_hits == 3
    assert engine.prefill_tokens_computed == 30 + 3 * 30  # only the new tool outputs were prefilled


def test_the_trainers_forward_over_a_reused_prefix_equals_the_engines_logprobs_with_routing_replay(model):
    """One forward over the whole conversation (as RL trains it): every turn's logprobs are the engine's."""
    engine = Engine(model, max_batch=2, max_seq_len=256)
    turns = conversation(engine, turns=3, seed=1)
    last = turns[-1]
    assert last.cached_tokens > 0
    tokens_BT = torch.tensor([last.prompt_token_ids + last.token_ids])
    turn_mask_BT = torch.zeros_like(tokens_BT, dtype=torch.bool)  # the queries that predict each turn's tokens
    for r in turns:
        turn_mask_BT[0, len(r.prompt_token_ids) - 1 : len(r.prompt_token_ids) + len(r.token_ids) - 1] = True
    experts_TLK = torch.tensor(last.prompt_routed_experts + last.routed_experts)
    for replay in (None, [experts_TLK[None, :, layer] for layer in range(experts_TLK.shape[1])]):
        with torch.no_grad():
            logits_BTV = model(tokens_BT, routing_replay=replay, turn_mask_BT=turn_mask_BT).logits_BTV
        trainer = token_logprobs(logits_BTV[:, :-1], tokens_BT[:, 1:])[0]
        for r in turns:
            n = len(r.prompt_token_ids)
            assert (trainer[n - 1 : n - 1 + len(r.token_ids)] - torch.tensor(r.logprobs)).abs().max().item() <= 1e-4


def test_a_group_sharing_a_prompt_copies_the_common_prefix_and_keeps_the_entry(model):
    system, a, b = pieces(3, 40, seed=2)
    engine = Engine(model, max_batch=4, max_seq_len=256, prefix_slots=4)
    cold = Engine(model, max_batch=4, max_seq_len=256, prefix_slots=0)
    engine.generate([system + a], GREEDY)
    # two attempts that share only the system prompt: both copy its 40 tokens from the one parked entry
    results = engine.generate([system + b, system + a[:5] + b], GREEDY)
    assert [r.cached_tokens for r in results] == [40, 45]
    expected = cold.generate([system + b, system + a[:5] + b], GREEDY)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    # an identical prompt reuses all but its last token (whose logits sample the first new token)
    again = engine.generate([system + a], GREEDY)[0]
    assert again.cached_tokens == 79
    assert again.token_ids == cold.generate([system + a], GREEDY)[0].token_ids


def test_attempts_admitted_together_can_all_extend_the_same_entry_whole(model):
    """Attempts of a group that sampled the same turn send the same next prompt: each copies the whole parked
    entry, which is freed only after the last copy (it was freed after the first, and the second failed the
    engine step and every request in it)."""
    first, a, b = pieces(3, 30, seed=4)
    engine = Engine(model, max_batch=4, max_seq_len=256, prefix_slots=4)
    cold = Engine(model, max_batch=4, max_seq_len=256, prefix_slots=0)
    turn = engine.generate([first], GREEDY)[0]
    prompts = [first + turn.token_ids + a, first + turn.token_ids + b]
    results = engine.generate(prompts, GREEDY)
    whole = len(first) + len(turn.token_ids)
    assert [r.cached_tokens for r in results] == [whole, whole]
    assert [r.token_ids for r in results] == [r.token_ids for r in cold.generate(prompts, GREEDY)]
    assert all(len(p.tokens) != whole or p.tokens != prompts[0][:whole] for p in engine._parked)  # superseded


def test_a_weight_update_drops_every_parked_prefix(model):
    engine = Engine(model, max_batch=2, max_seq_len=128)
    prompt = pieces(1, 30, seed=3)[0]
    engine.generate([prompt], GREEDY)
    assert len(engine._parked) == 1
    engine.update_weights({k: v.clone() for k, v in model.state_dict().items()}, version=1)
    assert not engine._parked
    assert engine.generate([prompt], GREEDY)[0].cached_tokens == 0


def test_a_sequence_running_across_a_weight_update_is_not_parked():
    """Its keys/values come partly from the old weights, so its next turn must not reuse them."""
    torch.manual_seed(0)
    engine = Engine(Transformer(ModelConfig.tiny()), max_batch=2, max_seq_len=128)
    torch.manual_seed(1)
    new = Transformer(ModelConfig.tiny()).eval()
    prompt = pieces(1, 30, seed=6)[0]
    future = engine.add(prompt, SamplingParams(max_tokens=12, temperature=0))
    for _ in range(4):
        engine.step()
    engine.update_weights({k: v.clone() for k, v in new.state_dict().items()}, version=1)
    while not future.done():
        engine.step()
    first = future.result()
    assert set(first.versions) == {0, 1} and not engine._parked
    turn = prompt + first.token_ids + [7, 8, 9]
    warm = engine.generate([turn], GREEDY)[0]
    cold = Engine(new, max_batch=2, max_seq_len=128, prefix_slots=0).generate([turn], GREEDY)[0]
    assert warm.cached_tokens == 0 and warm.token_ids == cold.token_ids
    assert warm.logprobs == pytest.approx(cold.logprobs, abs=1e-5)
    # a turn run wholly under the new weights is parked and reused again
    assert engine.generate([turn + warm.token_ids + [7]], GREEDY)[0].cached_tokens > 0


def test_the_least_recently_used_prefix_is_evicted_and_short_ones_are_not_parked(model):
    engine = Engine(model, max_batch=1, max_seq_len=128, prefix_slots=2, min_prefix=16)
    p1, p2, p3 = pieces(3, 30, seed=4)
    for p in (p1, p2):
        engine.generate([p], GREEDY)
    engine.generate([p1 + [5]], GREEDY)  # touches p1's entry (a partial hit keeps it, and parks the new one)
    assert engine.prefix_hits == 1
    engine.generate([p3], GREEDY)  # full: evicts the least recently used
    remaining = [p.tokens[:30] for p in engine._parked]
    assert p2 not in remaining and p3 in remaining
    engine.generate([[20, 21, 22]], SamplingParams(max_tokens=3, temperature=0))  # 5 tokens < min_prefix
    assert all(len(p.tokens) >= 16 for p in engine._parked)


def test_common_prefix_lengths():
    assert _common_prefix([1, 2, 3, 4], [1, 2, 9], 10) == 2
    assert _common_prefix([1, 2, 3], [1, 2, 3, 4], 10) == 3
    assert _common_prefix([1, 2, 3], [1, 2, 3, 4], 2) == 2
    assert _common_prefix([5], [1], 10) == 0
    assert _common_prefix(list(range(1000)), list(range(777)) + [0], 5000) == 777
