"""The scaled-out backends together on a local 2-node Ray cluster: `codefleet train` from a tiny Qwen3-MoE
with vLLM engines, the FSDP2 trainer with expert parallelism over 2 ranks and weight sync in buckets over gloo
groups, against the same run on the default backends (codefleet engine, data-parallel trainer, whole-object
sync).

Runs in `.venv-vllm` (`make test-vllm`); elsewhere it is skipped. The cluster lives in a subprocess
(`ray.cluster_utils.Cluster` needs its own Ray, apart from the test session's), with the engine and the trainer
ranks on the head node and the rollout workers and sandboxes on the worker node, placed by logical resources.
vLLM on CPU cannot report routed experts, so both runs train without routing replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SCRIPT = textwrap.dedent("""
    import json, subprocess, sys
    from ray.cluster_utils import Cluster

    out, init, backends = sys.argv[1], sys.argv[2], sys.argv[3:]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "resources": {"head": 8}})
    cluster.add_node(num_cpus=2, resources={"sandbox": 8, "rollout": 4})
    cluster.wait_for_nodes()
    overrides = ["tasks.n_train=3", "tasks.n_eval=1", "tasks.families=[config]", "sft.epochs=1",
                 "sft.batch_size=3", "rl.steps=3", "controller.group_size=2", "controller.batch_groups=1",
                 "controller.rollout_slots=2",
                 "rl.max_tokens=24", "rl.max_turns=2", "eval.max_tokens=16", "eval.attempts=1",
                 "model.prompt=full", "model.max_seq_len=2048", f"model.init={init}", "rl.loss.kl_coef=0",
                 "rl.routing_replay=false", "controller.eta=0", "rl.reward.costs_on=all", "rl.reward.cost_per_s=0.01",
                 "trainer.workers=2", "sft.workers=2", "rollouts.workers=1",
                 "rollouts.cpus=0.1", "trainer.cpus=0.5", "rollouts.resources={rollout: 1}",
                 "engine.resources={head: 1}", "trainer.resources={head: 1}", *backends]
    code = subprocess.run([sys.executable, "-m", "codefleet.cli", "train", "--out", out, "--no-progress",
                           "--address", cluster.address, *overrides], stderr=open(out + ".log", "w")).returncode
    print(json.dumps({"code": code}))
    cluster.shutdown()
""")
SCALED = ["engine.backend=vllm", "trainer.backend=fsdp2_ep", "weight_sync.method=collective", "weight_sync.bucket_mb=1"]
DEFAULT = ["engine.backend=codefleet", "trainer.backend=dp", "weight_sync.method=whole"]


def _run(out: str, init: str, backends: list[str]) -> list[dict]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, out, init, *backends], env=env, capture_output=True, text=True, timeout=1200
    )
    log = open(out + ".log").read() if os.path.exists(out + ".log") else ""
    assert done.returncode == 0 and json.loads(done.stdout.strip().splitlines()[-1]) == {"code": 0}, (
        done.stderr[-2000:] + log[-4000:]
    )
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [row for row in map(json.loads, filter(str.strip, f)) if row["stage"] == "rl"]


@pytest.mark.timeout(1500)
def test_vllm_engines_an_expert_parallel_trainer_and_bucketed_sync_train_like_the_default_backends(tmp_path):
    pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm: `make test-vllm` (scripts/setup_vllm.sh)")
    from codefleet.bench.tiny_hf import make_tiny_hf

    init = make_tiny_hf(str(tmp_path / "tiny"), arch="qwen3_moe", head_dim=32)  # vLLM on CPU: head_dim >= 32
    rl = {
        name: _run(str(tmp_path / name), init, backends)
        for name, backends in (("scaled", SCALED), ("default", DEFAULT))
    }
    for name, rows in rl.items():  # the same versions, no lag, and the engine's logprobs are the trainer's
        assert [int(r["step"]) for r in rows] == [1, 2, 3] and not any(r["skipped"] for r in rows), (name, rows)
        assert all(r["lag_max"] == 0 for r in rows), (name, rows)
    assert all(r["sync_fallbacks"] == 0 for r in rl["scaled"]), rl["scaled"]  # every version over the gloo groups
    assert json.load(open(tmp_path / "scaled" / "results.json"))["results"]["rl"]
    gaps = {name: [abs(r["is_weight_mean"] - 1) for r in rows] for name, rows in rl.items()}
    assert max(gaps["default"]) <= 1e-4 and max(gaps["scaled"]) <= 1e-4, gaps
