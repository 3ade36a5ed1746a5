"""RL on a local multi-node Ray cluster (a head and two worker nodes on this machine); a worker node is removed
mid-run: the run continues on the remaining node and no accepted rollout is lost.

The cluster lives in a subprocess (`ray.cluster_utils.Cluster` needs its own Ray, apart from the test session's
shared one); the training run is the real `codefleet train --address`. Rollout workers and sandbox hosts are
placed on the worker nodes by logical resources only (`rollout`, `sandbox`); engines and trainers on the head.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import glob, json, os, subprocess, sys, time
    import ray
    from ray.cluster_utils import Cluster

    run, python, engines_on_workers = sys.argv[1], sys.executable, sys.argv[2] == "1"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "resources": {"head": 8}})
    node = {"sandbox": 8, "rollout": 4, **({"engine_slot": 1} if engines_on_workers else {})}
    workers = [cluster.add_node(num_cpus=2, resources=node) for _ in range(2)]
    cluster.wait_for_nodes()
    overrides = ["tasks.n_train=4", "tasks.n_eval=1", "tasks.families=[config]", "sft.epochs=1",
                 "sft.batch_size=4", "rl.steps=4", "controller.group_size=2", "controller.batch_groups=1",
                 "controller.rollout_slots=4",
                 "rl.max_tokens=24", "rl.max_turns=2", "eval.max_tokens=8", "eval.attempts=1",
                 "trainer.workers=1",
                 "rollouts.workers=2", "rollouts.cpus=0.1", "trainer.cpus=0.5",
                 "rollouts.resources={rollout: 1}", "engine.resources={head: 1}",
                 "trainer.resources={head: 1}"]
    if engines_on_workers:  # one engine per worker node: the removed node's engine has nowhere to go
        overrides += ["engine.count=2", "engine.resources={engine_slot: 1}", "engine.wait_s=20",
                      "rl.steps=10"]
    proc = subprocess.Popen([python, "-m", "codefleet.cli", "train", "--out", run, "--no-progress",
                             "--address", cluster.address, *overrides], stderr=open(run + ".log", "w"))
    deadline = time.time() + 600
    while not glob.glob(os.path.join(run, "accepted", "*.json")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    removed = proc.poll() is None
    if removed:
        cluster.remove_node(workers[0])
    readded = False
    if removed and engines_on_workers:  # once the run goes on without the lost engine, give it a node again
        while "away (restarting" not in open(run + ".log").read() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        if proc.poll() is None:
            cluster.add_node(num_cpus=2, resources=node)
            readded = True
    code = proc.wait(timeout=900)
    print(json.dumps({"code": code, "removed": removed, "readded": readded}))
    cluster.shutdown()
""")


@pytest.mark.slow
@pytest.mark.timeout(1500)
# CI runs the harder case (a lost node takes an engine with it); the easier one is ~50 s more
@pytest.mark.parametrize(
    "engines_on_workers",
    [pytest.param(False, marks=pytest.mark.beyond_ci), True],
    ids=["engines-on-head", "an-engine-lost"],
)
def test_training_continues_when_a_worker_node_is_removed(tmp_path, engines_on_workers):
    """With `an-engine-lost`, each worker node holds an engine too: the removed node's engine cannot be placed
    again, so rollouts go to the other and weight broadcasts go on without it; once a new node joins, the engine
    comes back there with the newest weights and serves again."""
    run = str(tmp_path / "run")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, run, str(int(engines_on_workers))],
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    log = open(run + ".log").read() if os.path.exists(run + ".log") else ""
    assert out.returncode == 0, out.stderr[-3000:] + log[-3000:]
    status = json.loads(out.stdout.strip().splitlines()[-1])
    assert status == {"code": 0, "removed": True, "readded": engines_on_workers}, log[-3000:]
    trained = []
    for path in sorted(glob.glob(os.path.join(run, "trained", "step-*.json"))):
        trained += json.load(open(path))
    assert len(trained) == len(set(trained)) == (10 if engines_on_workers else 4) * 2
    accepted = set()
    for path in glob.glob(os.path.join(run, "accepted", "*.json")):
        accepted |= {r["rollout_id"] for r in json.load(open(path))["rollouts"]}
    assert set(trained) <= accepted
    assert json.load(open(os.path.join(run, "results.json")))["results"]["rl"]["tasks"] == 1
    if engines_on_workers:
        lost = log.index("engines: 1 serve version")
        assert "1 away (restarting, not waited for)" in log[lost:].splitlines()[0], log[-3000:]
        assert "engines: 2 serve version" in log[lost:], log[-3000:]  # back on the new node
