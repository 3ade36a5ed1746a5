"""The backends codefleet ships are found by name and keep their contracts (codefleet/contracts.py)."""

from __future__ import annotations

import pytest

from codefleet.agent.clients import OpenAIConfig, OpenAIPolicy
from codefleet.agent.clients.scripted import ScriptedExpert
from codefleet.contracts import SANDBOXES, TRAINERS, ExactBytes, Policy, Registry, Sandbox, Trainer
from codefleet.fleet.fleet_config import TrainerWorkersConfig
from codefleet.sandbox import SandboxConfig, create_sandbox
from codefleet.tasks import generate_tasks


def test_an_unknown_name_is_one_sentence_naming_the_known_ones():
    registry = Registry("widget backend")
    registry.register("a", object)
    with pytest.raises(ValueError, match=r"unknown widget backend 'b'; known: a"):
        registry.get("b")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register("a", int)
    with pytest.raises(ValueError, match="registered twice"):  # a built-in name is taken too
        Registry("widget backend", builtins={"b": "codefleet.types:Task"}).register("b", object)
    with pytest.raises(ValueError, match="unknown sandbox backend 'firecracker'.*choose one of local, namespace, vm"):
        create_sandbox(None, SandboxConfig(backend="firecracker"))


def test_the_shipped_sandboxes_keep_the_sandbox_contract():
    assert {"namespace", "vm", "local"} <= set(SANDBOXES.names())
    with create_sandbox(None, SandboxConfig(backend="local")) as sb:
        assert isinstance(sb, Sandbox) and isinstance(sb, ExactBytes)  # the shell backends give exact bytes too
        sb.write_file("latin.txt", b"caf\xe9\n")
        assert sb.read_bytes("latin.txt") == b"caf\xe9\n" and sb.read_file("latin.txt") == "caf\ufffd\n"


def test_the_shipped_policies_keep_the_policy_contract(tmp_path):
    (task,) = generate_tasks(str(tmp_path), 1, seed=0)
    assert isinstance(ScriptedExpert(task), Policy)
    assert isinstance(OpenAIPolicy(OpenAIConfig(base_url="http://127.0.0.1:9/v1", model="m")), Policy)


def test_the_trainer_is_found_by_the_name_its_config_gives():
    cls = TRAINERS.get(TrainerWorkersConfig().backend)
    assert all(callable(getattr(cls, m, None)) for m in ("forward_backward", "optim_step", "save", "load"))
    assert {m for m in dir(Trainer) if not m.startswith("_")} <= set(dir(cls))
