"""LocalEnginePolicy: the agent's Policy over the in-process engine, token-in/token-out, in the real loop."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from codefleet.agent import AgentLoop, build_messages
from codefleet.agent.clients import LocalEnginePolicy, LocalEngineUnavailableError, build_policy
from codefleet.agent.tools import tool_schemas
from codefleet.chat import codefleet_template
from codefleet.chat.tokenizer import default_tokenizer
from codefleet.chat.tool_parser import PARSERS
from codefleet.inference.engine import Engine
from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.types import Budgets

USER = [{"role": "user", "content": "Make sub return a - b."}]


@pytest.fixture(scope="module")
def engine():
    torch.manual_seed(0)
    e = Engine(Transformer(ModelConfig.tiny()), default_tokenizer(), max_batch=8, max_seq_len=1024)
    yield e
    e.close()


def test_a_turn_carries_the_exact_tokens_logprobs_versions_and_routing(engine):
    policy = LocalEnginePolicy(engine=engine, max_tokens=16, temperature=1.0, seed=0)
    out = policy.generate(USER, tool_schemas())
    n = out.completion_tokens
    assert 1 <= n <= 16 and len(out.token_ids) == len(out.logprobs) == len(out.policy_versions) == n
    assert out.prompt_tokens == len(codefleet_template.encode_chat(engine.tokenizer, USER, tool_schemas()))
    assert out.policy_versions == [engine.version] * n and all(lp <= 0 for lp in out.logprobs)
    config = engine.model.config
    moe_layers = len(out.routed_experts[0]) // config.top_k
    assert 1 <= moe_layers <= config.n_layers
    assert (
        all(
            len(r) == moe_layers * config.top_k and all(0 <= e < config.n_experts for e in r)
            for r in out.routed_experts
        )
        and len(out.routed_experts) == n
    )
    ids = out.token_ids[:-1] if out.token_ids[-1] in codefleet_template.stop_ids(engine.tokenizer) else out.token_ids
    assert out.text == PARSERS["codefleet"].parse(engine.tokenizer.decode(ids)).content
    assert out.finish_reason in ("stop", "length", "tool_calls")


def test_parallel_attempts_share_the_engine(engine):
    policy = LocalEnginePolicy(engine=engine, max_tokens=20, temperature=0)
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: policy.generate([{"role": "user", "content": f"try {i}"}], []), range(4)))
    assert all(o.completion_tokens >= 1 for o in outs)
    assert engine.peak_batch > 1


def test_build_policy_loads_a_checkpoint_and_refuses_without_one(tmp_path):
    torch.manual_seed(0)
    checkpoint.save(Transformer(ModelConfig.tiny()), str(tmp_path / "ckpt"))
    policy = build_policy(f"local:{tmp_path / 'ckpt'}", max_tokens=4)
    try:
        assert isinstance(policy, LocalEnginePolicy) and policy.generate(USER, []).completion_tokens >= 1
    finally:
        policy.engine.close()
    with pytest.raises(LocalEngineUnavailableError, match="local:DIR"):
        build_policy("local")


def test_the_agent_loop_runs_on_the_local_engine(engine, sandbox):
    policy = LocalEnginePolicy(engine=engine, max_tokens=24, temperature=1.0, seed=1)
    trajectory = AgentLoop(policy, sandbox, budgets=Budgets(max_turns=2)).run(build_messages("look around"))
    assert trajectory.n_turns >= 1 and trajectory.stop_reason in ("no_tool_calls", "max_turns", "submit")
    turn = trajectory.turns[0]
    assert turn.token_ids and len(turn.token_ids) == len(turn.logprobs) == len(turn.routed_experts)
