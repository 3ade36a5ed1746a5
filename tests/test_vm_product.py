"""The product on vm sandboxes: `codefleet agent run --backend vm` (attempts in forked microVMs) and a short
`codefleet train sandbox.backend=vm`. Run by `make test-vm`; they skip where the vm backend is not set up."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from openai_stub import OpenAIStub, call, reply

from codefleet.agent.cli import main
from codefleet.sandbox.vm import vm_unavailable_reason
from codefleet.sandbox.vm_image import kernel_dir

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(vm_unavailable_reason() is not None, reason=f"vm backend: {vm_unavailable_reason()}"),
]
FIX = call("edit_file", {"path": "pkg/calc.py", "old_text": "return a - b", "new_text": "return a - b  # checked"})


def test_agent_run_on_vm_sandboxes_edits_runs_and_forks_attempts(repo, state_dir):
    script = [
        reply("", call("run", {"command": "uname -r; cat /proc/sys/kernel/hostname"}), FIX),
        reply("", call("submit", {"summary": "marked"})),
    ]
    with OpenAIStub(script * 2) as stub:  # one script per attempt
        out, err = io.StringIO(), io.StringIO()
        code = main(
            [
                "agent",
                "run",
                "--repo",
                repo,
                "--task",
                "Mark sub as checked.",
                "--model",
                stub.base_url,
                "--backend",
                "vm",
                "--attempts",
                "2",
                "--json",
                "--set",
                f"state_dir={state_dir}",
                "--set",
                "memory_mb=512",
            ],
            stdin=io.StringIO(),
            out=out,
            err=err,
        )
    assert code == 0, err.getvalue()
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    assert len(result["attempts"]) == 2 and result["stop_reason"] == "submit"
    assert "+    return a - b  # checked" in result["diff"]
    with open(os.path.join(kernel_dir(), "version")) as f:  # linux-image-<release>_<version>_amd64.deb
        guest = f.read().split("_")[0].removeprefix("linux-image-")
    assert guest != os.uname().release
    assert any(guest in json.dumps(r) for r in stub.requests)  # `uname -r` ran on the guest's kernel


@pytest.mark.timeout(3000)
def test_a_short_training_runs_on_vm_sandboxes(tmp_path):
    run = str(tmp_path / "run")
    tiny = [
        "tasks.n_train=4",
        "tasks.n_eval=2",
        "tasks.families=[bugfix, config]",
        "sft.epochs=1",
        "sft.batch_size=4",
        "rl.steps=2",
        "controller.group_size=2",
        "controller.batch_groups=1",
        "controller.rollout_slots=4",
        "controller.eta=1",
        "rl.max_tokens=24",
        "rl.max_turns=2",
        "eval.max_tokens=24",
        "eval.attempts=1",
        "cluster.num_cpus=4",
        "sandbox.backend=vm",
        "sandbox.memory_mb=512",
    ]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    done = subprocess.run(
        [sys.executable, "-m", "codefleet.cli", "train", "--out", run, "--no-progress", *tiny],
        env=env,
        capture_output=True,
        text=True,
        timeout=2900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    trained = sorted(os.listdir(os.path.join(run, "trained")))
    assert len(trained) == 2, trained
    assert "abandoning" not in done.stderr
