"""Hugging Face checkpoints on codefleet's model and engine: logits and routing equal to transformers' own
implementation (fp32, batch 1 and padded, with and without the native kernels), routing replay on Qwen3-MoE,
export that transformers loads back, and one clear error for every kind of bad directory."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

from codefleet.chat.tokenizer import is_hf_dir
from codefleet.inference.engine import Engine
from codefleet.inference.sampling import SamplingParams
from codefleet.model import checkpoint, hf, kernels, safetensors_io
from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
from codefleet.model.transformer import Transformer, token_logprobs

V = 300
COMMON = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)
CONFIGS = {
    "qwen3": lambda: Qwen3Config(**COMMON, tie_word_embeddings=True),
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    ),
    "llama": lambda: LlamaConfig(
        **COMMON,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


def build(kind: str, path: str, shard: str = "60KB"):
    """A random transformers model of `kind` saved (sharded) into `path`; its norms are not all ones."""
    torch.manual_seed({"qwen3": 1, "qwen3_moe": 2, "llama": 3}[kind])
    model = AutoModelForCausalLM.from_config(CONFIGS[kind]()).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, max_shard_size=shard)
    return model


_BUILT: dict[str, tuple] = {}


def _pair(kind: str, tmp_path_factory) -> tuple:
    """(kind, directory, transformers' model, codefleet's model of it), built once per module."""
    if kind not in _BUILT:
        path = str(tmp_path_factory.mktemp(kind))
        reference = build(kind, path)
        _BUILT[kind] = kind, path, reference, checkpoint.load(path).eval()
    return _BUILT[kind]


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    return _pair(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory):
    return _pair("qwen3_moe", tmp_path_factory)


def padded_batch(lengths=(23, 9, 16), seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for b, n in enumerate(lengths):
        tokens[b, :n] = torch.randint(1, V, (n,), generator=g)
        mask[b, :n] = 1
    return tokens, mask


def test_the_trainer_forward_equals_transformers_batch_1_and_padded(pair):
    kind, path, reference, model = pair
    assert model.config.architecture == reference.config.architectures[0]
    tokens, mask = padded_batch()
    with torch.no_grad():
        ref = reference(tokens, attention_mask=mask).logits
        single = reference(tokens[:1, :23]).logits
    model.train()  # the training path (gradients on), then the inference fast paths
    got = model(tokens).logits_BTV.detach()
    model.eval()
    with torch.inference_mode():
        fast = model(tokens).logits_BTV
        alone = model(tokens[:1, :23]).logits_BTV
    for b, n in enumerate(mask.sum(1).tolist()):  # right padding: the real positions must agree
        assert (got[b, :n] - ref[b, :n]).abs().max() <= 1e-4
        assert (fast[b, :n] - ref[b, :n]).abs().max() <= 1e-4
    assert (alone - single).abs().max() <= 1e-4


def test_the_routing_equals_transformers_for_every_token(moe_pair):
    kind, path, reference, model = moe_pair
    tokens, _ = padded_batch((30,), seed=4)
    with torch.no_grad():
        router_logits = reference(tokens, output_router_logits=True).router_logits
        routed = model(tokens, return_routing=True).routed_experts
    assert len(router_logits) == len(routed) == 2  # layer 1 is dense (mlp_only_layers)
    for logits, experts in zip(router_logits, routed):
        want = logits.view(-1, 8).softmax(-1).topk(2, dim=-1).indices.sort(-1).values
        assert torch.equal(experts.view(-1, 2).sort(-1).values, want)


@pytest.mark.parametrize("native", [True, False], ids=["kernels", "no_kernels"])
def test_the_engines_incremental_decode_equals_transformers(pair, native, monkeypatch):
    kind, path, reference, model = pair
    calls = []
    if native:
        assert kernels.decode_layer() is not None, "the decode_layer kernel did not build"
        real = kernels.decode_layer
        monkeypatch.setattr(kernels, "decode_layer", lambda: calls.append(1) or real())
    else:
        for name in ("decode_layer", "moe_experts", "moe_train"):
            monkeypatch.setattr(kernels, name, lambda: None)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(1, V, (n,), generator=g).tolist() for n in (5, 17, 11)]
    engine = Engine(model, max_batch=2, max_seq_len=96)  # three requests through two slots: padded, joining
    results = engine.generate(prompts, [SamplingParams(max_tokens=12, temperature=1.0, seed=i) for i in range(3)])
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([prompt + result.token_ids])
        with torch.no_grad():
            ref = token_logprobs(reference(ids).logits[:, :-1], ids[:, 1:])[0, len(prompt) - 1 :]
        assert (ref - torch.tensor(result.logprobs)).abs().max() <= 1e-4
    assert bool(calls) == native  # the decode steps ran the native kernel (q/k norm included) when asked


def test_routing_replay_reproduces_the_engines_logprobs_on_qwen3_moe(moe_pair):
    kind, path, reference, model = moe_pair
    prompts = [[5, 17, 33, 2], [8, 40, 61, 9, 12, 70, 3]]
    results = Engine(model, max_batch=2, max_seq_len=64).generate(
        prompts, [SamplingParams(max_tokens=8, temperature=1.0, seed=i) for i in range(2)]
    )
    for prompt, result in zip(prompts, results):
        ids = torch.tensor([prompt + result.token_ids])
        experts = torch.tensor(result.prompt_routed_experts + result.routed_experts)  # [T, layers, top_k]
        assert experts.shape[1:] == (2, 2)
        replay = [experts[None, :, layer] for layer in range(2)]
        with torch.no_grad():
            lp = token_logprobs(model(ids, routing_replay=replay).logits_BTV[:, :-1], ids[:, 1:])
        assert (lp[0, len(prompt) - 1 :] - torch.tensor(result.logprobs)).abs().max() <= 1e-4


def test_a_saved_checkpoint_is_a_directory_transformers_loads_with_equal_logits(pair, tmp_path):
    kind, path, reference, model = pair
    out = str(tmp_path / "saved")
    checkpoint.save(model, out)
    assert is_hf_dir(out) and checkpoint.tensor_hash(out) == checkpoint.tensor_hash(path)
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    tokens, _ = padded_batch((20,))
    with torch.no_grad():
        assert (back(tokens).logits - reference(tokens).logits).abs().max() <= 1e-5


@pytest.mark.parametrize("qk_norm,arch", [(True, "Qwen3MoeForCausalLM"), (False, "MixtralForCausalLM")])
def test_export_writes_codefleets_own_moe_as_its_hugging_face_architecture(qk_norm, arch, tmp_path):
    torch.manual_seed(0)
    config = ModelConfig.tiny(vocab_size=V, n_layers=2, qk_norm=qk_norm, copy=CopyConfig(prev_tokens=0), max_seq_len=64)
    model = Transformer(config).eval()
    hf.save(model, str(tmp_path))
    assert json.load(open(tmp_path / "config.json"))["architectures"] == [arch]
    back = AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    tokens, _ = padded_batch((20,))
    with torch.no_grad():
        assert (back(tokens).logits - model(tokens).logits_BTV).abs().max() <= 1e-4


def test_export_says_why_a_model_with_a_copy_head_has_no_hugging_face_architecture(tmp_path):
    model = Transformer(ModelConfig.tiny(vocab_size=V, n_layers=1, copy=CopyConfig(head=True)))
    with pytest.raises(safetensors_io.CheckpointError, match="copy head.*previous tokens"):
        hf.save(model, str(tmp_path))


# ---- bad directories --------------------------------------------------------------------------------------------


@pytest.fixture()
def qwen_dir(tmp_path):
    build("qwen3_moe", str(tmp_path / "m"))
    return tmp_path / "m"


def shards(path):
    return sorted(p for p in os.listdir(path) if p.endswith(".safetensors"))


def test_a_missing_shard_is_named(qwen_dir):
    os.remove(qwen_dir / shards(qwen_dir)[2])
    with pytest.raises(safetensors_io.CheckpointError, match=f"{shards(qwen_dir)[1][:6]}.*is missing"):
        checkpoint.load(str(qwen_dir))


def test_a_shard_that_lacks_what_the_index_puts_there_is_named(qwen_dir):
    index = json.load(open(qwen_dir / safetensors_io.INDEX_FILE))
    name = "model.norm.weight"
    others = [s for s in shards(qwen_dir) if s != index["weight_map"][name]]
    index["weight_map"][name] = others[0]
    json.dump(index, open(qwen_dir / safetensors_io.INDEX_FILE, "w"))
    with pytest.raises(safetensors_io.CheckpointError, match=f"{others[0]} lacks tensor 'model.norm.weight'"):
        checkpoint.check(str(qwen_dir))


@pytest.mark.parametrize("damage", ["truncated", "header"])
def test_a_truncated_or_corrupt_shard_is_named(qwen_dir, damage):
    shard = qwen_dir / shards(qwen_dir)[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100] if damage == "truncated" else data[:8] + b"{not json" + data[17:])
    with pytest.raises(safetensors_io.CheckpointError, match=f"{shard.name} is not a readable safetensors file"):
        checkpoint.load(str(qwen_dir))


def test_a_tensor_whose_shape_does_not_fit_the_config_is_named(qwen_dir):
    config = json.load(open(qwen_dir / "config.json"))
    config["moe_intermediate_size"] = 48
    json.dump(config, open(qwen_dir / "config.json", "w"))
    with pytest.raises(safetensors_io.CheckpointError, match=r"holds model\.layers\.0\.mlp\.experts\.0\..* of shape"):
        checkpoint.load(str(qwen_dir))


@pytest.mark.parametrize(
    "edit,message",
    [
        ({"architectures": ["MistralForCausalLM"]}, "supports Qwen3ForCausalLM, Qwen3MoeForCausalLM, LlamaForCausalLM"),
        ({"auto_map": {"AutoModelForCausalLM": "modeling_x.X"}}, "trust_remote_code"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}}, "'yarn' is not supported"),
        ({"attention_bias": True}, "attention_bias"),
    ],
)
def test_what_codefleet_cannot_compute_is_refused_with_one_error(qwen_dir, edit, message):
    config = {**json.load(open(qwen_dir / "config.json")), **edit}
    json.dump(config, open(qwen_dir / "config.json", "w"))
    with pytest.raises(safetensors_io.CheckpointError, match=message):
        checkpoint.check(str(qwen_dir))


def test_loading_peaks_near_the_checkpoints_size_in_rss(tmp_path):
    """A ~100 MB bf16 checkpoint in a fresh process: the peak RSS above the baseline stays under 1.5x its size."""
    build_big = f"""
import torch
from transformers import Qwen3MoeConfig, AutoModelForCausalLM
torch.manual_seed(0)
c = Qwen3MoeConfig(vocab_size=8192, hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
                   num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=32,
                   num_experts_per_tok=4, max_position_embeddings=256, dtype="bfloat16")
AutoModelForCausalLM.from_config(c).to(torch.bfloat16).save_pretrained({str(tmp_path)!r}, max_shard_size="40MB")
"""
    subprocess.run([sys.executable, "-c", build_big], check=True, capture_output=True)
    size = sum(os.path.getsize(tmp_path / s) for s in shards(tmp_path))
    measure = f"""
import resource, torch
from codefleet.model import checkpoint
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = checkpoint.load({str(tmp_path)!r})
assert model.embed.weight.dtype == torch.bfloat16
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) * 1024)
"""
    peak = int(subprocess.run([sys.executable, "-c", measure], check=True, capture_output=True, text=True).stdout)
    assert size > 80e6 and peak <= 1.5 * size, (peak / 1e6, size / 1e6)


def test_a_codefleet_checkpoint_missing_config_fields_is_one_error_naming_them(tmp_path):
    model = Transformer(ModelConfig.tiny(n_layers=1))
    checkpoint.save(model, str(tmp_path))
    config = json.load(open(tmp_path / "config.json"))
    for name in ("qk_norm", "dense_layers"):
        del config[name]
    json.dump(config, open(tmp_path / "config.json", "w"))
    assert not is_hf_dir(str(tmp_path))
    with pytest.raises(ValueError, match=r"missing field\(s\) \['dense_layers', 'qk_norm'\]; the config was written"):
        checkpoint.load(str(tmp_path))


def test_copy_text_files_carries_the_tokenizer_side(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "a" / "generation_config.json").write_text("{}")
    assert hf.copy_text_files(str(tmp_path / "a"), str(tmp_path / "b")) == [
        "tokenizer_config.json",
        "generation_config.json",
    ]
    shutil.rmtree(tmp_path / "b")
