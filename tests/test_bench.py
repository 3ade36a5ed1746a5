"""Benchmarks are code: each `codefleet bench ...` ends with one JSON object
carrying the keys docs/benchmarks.md and the issues name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _bench(what: str, state_dir: str, timeout_s: float) -> dict:
    env = dict(os.environ, CODEFLEET_STATE_DIR=state_dir)
    proc = subprocess.run([sys.executable, "-m", "codefleet.cli", "bench", what, "--quick"], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 2, "expected a title and a table before the JSON"
    return json.loads(lines[-1])


def test_bench_sandbox_reports_every_named_figure(state_dir):
    r = _bench("sandbox", state_dir, 180)
    for key in ("create_ms_p50", "create_ms_p99", "exec_ms_p50", "exec_ms_p99", "fork_ms_p50",
                "rss_mb_per_sandbox", "max_live_sandboxes", "subprocess_ms_p50"):
        assert isinstance(r[key], (int, float)) and r[key] > 0, key
    assert r["max_live_sandboxes"] == 100  # quick mode holds 100 at once, all answering


@pytest.mark.slow
def test_bench_engine_reports_engine_and_hf_figures(state_dir):
    r = _bench("engine", state_dir, 600)
    for key in ("engine_tokens_per_s_b1", "engine_tokens_per_s_b32", "hf_tokens_per_s_b32", "prefix_cache_speedup"):
        assert r[key] > 0, key
    assert r["native_kernel"] is True  # set-up builds it; without it the figures are the slower fallback's


@pytest.mark.slow
def test_bench_moe_reports_moe_dense_and_hf_figures(state_dir):
    r = _bench("moe", state_dir, 900)
    for key in ("moe_tokens_per_s", "dense_tokens_per_s", "hf_tokens_per_s"):
        assert r[key] > 0, key
    assert r["native_kernel"] is True  # set-up builds it; without it the figures are the PyTorch path's
