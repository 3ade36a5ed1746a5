"""A backend from another package plugs in as a third party would ship it: one file, one entry point.

The test writes a toy sandbox backend and a toy engine backend, one file each, into a directory with a
`toy-0.dist-info/entry_points.txt` (what `pip install` leaves for a package that declares entry points),
puts it on PYTHONPATH, and finds both in the `codefleet` commands' choices and behind them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from codefleet.contracts import ENGINES, SANDBOXES, TRAINERS, Registry

TOY_SANDBOX = '''"""The local backend, with TOY_SANDBOX set in every shell it starts."""
import dataclasses

from codefleet.sandbox import SandboxConfig
from codefleet.sandbox.local import LocalSandbox


class ToySandbox(LocalSandbox):
    backend = "toy"

    def __init__(self, repo, config=None, **kwargs):
        config = config or SandboxConfig()
        super().__init__(repo, dataclasses.replace(config, env={**config.env, "TOY_SANDBOX": "yes"}), **kwargs)
'''

TOY_ENGINE = '''"""codefleet's engine without its tool-call grammar, saying on stderr what it loads."""
import sys

from codefleet.inference.engine import Engine


class ToyEngine(Engine):
    tool_grammar = False

    @classmethod
    def load(cls, checkpoint_dir, max_batch=32, max_seq_len=None, **options):
        print(f"toy engine: loading {checkpoint_dir}", file=sys.stderr, flush=True)
        return super().load(checkpoint_dir, max_batch=max_batch, max_seq_len=max_seq_len, **options)
'''


def _plugin_dir(root, entry_points: str, files: dict[str, str]) -> str:
    """A directory that Python's import system and importlib.metadata read as an installed package `toy`."""
    dist = root / "toy-0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy\nVersion: 0\n")
    (dist / "entry_points.txt").write_text(entry_points)
    for name, text in files.items():
        (root / name).write_text(text)
    return str(root)


@pytest.fixture
def toy(tmp_path):
    return _plugin_dir(
        tmp_path / "site",
        "[codefleet.sandboxes]\ntoy = toy_sandbox:ToySandbox\n\n[codefleet.engines]\ntoy = toy_engine:ToyEngine\n",
        {"toy_sandbox.py": TOY_SANDBOX, "toy_engine.py": TOY_ENGINE},
    )


def _codefleet(toy: str, *argv: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([toy, *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run(
        [sys.executable, "-m", "codefleet.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
    )


def test_the_commands_offer_an_installed_packages_backends(toy):
    for argv, flags in (
        (["agent", "run"], ("--backend", "--engine")),
        (["serve"], ("--engine",)),
        (["sandbox", "run"], ("--backend",)),
    ):
        out = _codefleet(toy, *argv, "--help")
        assert out.returncode == 0, out.stderr
        help_text = " ".join(out.stdout.split())
        for flag in flags:
            choices = help_text.split(f"{flag} {{", 1)[1].split("}", 1)[0].split(",")
            assert "toy" in choices, (argv, flag, choices)


def test_a_sandbox_backend_from_a_package_runs_commands(toy, state_dir):
    out = _codefleet(
        toy,
        "sandbox",
        "run",
        "--backend",
        "toy",
        "--set",
        f"state_dir={state_dir}",
        "--",
        "sh",
        "-c",
        "echo toy=$TOY_SANDBOX; ls",
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["toy=yes"]  # its shell, in an empty workspace


def test_an_engine_backend_from_a_package_serves_the_agent_and_its_flags_are_read(toy, repo, state_dir, tmp_path):
    import torch

    from codefleet.model import checkpoint
    from codefleet.model.config import ModelConfig
    from codefleet.model.transformer import Transformer

    torch.manual_seed(0)
    ckpt = str(tmp_path / "ckpt")
    checkpoint.save(Transformer(ModelConfig.tiny()), ckpt)
    out = _codefleet(
        toy,
        "agent",
        "run",
        "--repo",
        repo,
        "--task",
        "look around",
        "--model",
        f"local:{ckpt}",
        "--engine",
        "toy",
        "--backend",
        "toy",
        "--max-turns",
        "1",
        "--json",
        "--set",
        f"state_dir={state_dir}",
    )
    assert out.returncode == 0, out.stderr
    assert f"toy engine: loading {ckpt}" in out.stderr
    result = json.loads(out.stdout)
    assert result["turns"] == 1 and result["tokens"] > 0
    # The toy declares no tool-call grammar, so asking for one is refused before anything loads.
    for argv in (
        [
            "agent",
            "run",
            "--repo",
            repo,
            "--task",
            "x",
            "--model",
            f"local:{ckpt}",
            "--engine",
            "toy",
            "--tool-grammar",
            "auto",
        ],
        ["serve", "--checkpoint", ckpt, "--port", "0", "--engine", "toy", "--tool-grammar"],
    ):
        refused = _codefleet(toy, *argv)
        assert refused.returncode == 2 and "toy engine" in refused.stderr, refused.stderr
        assert "toy engine: loading" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


def test_a_package_cannot_take_a_built_in_name_and_a_broken_one_is_one_sentence(tmp_path, monkeypatch):
    site = _plugin_dir(
        tmp_path / "site",
        "[codefleet.sandboxes]\nlocal = toy_local:Impostor\nbroken = toy_missing:Nothing\n",
        {"toy_local.py": "class Impostor:\n    pass\n"},
    )
    monkeypatch.syspath_prepend(site)
    registry = Registry("sandbox backend", "codefleet.sandboxes", {"local": "codefleet.sandbox.local:LocalSandbox"})
    assert registry.names() == ["broken", "local"]
    with pytest.raises(ValueError, match="'local' is built into codefleet and also declared by the package 'toy'"):
        registry.get("local")
    with pytest.raises(
        ImportError,
        match=r"sandbox backend 'broken' \(entry point 'toy_missing:Nothing' of the "
        r"package 'toy'\) could not be loaded: .*; reinstall that package",
    ):
        registry.get("broken")
    with pytest.raises(ValueError, match="unknown sandbox backend 'nope'; known: broken, local"):
        registry.get("nope")


def test_every_built_in_backend_loads_by_name_and_declares_its_capabilities():
    flags = {
        SANDBOXES: ("isolated", "environments", "host_binds"),
        ENGINES: ("tool_grammar", "gpu", "omp_threads_from_env"),
        TRAINERS: ("sharded",),
    }
    for registry, names in flags.items():
        for name in registry.names():
            backend = registry.get(name)
            assert isinstance(backend, type), (registry.kind, name)
            assert all(isinstance(getattr(backend, flag), bool) for flag in names), (registry.kind, name)
    assert [n for n in SANDBOXES.names() if SANDBOXES.get(n).isolated] == ["namespace", "vm"]
    assert [n for n in TRAINERS.names() if TRAINERS.get(n).sharded] == ["fsdp2", "fsdp2_ep"]
    assert all(
        isinstance(ENGINES.get(n).serve_options, dict) and callable(ENGINES.get(n).load) for n in ENGINES.names()
    )


def test_listing_the_backends_imports_none_of_them():
    code = (
        "import sys; from codefleet.contracts import ENGINES, SANDBOXES, TRAINERS; "
        "print(SANDBOXES.names(), ENGINES.names(), TRAINERS.names()); "
        "print(sorted(m for m in sys.modules if m.startswith(('codefleet.sandbox', 'codefleet.model', "
        "'codefleet.rl', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    listed, imported = out.stdout.splitlines()
    assert "'namespace'" in listed and "'vllm'" in listed and "'fsdp2_ep'" in listed
    assert imported == "[]"
