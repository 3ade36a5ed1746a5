"""`codefleet bench sandbox --backend vm|both --quick`: the issue's figures for microVMs, each sane, and the VMs
gone afterwards. Run by `make test-vm`; they skip where the vm backend is not set up."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest

from codefleet.sandbox.vm import vm_unavailable_reason

pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(vm_unavailable_reason() is not None, reason=f"vm backend: {vm_unavailable_reason()}"),
]
VM_FIGURES = (
    "boot_ms_p50",
    "boot_ms_p99",
    "boot_to_agent_ms_p50",
    "create_ms_p50",
    "create_ms_p99",
    "restore_ms_p50",
    "pool_acquire_ms_p50",
    "exec_ms_p50",
    "exec_ms_p99",
    "exec_external_ms_p50",
    "fork_ms_p50",
    "max_live_sandboxes",
    "rss_mb_per_sandbox",
    "pss_mb_per_sandbox",
    "vmm_pss_mb_per_sandbox",
    "live_wall_s",
    "subprocess_ms_p50",
)


def _bench(backend: str, state_dir: str) -> dict:
    """The bench's JSON, after checking that it left no VM and no snapshot behind (its directories carry its pid;
    other benches may run beside it)."""
    env = dict(os.environ, CODEFLEET_STATE_DIR=state_dir)
    with subprocess.Popen(
        [sys.executable, "-m", "codefleet.cli", "bench", "sandbox", "--quick", "--backend", backend],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
    lines = out.strip().splitlines()
    assert len(lines) > 2, "expected a title and a table before the JSON"
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert [line for line in ps.splitlines() if "qemu-system" in line and f"/codefleet-bench-{proc.pid}-" in line] == []
    assert glob.glob(f"/var/tmp/codefleet-bench-{proc.pid}-*") == []
    assert glob.glob(f"/dev/shm/codefleet-bench-vm-{proc.pid}-*") == []  # its snapshots' RAM
    return json.loads(lines[-1])


def _check_vm(r: dict) -> None:
    for key in VM_FIGURES:
        assert isinstance(r[key], (int, float)) and r[key] > 0, key
    assert r["accel"] in ("kvm", "tcg") and r["memory_mb"] == 256 and r["snapshots_booted"] >= 1
    assert r["boot_ms_p50"] >= r["boot_to_agent_ms_p50"]  # a cold boot is the boot, then a restore and a command
    assert r["boot_ms_p50"] > r["restore_ms_p50"]  # restoring the snapshot beats booting to it
    assert r["create_ms_p50"] >= r["restore_ms_p50"]  # each create contains its restore
    assert r["exec_ms_p99"] >= r["exec_ms_p50"]
    assert r["rss_mb_per_sandbox"] >= r["pss_mb_per_sandbox"]  # the snapshot's RAM file is shared
    assert r["rss_mb_per_sandbox"] < 2 * r["memory_mb"]  # the guest's touched RAM and QEMU, no more
    assert 0 < r["vmm_pss_mb_per_sandbox"] < r["pss_mb_per_sandbox"]  # QEMU's own part is not the guest's RAM
    if r["live_stop"].startswith("reached the cap"):
        assert r["max_live_sandboxes"] == 10  # quick mode's cap, all answering
    if r["accel"] == "tcg":
        assert "TCG" in r["note"] and "do not apply" in r["note"]


def test_bench_sandbox_vm_reports_the_issue_figures_and_closes_its_vms(state_dir):
    r = _bench("vm", state_dir)
    assert r["backend"] == "vm" and r["quick"] is True
    _check_vm(r)
    assert "one cold boot" in r["note"]  # quick's single sample is said, not hidden


def test_bench_sandbox_both_sets_vm_beside_namespace(state_dir):
    r = _bench("both", state_dir)
    assert r["backend"] == "both"
    ns, vm = r["namespace"], r["vm"]
    assert ns["backend"] == "namespace" and ns["max_live_sandboxes"] == 100
    assert "boot_ms_p50" not in ns and "restore_ms_p50" not in ns
    _check_vm(vm)
    for key, ratio in r["vm_over_namespace"].items():
        assert ratio == pytest.approx(vm[key] / ns[key], rel=1e-2), key
    assert {"create_ms_p50", "exec_ms_p50", "fork_ms_p50", "rss_mb_per_sandbox"} <= set(r["vm_over_namespace"])
