"""Token-in, token-out across turns: the episode's sequence is what the engine saw and sampled, and the
trainer's logprobs over it equal the engine's (with and without routing replay), on codefleet's own MoE and on a
Qwen3-MoE Hugging Face checkpoint."""

from __future__ import annotations

import pytest
import torch

from codefleet.agent.clients import LocalEnginePolicy
from codefleet.agent.clients.episode_tokens import EpisodeTokens
from codefleet.agent.policy import PolicyError
from codefleet.agent.tools import tool_schemas
from codefleet.bench.tiny_hf import make_tiny_hf
from codefleet.chat import codefleet_template
from codefleet.chat.tokenizer import default_tokenizer
from codefleet.inference.engine import Engine
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.rl.logprobs import forward_logprobs, routing_replay_tensors


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    e = Engine(Transformer(ModelConfig.tiny()), default_tokenizer(), max_batch=4, max_seq_len=2048)
    yield e
    e.close()


def _three_turns(policy):
    messages = [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "Make sub return a - b."}]
    for turn in range(3):
        out = policy.generate(messages, tool_schemas())
        messages.append({"role": "assistant", "content": out.text})
        messages.append({"role": "tool", "content": f"result {turn}: <|end|> is plain text here"})
        if turn == 1:
            messages.append({"role": "user", "content": "a correction"})
    return messages


def test_each_prompt_extends_the_exact_sampled_sequence(engine):
    sent = []
    original = engine.submit

    def spy(prompt, params=None, on_token=None):
        sent.append(list(prompt))
        return original(prompt, params, on_token)

    engine.submit = spy
    try:
        policy = LocalEnginePolicy(engine=engine, max_tokens=12, temperature=1.0, seed=3).for_episode()
        _three_turns(policy)
    finally:
        del engine.submit
    tokens = policy.tokens
    assert len(sent) == 3 and len(tokens.turn_ends) == 3
    for k in (1, 2):  # turn k's prompt starts with everything through turn k-1's sampled tokens
        assert sent[k][: tokens.turn_ends[k - 1]] == tokens.ids[: tokens.turn_ends[k - 1]]
        assert len(sent[k]) > tokens.turn_ends[k - 1]
    assert sent[0] == codefleet_template.encode_chat(
        engine.tokenizer,
        [{"role": "system", "content": "You fix code."}, {"role": "user", "content": "Make sub return a - b."}],
        tool_schemas(),
    )
    n = len(tokens.ids)
    assert len(tokens.mask) == len(tokens.logprobs) == len(tokens.versions) == len(tokens.routing) == n
    sampled = sum(tokens.mask)
    assert 3 <= sampled <= 36 and tokens.mask[0] == 0
    # the tool text spelling a special token stays plain bytes: exactly 3 <|end|> ids come from turns' ends + roles
    assert all((v >= 0) == bool(m) for v, m in zip(tokens.versions, tokens.mask))


@pytest.fixture(scope="module")
def qwen3_moe_engine(tmp_path_factory):
    """A tiny random Qwen3-MoE Hugging Face checkpoint on the engine, with its own tokenizer and template."""
    e = Engine.load(
        make_tiny_hf(str(tmp_path_factory.mktemp("qwen3-moe")), arch="qwen3_moe"), max_batch=4, max_seq_len=2048
    )
    yield e
    e.close()


@pytest.mark.parametrize("which", ["engine", "qwen3_moe_engine"])
def test_trainer_logprobs_over_the_episode_equal_the_engines(which, request):
    engine = request.getfixturevalue(which)
    policy = LocalEnginePolicy(engine=engine, max_tokens=10, temperature=1.0, seed=5).for_episode()
    _three_turns(policy)
    t: EpisodeTokens = policy.tokens
    cfg = engine.model.config
    tokens_BT = torch.tensor([t.ids])
    mask_BT = torch.tensor([t.mask], dtype=torch.float32)
    with torch.no_grad():
        plain = forward_logprobs(engine.model, tokens_BT, mask_BT).logprobs_BT[0]
        routing = routing_replay_tensors([t.routed_experts()], cfg.n_moe_layers, cfg.top_k, len(t.ids))
        replay = forward_logprobs(engine.model, tokens_BT, mask_BT, routing).logprobs_BT[0]
    engine_lp = torch.tensor(t.logprobs) * mask_BT[0]
    assert torch.allclose(plain, engine_lp, atol=1e-4), (plain - engine_lp).abs().max()
    assert torch.allclose(replay, engine_lp, atol=1e-4), (replay - engine_lp).abs().max()


def test_an_edited_conversation_is_a_clear_policy_error(engine):
    policy = LocalEnginePolicy(engine=engine, max_tokens=4, temperature=0).for_episode()
    messages = [{"role": "user", "content": "hi"}]
    out = policy.generate(messages, [])
    messages.append({"role": "assistant", "content": out.text})
    with pytest.raises(PolicyError, match="chat template"):
        policy.generate(messages[:1], [])  # shrank instead of growing
