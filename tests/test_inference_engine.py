"""The engine on the real tiny MoE transformer: logprob parity with the trainer's forward (with and without
routing replay), continuous batching equal to one-at-a-time, weight updates while generating, stops."""

from __future__ import annotations

import threading

import pytest
import torch

from codefleet.chat.tokenizer import default_tokenizer
from codefleet.inference.engine import Engine
from codefleet.inference.sampling import SamplingParams
from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
from codefleet.model.transformer import Transformer, token_logprobs

GREEDY = SamplingParams(max_tokens=12, temperature=0)


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


def prompts(n: int, seed: int = 0, lengths=(3, 9, 5, 14, 2, 7)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(16, 1000, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def trainer_logprobs(model, prompt, result, replay: bool) -> torch.Tensor:
    """What the trainer computes: one full forward over prompt + completion, logprobs of the completion."""
    tokens_BT = torch.tensor([prompt + result.token_ids])
    routing = None
    if replay:  # every token's experts as the engine routed them
        experts_TLK = torch.tensor(result.prompt_routed_experts + result.routed_experts)
        routing = [experts_TLK[None, :, layer] for layer in range(experts_TLK.shape[1])]
    with torch.no_grad():
        turn_mask_BT = torch.zeros_like(tokens_BT, dtype=torch.bool)
        turn_mask_BT[0, len(prompt) - 1 : -1] = True  # the queries that predict the completion
        logits_BTV = model(tokens_BT, routing_replay=routing, turn_mask_BT=turn_mask_BT).logits_BTV
    lp = token_logprobs(logits_BTV[:, :-1], tokens_BT[:, 1:])
    return lp[0, len(prompt) - 1 :]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_logprobs_equal_the_trainers_forward_with_and_without_routing_replay(model, temperature):
    engine = Engine(model, max_batch=4, max_seq_len=64)
    ps = prompts(6, seed=1)
    params = [SamplingParams(max_tokens=10 + i, temperature=temperature, seed=i) for i in range(6)]
    results = engine.generate(ps, params)  # 6 requests through 4 slots: they join and leave
    for prompt, result in zip(ps, results):
        assert len(result.token_ids) == len(result.logprobs) == len(result.versions) == len(result.routed_experts)
        assert len(result.prompt_routed_experts) == len(prompt)
        engine_lp = torch.tensor(result.logprobs)
        for replay in (False, True):
            diff = (trainer_logprobs(model, prompt, result, replay) - engine_lp).abs().max().item()
            assert diff <= 1e-4, (replay, diff)


def test_continuous_batching_gives_the_same_greedy_tokens_as_one_at_a_time(model):
    ps = prompts(7, seed=2)
    alone = [Engine(model, max_batch=1, max_seq_len=64).generate([p], GREEDY)[0].token_ids for p in ps]
    engine = Engine(model, max_batch=3, max_seq_len=64)
    limits = [SamplingParams(max_tokens=12 - (i % 3) * 4, temperature=0) for i in range(7)]  # leave at 12, 8, 4
    batched = engine.generate(ps, limits)
    assert engine.peak_batch == 3
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert b.token_ids == a[: limits[i].max_tokens]
        assert b.finish_reason == "length"


def test_update_weights_mid_generation_changes_the_version_of_later_tokens(model):
    engine = Engine(model, max_batch=4, max_seq_len=64, version=3)
    futures = [engine.add(p, SamplingParams(max_tokens=10, temperature=0)) for p in prompts(2, seed=3)]
    for _ in range(4):
        engine.step()
    perturbed = {
        k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v for k, v in model.state_dict().items()
    }
    original = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        engine.update_weights(perturbed, version=4)
        while not all(f.done() for f in futures):
            engine.step()
        for f in futures:
            versions = f.result().versions
            assert versions[0] == 3 and versions[-1] == 4
            assert versions == sorted(versions) and len(set(versions)) == 2
            cut = versions.index(4)
            assert 1 <= cut <= 5  # in-flight sequences continued under the new weights
    finally:
        engine.update_weights(original, version=5)


def test_update_weights_from_another_thread_while_the_background_loop_serves(model):
    engine = Engine(model, max_batch=4, max_seq_len=128)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        future = engine.submit(prompts(1)[0], SamplingParams(max_tokens=100, temperature=0))
        updater = threading.Thread(target=engine.update_weights, args=(state, 9))
        updater.start()
        updater.join(timeout=30)
        assert not updater.is_alive()
        result = future.result(timeout=60)
        assert result.versions[-1] == 9 and engine.version == 9
        with pytest.raises(
            ValueError, match="do not fit the model"
        ):  # a bad state dict is the caller's error; the engine keeps serving
            engine.update_weights({"nope": torch.zeros(1)}, version=10)
        assert engine.version == 9
        assert len(engine.submit(prompts(1)[0], GREEDY).result(timeout=60).token_ids) == 12
    finally:
        engine.close()


def test_stop_tokens_and_stop_strings_end_a_sequence(model):
    from codefleet.chat.tokenizer import default_tokenizer

    tokenizer = default_tokenizer()
    engine = Engine(model, tokenizer, max_batch=2, max_seq_len=64)
    prompt = prompts(1, seed=4)[0]
    free = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    stopped = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id]))[0]
    assert stopped.token_ids == free.token_ids[: first + 1]  # the stop token is kept (RL trains on it)
    assert stopped.finish_reason == "stop" and stopped.stop == stop_id
    assert stopped.text == tokenizer.decode(free.token_ids[:first])
    needle = tokenizer.decode(free.token_ids[6:8])
    cut = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop=[needle]))[0]
    assert cut.finish_reason == "stop" and cut.stop == needle
    assert needle not in cut.text and tokenizer.decode(free.token_ids).startswith(cut.text)
    assert len(cut.token_ids) <= 8


def test_cancelled_and_oversized_requests(model):
    engine = Engine(model, max_batch=2, max_seq_len=32)
    with pytest.raises(ValueError, match="raise max_seq_len"):
        engine.add(list(range(16, 48)), GREEDY)
    for bad in ([5, model.config.vocab_size], [-1, 5]):  # refused alone, before it can fail a batch
        with pytest.raises(ValueError, match="encode the prompt with the model's tokenizer"):
            engine.add(bad, GREEDY)
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        Engine(model, max_batch=0)
    long = engine.add(prompts(1)[0], SamplingParams(max_tokens=25, temperature=0))
    other = engine.add(prompts(1, seed=5)[0], SamplingParams(max_tokens=6, temperature=0))
    engine.step()
    assert long.cancel()
    while not other.done():
        engine.step()
    assert engine.n_running == 0 and long.cancelled()
    # max_tokens beyond the context ends with "length" at the context
    capped = engine.generate([prompts(1)[0]], SamplingParams(max_tokens=100, temperature=0))[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) + len(capped.prompt_token_ids) == 32


def test_a_request_cancelled_while_it_is_resolved_leaves_the_rest_of_the_batch_alone(model):
    """A client cancels from another thread at any moment, also between the engine's done() check and
    set_result; the other requests in the batch must not fail with it."""
    tokenizer, victim = default_tokenizer(), []

    class CancelWhileDecoding:  # the real tokenizer; the victim's client disconnects while its text is decoded
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def decode(self, ids, *args, **kwargs):
            victim[0].cancel()
            return tokenizer.decode(ids, *args, **kwargs)

    engine = Engine(model, CancelWhileDecoding(), max_batch=2, max_seq_len=64)
    victim.append(engine.add(prompts(1)[0], SamplingParams(max_tokens=2, temperature=0)))
    bystander = engine.add(prompts(1, seed=5)[0], SamplingParams(max_tokens=8, temperature=0))
    while not bystander.done():
        engine.step()
    assert victim[0].cancelled()
    assert bystander.exception() is None and len(bystander.result().token_ids) == 8
