"""`codefleet chaos`: the fault schedule and the invariants on run directories made to break them (fast), and a
real soak, a training run on a local three-node cluster under every kind of fault (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest
import yaml

from codefleet.chaos import faults, invariants
from codefleet.config import to_dict
from codefleet.fleet.staleness import Group, Rollout, Ticket
from codefleet.model.checkpoint import CONFIG_FILE
from codefleet.recipe.config import TrainRunConfig
from codefleet.recipe.run_dir import RunDir
from codefleet.sandbox.state import process_name
from codefleet.store.parquet import RolloutWriter, rollout_record
from codefleet.types import Trajectory


def test_schedule_is_seeded_and_brings_every_kind_before_any_twice():
    plan = faults.schedule(140.0, seed=3, per_kind=2)
    assert [f.at_s for f in plan] == sorted(f.at_s for f in plan)
    assert len(plan) == 2 * len(faults.KINDS)
    assert set(f.kind for f in plan[: len(faults.KINDS)]) == set(faults.KINDS)
    slot = 140.0 / len(plan)
    assert all(i * slot < f.at_s < (i + 1) * slot for i, f in enumerate(plan))
    assert [f.kind for f in plan] == [f.kind for f in faults.schedule(140.0, seed=3, per_kind=2)]
    assert [f.kind for f in plan] != [f.kind for f in faults.schedule(140.0, seed=4, per_kind=2)]


def _run_dir(tmp_path, *, steps=3, eta=1, trained=None, deadlines=None, store_missing=()):
    """A run directory of 2-rollout groups 0..3 admitted at versions 0,0,1,2 (deadline = version + eta unless
    given), trained per `trained` {step: [group ids]}."""
    run = RunDir(str(tmp_path / "run"))
    os.makedirs(run.path("checkpoints"), exist_ok=True)
    config = to_dict(TrainRunConfig())  # the config a run writes, so the fixture follows where settings live
    config["rl"]["steps"], config["controller"]["eta"] = steps, eta
    with open(run.path("config.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    versions = [0, 0, 1, 2]
    writer = RolloutWriter(run.path("rollouts"))
    for gid, v in enumerate(versions):
        deadline = (deadlines or {}).get(gid, v + eta)
        rollouts = [Rollout(f"{gid}/{a}", gid, v, 1.0) for a in range(2)]
        run.save_group(Group(Ticket(gid, v, deadline, 2), rollouts))
        records = [
            rollout_record(Trajectory(f"t{gid}", [], [], "submit"), run="r", step=v, group=gid, attempt=a)
            for a in range(2)
            if (gid, a) not in store_missing
        ]
        if records:
            writer.append(records)
    trained = {0: [0, 1], 1: [2], 2: [3]} if trained is None else trained
    for step, gids in trained.items():
        os.makedirs(run.rl_checkpoint(step + 1), exist_ok=True)
        with open(os.path.join(run.rl_checkpoint(step + 1), CONFIG_FILE), "w") as f:
            f.write("{}")
        run.commit_checkpoint(
            step + 1,
            {"consumed_ids": [], "lags": [], "next_batch": step + 1},
            [f"{g}/{a}" for g in gids for a in range(2)],
        )
    with open(run.path("results.json"), "w") as f:
        f.write("{}")
    return run.root


def _checks(root):
    return {c.name: c for c in invariants.run_checks(invariants.read_run(root), os.path.join(root, "rollouts"))}


def test_invariants_hold_for_a_clean_run(tmp_path):
    checks = _checks(_run_dir(tmp_path))
    assert all(c.ok for c in checks.values()), checks


@pytest.mark.parametrize(
    "broken, kwargs",
    [
        ("finished", {"steps": 5}),
        ("no_trained_twice", {"trained": {0: [0, 1], 1: [2, 1], 2: [3]}}),
        ("no_accepted_lost", {"trained": {0: [0], 1: [2], 2: [3]}}),  # group 1 (deadline 1) never trained
        ("lag_within_eta", {"trained": {0: [0], 1: [2], 2: [3, 1]}, "deadlines": {1: 2}}),  # group 1: version 0, step 2
        ("store_complete", {"store_missing": [(2, 1)]}),
    ],
)
def test_each_invariant_fails_on_the_run_that_breaks_it(tmp_path, broken, kwargs):
    checks = _checks(_run_dir(tmp_path, **kwargs))
    assert [name for name, c in checks.items() if not c.ok] == [broken], checks


def test_a_rollout_trained_without_an_accepted_group_is_caught(tmp_path):
    root = _run_dir(tmp_path)
    os.unlink(os.path.join(root, "accepted", "group-00000003.json"))
    checks = _checks(root)
    assert not checks["trained_were_accepted"].ok and "3/0" in checks["trained_were_accepted"].detail


def test_leaks_see_a_sandbox_process_tree_and_a_mount_under_the_state_dir(tmp_path):
    state = str(tmp_path / "state")
    owner = "4242-99-abcdef"  # a sandbox owner's directory: <pid>-<start ticks>-<hex>
    os.makedirs(f"{state}/{owner}/sb/x")
    assert invariants.leaks(state, []).ok
    # as a sandbox's bwrap: argv[0] its owner's process name, a process under it; not one of another state
    # directory's owner, nor a process that names this state directory (a bwrap's command line never does)
    fake = subprocess.Popen([process_name(owner), "-c", "sleep 60 & wait"], executable="/bin/bash")
    others = [
        subprocess.Popen([process_name("4243-99-abcdef"), "-c", "sleep 60 & wait"], executable="/bin/bash"),
        subprocess.Popen(["bwrap", "-c", "sleep 60 & wait", "sh", f"{state}/{owner}/sb/x"], executable="/bin/bash"),
    ]
    try:
        for _ in range(50):
            if (
                faults.sandbox_roots(state)
                and faults.descendants(fake.pid)
                and all(faults.cmdline(p.pid) and faults.descendants(p.pid) for p in others)
            ):
                break
            time.sleep(0.1)
        assert faults.sandbox_roots(state) == [fake.pid]
        leak = invariants.leaks(state, ["EngineActor pid 7"])
        assert not leak.ok and "sandbox process tree" in leak.detail and "EngineActor pid 7" in leak.detail
    finally:
        for proc in [fake, *others]:
            proc.kill()
            proc.wait()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "none", f"{state}/{owner}/sb/x"], check=True)
    try:
        leak = invariants.leaks(state, [], whose=lambda pid: f"SandboxHost pid {pid}, hit by fault sandbox_host")
        assert (
            not leak.ok
            and (f"1 mount(s) of owner {owner}; SandboxHost pid 4242, hit by fault sandbox_host: {owner}/sb/x")
            in leak.detail
        )
    finally:
        subprocess.run(["umount", f"{state}/{owner}/sb/x"], check=True)
    assert invariants.leaks(state, []).ok


SOAK_CONFIG = textwrap.dedent("""
    tasks: {n_train: 4, n_eval: 1, families: [config]}
    sft: {epochs: 1, batch_size: 4}
    rl: {steps: 150, max_tokens: 24, max_turns: 2}
    controller: {group_size: 2, batch_groups: 1, rollout_slots: 4}
    eval: {max_tokens: 8, attempts: 1}
    trainer: {workers: 1, cpus: 0.5}
    rollouts: {workers: 2, cpus: 0.1}
    engine: {wait_s: 20}
    sandbox: {workspace_mb: 64}
""")


@pytest.mark.slow
@pytest.mark.chaos
@pytest.mark.timeout(1200)
def test_a_training_run_survives_every_kind_of_fault(tmp_path):
    """Two minutes of faults, one of each kind, on a head and two worker nodes: the run finishes by itself and
    every invariant holds."""
    config = tmp_path / "soak.yaml"
    config.write_text(SOAK_CONFIG)
    out = tmp_path / "chaos"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "codefleet.cli",
            "chaos",
            str(config),
            "--minutes",
            "2",
            "--seed",
            "0",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1150,
    )
    report_path = out / "chaos-report.json"
    assert report_path.exists(), proc.stderr[-3000:]
    report = json.loads(report_path.read_text())
    log = (out / "train.log").read_text()
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert report["ok"] and report["rollouts_lost"] == 0 and report["resumes"] == []
    injected = {f["kind"] for f in report["faults"] if f["injected_s"] is not None}
    assert injected == set(faults.KINDS), report["faults"]
    assert report["faults_survived"] == report["faults_injected"] == len(faults.KINDS), proc.stdout
    trainer = next(f for f in report["faults"] if f["kind"] == "trainer_worker")
    assert "starting a new trainer group from" in log, log[-3000:]  # recovered from the last checkpoint by itself
    assert trainer["restored_s"] is not None
    assert "faults injected 7, survived 7, rollouts lost 0" in proc.stdout
    print(next(line for line in proc.stdout.splitlines() if line.startswith("faults injected")))  # pytest -rP shows it
