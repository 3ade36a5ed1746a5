"""New weights staged beside a serving model and swapped in by reference (`model.weight_swap`), and the engine's
weight updates built on it."""

from __future__ import annotations

import pytest
import torch

from codefleet.inference.engine import Engine
from codefleet.inference.sampling import SamplingParams
from codefleet.inference.weight_swap import WeightSwap
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer

PROMPT = [[5, 9, 2, 7, 3, 11, 4]]


def _pair(**overrides):
    torch.manual_seed(0)
    serving = Transformer(ModelConfig.tiny(**overrides)).eval()
    torch.manual_seed(1)
    trained = Transformer(ModelConfig.tiny(**overrides)).eval()
    return serving, trained


@pytest.mark.parametrize("overrides", [{}, {"tie_embeddings": True}])
def test_a_swap_equals_load_state_dict_and_reuses_the_replaced_storage(overrides):
    serving, trained = _pair(**overrides)
    swap = WeightSwap(serving)
    x = torch.tensor(PROMPT)
    with torch.no_grad():
        want = trained(x).logits_BTV
        before = {n: t.data_ptr() for n, t in serving.state_dict().items()}
        staged = swap.stage(trained.state_dict())
        assert {n: t.data_ptr() for n, t in serving.state_dict().items()} == before  # staging leaves it alone
        swap.apply(staged)
        assert torch.equal(serving(x).logits_BTV, want)
        if overrides:  # one tensor under two names stays one tensor
            assert serving.lm_head.weight is serving.embed.weight
        swap.apply(swap.stage({k: v + 1 for k, v in trained.state_dict().items()}))  # double buffering
        assert {n: t.data_ptr() for n, t in serving.state_dict().items()} == before
        assert not torch.equal(serving(x).logits_BTV, want)


def test_derived_forms_are_built_while_staging_and_used_after_the_swap():
    serving, trained = _pair(n_experts=4)
    engine = Engine(serving, max_batch=2, max_seq_len=64)
    engine.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))  # builds the derived forms
    owners = [m for m in serving.modules() if m.__dict__.get("_derived_weights")]
    assert owners
    engine.update_weights(trained.state_dict(), version=1)
    installed = {(id(m), k): id(v[1]) for m in owners for k, v in m._derived_weights.items()}
    got = engine.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))[0]
    assert {(id(m), k): id(v[1]) for m in owners for k, v in m._derived_weights.items()} == installed  # none rebuilt
    want = Engine(trained, max_batch=2, max_seq_len=64).generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))[0]
    assert got.token_ids == want.token_ids and got.logprobs == want.logprobs and got.versions == [1] * 4
    assert engine.pause_s > 0


@pytest.mark.parametrize("bad", ["missing", "extra", "shape"])
def test_weights_that_do_not_fit_are_refused_and_the_model_keeps_its_own(bad):
    serving, trained = _pair()
    state = dict(trained.state_dict())
    if bad == "missing":
        state.pop("embed.weight")
    elif bad == "extra":
        state["nope"] = torch.zeros(1)
    else:
        state["embed.weight"] = state["embed.weight"][:-1]
    engine = Engine(serving, max_batch=2, max_seq_len=64)
    before = engine.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))[0]
    with pytest.raises(ValueError, match="do not fit the model"):
        engine.update_weights(state, version=1)
    after = engine.generate(PROMPT, SamplingParams(max_tokens=4, temperature=0))[0]
    assert engine.version == 0 and after.logprobs == before.logprobs
