"""Checkpoints: save -> load gives the same bits, tied embeddings included; the config survives JSON."""

import json
import os

import pytest
import torch

from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
from codefleet.model.transformer import Transformer


def _config(**overrides) -> ModelConfig:
    return ModelConfig(
        **{
            "vocab_size": 101,
            "d_model": 32,
            "n_layers": 2,
            "n_heads": 4,
            "n_kv_heads": 2,
            "head_dim": 8,
            "n_experts": 4,
            "top_k": 2,
            "d_expert": 16,
            "balance": "bias",
            **overrides,
        }
    )


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
    copying = ModelConfig.tiny(copy=CopyConfig(prev_tokens=3, head=True, scope="prompt", match=True, blocked=[5, 9]))
    assert ModelConfig.from_json(copying.to_json()) == copying
    assert ModelConfig.from_dict(json.loads(json.dumps(ModelConfig.tiny().to_dict()))) == ModelConfig.tiny()
    with pytest.raises(ValueError, match="unknown field"):
        ModelConfig.from_dict({"d_model": 8, "n_wings": 2})
    with pytest.raises(ValueError, match="router_score"):
        ModelConfig(router_score="relu")
    with pytest.raises(FileNotFoundError, match="not a checkpoint directory"):
        checkpoint.load(str(tmp_path))


@pytest.mark.parametrize("read", ["load", "check"])
def test_a_corrupt_or_mismatched_checkpoint_is_a_value_error_naming_the_file(tmp_path, read):
    """`load` reads the weights; `check` only their header, and says the same."""
    from codefleet.inference.engine import Engine

    path = str(tmp_path / "ckpt")
    checkpoint.save(Transformer(_config()), path)
    assert checkpoint.check(path) == _config()
    weights, config_file = os.path.join(path, "model.safetensors"), os.path.join(path, "config.json")
    good_config = json.loads(open(config_file).read())
    with open(weights, "r+b") as f:  # a copy cut short
        f.truncate(os.path.getsize(weights) // 2)
    with pytest.raises(ValueError, match="model.safetensors is not a readable safetensors file"):
        getattr(checkpoint, read)(path)
    checkpoint.save(Transformer(_config()), path)
    with open(config_file, "w") as f:  # the weights of another model
        json.dump({**good_config, "d_model": 48}, f)
    with pytest.raises(ValueError, match=r"holds embed.weight of shape \[101, 32\] but config.json makes it"):
        getattr(checkpoint, read)(path)
    for broken, match in (
        ({**good_config, "n_heads": 0}, "sizes must be positive integers"),
        ([1, 2], "must hold a JSON object"),
    ):
        with open(config_file, "w") as f:
            json.dump(broken, f)
        with pytest.raises(ValueError, match=match):
            getattr(checkpoint, read)(path)
    with open(config_file, "w") as f:
        f.write('{"d_model": 32,')
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        getattr(checkpoint, read)(path)
    # a model whose vocabulary the tokenizer does not fill would sample ids the tokenizer cannot decode
    checkpoint.save(Transformer(ModelConfig.tiny(vocab_size=4160, n_layers=1)), path)
    with pytest.raises(ValueError, match="the tokenizer has 4096 tokens but the model's vocabulary is 4160"):
        Engine.load(path)


def test_config_sizes_must_be_positive():
    for field in ("n_heads", "n_kv_heads", "d_model", "n_experts", "vocab_size"):
        with pytest.raises(ValueError, match=f"{field}=0"):
            _config(**{field: 0})
    with pytest.raises(ValueError, match="n_shared_experts=-1"):
        _config(n_shared_experts=-1)
    assert _config(n_shared_experts=0).n_shared_experts == 0


def test_the_tensor_hash_names_the_weights_and_nothing_else(tmp_path):
    torch.manual_seed(0)
    model = Transformer(_config())
    checkpoint.save(model, str(tmp_path / "a"), metadata={"policy_version": 1})
    checkpoint.save(model, str(tmp_path / "b"), metadata={"policy_version": 2, "usage": {"prompt": "bare"}})
    first = checkpoint.tensor_hash(str(tmp_path / "a"))
    assert len(first) == 16 and first == checkpoint.tensor_hash(str(tmp_path / "b"))
    with torch.no_grad():
        next(model.parameters()).view(-1)[0] += 1e-6
    checkpoint.save(model, str(tmp_path / "c"))
    assert checkpoint.tensor_hash(str(tmp_path / "c")) != first
