"""Checkpoints: `model.safetensors` + `config.json` in one directory; save -> load is exact.

    checkpoint.save(model, "ckpt/", metadata={"policy_version": 3})
    model = checkpoint.load("ckpt/")          # same class, same bits
    checkpoint.read_metadata("ckpt/")         # {"policy_version": 3}

A Hugging Face model directory (Qwen3, Qwen3-MoE, Llama) is a checkpoint
too: `load`, `check` and `load_config` read it through `hf.py`, and `save`
writes a model whose `config.architecture` is a Hugging Face class as one
(sharded safetensors + its config.json), so training from such a model
writes checkpoints that transformers and vLLM load as they are.

Tied embeddings: safetensors refuses tensors that share memory, so the tied
`lm_head.weight` is not written; `load` rebuilds the tie from the config.
Buffers that decide routing (the per-expert selection bias) are saved too.
Extra metadata (JSON-serialisable) goes to `metadata.json`, and with it how
the policy is meant to be used (`usage`: its prompt style, tool grammar and
run); `describe` also puts the tokenizer beside the weights, so that a
checkpoint copied anywhere is served and run the way it was trained.

Checkpoints live in run directories, which someone else may have prepared
(docs/security.md): `save` makes the directory `path` and writes its files
through codefleet.store.safe_files, so a link planted as `path`, as one of
its files or below it is refused, never written through; `swap_in` renames
and removes without following links.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from typing import BinaryIO

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from safetensors.torch import save as safetensors_bytes

from codefleet.chat.tokenizer import Tokenizer, is_hf_dir
from codefleet.model import hf, hf_architectures, safetensors_io
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.store import safe_files

WEIGHTS_FILE, CONFIG_FILE, METADATA_FILE = "model.safetensors", "config.json", "metadata.json"
# the endings of a checkpoint's tensor files (weights, optimizer, DCP shards): what a reader of its tokenizer,
# chat template and config alone leaves out of a download (codefleet.store.storage.local_copy's `skip`)
TENSOR_SUFFIXES = (".safetensors", ".pt", ".bin", ".distcp")


def _tied_keys(config: ModelConfig) -> set[str]:
    return {"lm_head.weight"} if config.tie_embeddings else set()


def save(model: Transformer, path: str, config: ModelConfig | None = None, metadata: dict | None = None) -> None:
    """Write the weights, the config (default: `model.config`) and optional metadata into directory `path`."""
    config = config or model.config
    make_dir(path)
    if config.architecture != "codefleet":
        hf.save(model, path, config)
        _write_metadata(path, metadata)
        return
    skip = _tied_keys(model.config)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in skip}
    write_file(path, WEIGHTS_FILE, safetensors_bytes(state, metadata={"format": "pt", "codefleet": "1"}))
    write_file(path, CONFIG_FILE, config.to_json())
    _write_metadata(path, metadata)


def make_dir(path: str) -> None:
    """The checkpoint directory `path` (and its parents): `path` itself a directory, never a link to one."""
    parent, name = os.path.split(os.path.abspath(path))
    safe_files.makedirs_beneath(parent, name)


def write_file(path: str, name: str, data: bytes | str | Callable[[BinaryIO], None]) -> None:
    """The file `name` in the checkpoint directory `path` (bytes, text, or a function writing into the binary file
    it is given), atomically, neither `path` nor `name` a link."""
    parent, directory = os.path.split(os.path.abspath(path))
    safe_files.write_file_beneath(parent, os.path.join(directory, name), data, mode=0o644)


def _write_metadata(path: str, metadata: dict | None) -> None:
    if metadata is not None:
        write_file(path, METADATA_FILE, json.dumps(metadata, indent=2, sort_keys=True))


def load_config(path: str) -> ModelConfig:
    if is_hf_dir(path):
        return hf_architectures.model_config(hf_architectures.read_config(path), path)
    config_file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_file):
        raise FileNotFoundError(
            f"{config_file} not found: {path!r} is not a checkpoint directory written by "
            "codefleet.model.checkpoint.save"
        )
    with open(config_file) as f:
        text = f.read()
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON ({e}); it is truncated or was edited by hand") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} must hold a JSON object of ModelConfig fields, not {type(config).__name__}")
    return ModelConfig.from_dict(config)


def load(path: str, device: str | torch.device = "cpu") -> Transformer:
    """The model saved in `path`, in the config's dtype, on `device`. A truncated or corrupt weights file, or
    weights whose shapes do not match config.json, raise ValueError naming the file (`check`)."""
    if is_hf_dir(path):
        return hf.load_model(path, device)
    config = check(path)
    model = Transformer(config)
    state = load_file(os.path.join(path, WEIGHTS_FILE), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = set(missing) - _tied_keys(config)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path!r} does not match its config.json: missing {sorted(missing)}, "
            f"unexpected {sorted(unexpected)}"
        )
    return model.to(device)


def check(path: str) -> ModelConfig:
    """`path`'s config, once its weights file's header is known to be whole and to match it, without
    reading the weights (what a command checks before it starts minutes of work). Raises
    FileNotFoundError or ValueError naming the file, as `load` would."""
    if is_hf_dir(path):
        return hf.check(path)
    config = load_config(path)
    weights_file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(weights_file):
        raise FileNotFoundError(f"{weights_file} not found: the checkpoint has a config but no weights")
    with torch.device("meta"):
        expected = {k: list(v.shape) for k, v in Transformer(config).state_dict().items()}
    try:
        with safe_open(weights_file, "pt") as f:
            # f.keys(), not f: a safe_open has keys() but cannot be iterated
            shapes = {name: list(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    except SafetensorError as e:
        raise ValueError(
            f"{weights_file} is not a readable safetensors file ({e}); it is truncated or corrupt, "
            "save the checkpoint again"
        ) from None
    for name, shape in shapes.items():
        if name in expected and shape != expected[name]:
            raise ValueError(
                f"{weights_file} holds {name} of shape {shape} but {CONFIG_FILE} makes it "
                f"{expected[name]}; the two files come from different models"
            )
    missing = sorted(set(expected) - set(shapes) - _tied_keys(config))
    if missing:
        raise ValueError(
            f"{weights_file} lacks {missing[:3]} that {CONFIG_FILE} needs; the two files come from different models"
        )
    return config


# How a policy checkpoint is meant to be used, and what a checkpoint that does not say is taken to mean:
# the prompt style it was trained on (codefleet_template.PROMPTS), the grammar its tool calls were sampled under,
# and the training run it comes from (its name; "" for a checkpoint made elsewhere).
USAGE_DEFAULTS = {"prompt": "full", "tool_grammar": "off", "run": ""}


def usage(path: str) -> dict[str, str]:
    """How the policy in `path` is meant to be prompted ({"prompt": ..., "tool_grammar": ...}), from its
    metadata.json; USAGE_DEFAULTS for what it does not say."""
    meta = read_metadata(path)
    return {key: str(meta.get(key, default)) for key, default in USAGE_DEFAULTS.items()}


def write_usage(path: str, **settings: str) -> None:
    """Record in `path`'s metadata.json how its policy is meant to be used (keys of USAGE_DEFAULTS)."""
    unknown = set(settings) - set(USAGE_DEFAULTS)
    if unknown:
        raise ValueError(f"unknown usage setting(s) {sorted(unknown)}; known: {sorted(USAGE_DEFAULTS)}")
    meta = {**read_metadata(path), **settings}
    write_file(path, METADATA_FILE, json.dumps(meta, indent=2, sort_keys=True))


def describe(path: str, tokenizer: Tokenizer, text_from: str = "", **settings: str) -> None:
    """Make the checkpoint in `path` self-describing: its tokenizer beside the weights (tokenizer.json) and how
    its policy is used (`settings`, keys of USAGE_DEFAULTS) in metadata.json, next to its policy version. A copy
    anywhere then loads, prompts and serves the same, with nothing read from the run that made it.
    `text_from`: a Hugging Face directory the model comes from; its tokenizer, chat template and generation
    config files are copied instead (`hf.copy_text_files`), so the checkpoint is a whole HF directory."""
    make_dir(path)
    if text_from and is_hf_dir(text_from):
        hf.copy_text_files(text_from, path)
    else:
        tokenizer.save(path)
    write_usage(path, **settings)


def read_metadata(path: str) -> dict:
    meta_file = os.path.join(path, METADATA_FILE)
    if not os.path.isfile(meta_file):
        return {}
    with open(meta_file) as f:
        return json.load(f)


def tensor_hash(path: str) -> str:
    """A short fingerprint of the checkpoint's weights: sha256 over every tensor's name, dtype, shape and
    bytes, in name order. Two checkpoints with the same hash hold the same weights, whatever their metadata."""
    digest = hashlib.sha256()
    if is_hf_dir(path):  # sharded: the same digest over the tensors of every shard
        named = (
            (name, lambda info=info: safetensors_io.read_tensor(info))
            for name, info in sorted(safetensors_io.tensor_index(path).items())
        )
        return _digest(digest, named)
    with safe_open(os.path.join(path, WEIGHTS_FILE), "pt") as f:
        return _digest(digest, ((name, lambda name=name: f.get_tensor(name)) for name in sorted(f.keys())))


def _digest(digest, named) -> str:
    for name, read in named:
        tensor = read().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def swap_in(tmp: str, path: str, old: str) -> None:
    """Replace directory `path` by the finished directory `tmp`: the previous one is moved to `old` first and
    removed last, so a crash at any point leaves a whole checkpoint at `path` or at `old` (RunDir.prune clears
    `old`). The three are siblings; nothing is followed through a link (a link at `path` is moved, then removed)."""
    parent = os.path.dirname(os.path.abspath(path))
    safe_files.remove_beneath(parent, old, ignore_errors=True)
    if safe_files.lexists_beneath(parent, path):
        safe_files.replace_beneath(parent, path, old)
    safe_files.replace_beneath(parent, tmp, path)
    safe_files.remove_beneath(parent, old, ignore_errors=True)
