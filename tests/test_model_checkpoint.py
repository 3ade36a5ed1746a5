"""Checkpoints: save -> load gives the same bits, tied embeddings included; the config survives JSON."""

import json
import os

import pytest
import torch

from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer


def _config(**overrides) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 101, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8,
                                 "n_experts": 4, "top_k": 2, "d_expert": 16, "balance": "bias", **overrides})


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_is_bit_identical(tmp_path, tie):
    model = Transformer(_config(tie_embeddings=tie))
    model.layers[0].ffn.router.expert_bias_E.copy_(torch.linspace(-0.1, 0.1, 4))  # routing state travels too
    checkpoint.save(model, str(tmp_path), metadata={"policy_version": 7})
    assert sorted(os.listdir(tmp_path)) == ["config.json", "metadata.json", "model.safetensors"]
    loaded = checkpoint.load(str(tmp_path))
    assert loaded.config == model.config
    assert checkpoint.read_metadata(str(tmp_path)) == {"policy_version": 7}
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    if tie:
        assert loaded.lm_head.weight is loaded.embed.weight
    tokens_BT = torch.randint(0, 101, (2, 9))
    a, b = model(tokens_BT, return_routing=True), loaded(tokens_BT, return_routing=True)
    assert torch.equal(a.logits_BTV, b.logits_BTV)
    assert all(torch.equal(x, y) for x, y in zip(a.routed_experts, b.routed_experts))


def test_config_json_round_trip_and_errors(tmp_path):
    cfg = ModelConfig.small()
    assert ModelConfig.from_json(cfg.to_json()) == cfg
    assert ModelConfig.from_dict(json.loads(json.dumps(ModelConfig.tiny().to_dict()))) == ModelConfig.tiny()
    with pytest.raises(ValueError, match="unknown field"):
        ModelConfig.from_dict({"d_model": 8, "n_wings": 2})
    with pytest.raises(ValueError, match="router_score"):
        ModelConfig(router_score="relu")
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        checkpoint.load(str(tmp_path))
