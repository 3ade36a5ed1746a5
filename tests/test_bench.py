"""Benchmarks are code: each `codefleet bench ...` ends with one JSON object
carrying the keys docs/benchmarks.md and the issues name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


def _bench(what: str, state_dir: str, timeout_s: float, *flags: str) -> dict:
    env = dict(os.environ, CODEFLEET_STATE_DIR=state_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "codefleet.cli", "bench", what, "--quick", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert len(lines) > 2, "expected a title and a table before the JSON"
    return json.loads(lines[-1])


def test_bench_sandbox_reports_every_named_figure(state_dir):
    r = _bench("sandbox", state_dir, 180)
    for key in (
        "create_ms_p50",
        "create_ms_p99",
        "exec_ms_p50",
        "exec_ms_p99",
        "fork_ms_p50",
        "rss_mb_per_sandbox",
        "max_live_sandboxes",
        "subprocess_ms_p50",
    ):
        assert isinstance(r[key], (int, float)) and r[key] > 0, key
    assert r["max_live_sandboxes"] == 100  # quick mode holds 100 at once, all answering


ENGINE_FIGURES = (
    "engine_tokens_per_s_b1",
    "engine_tokens_per_s_b32",
    "hf_tokens_per_s_b1",
    "hf_tokens_per_s_b32",
    "engine_over_hf_b32",
    "load_s",
    "load_peak_rss_mb",
    "checkpoint_mb",
    "load_rss_over_size",
    "prefix_cache_speedup",
)


@pytest.fixture(scope="module")
def small_qwen3_moe(tmp_path_factory):
    """A Qwen3-MoE directory saved by transformers, smaller than the bench's own tiny one (a fast run)."""
    from codefleet.bench.engine_checkpoints import build_tiny_qwen3_moe

    return build_tiny_qwen3_moe(
        str(tmp_path_factory.mktemp("qwen3_moe")),
        vocab_size=512,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        n_experts=4,
        d_expert=64,
        max_seq_len=2048,
    )


def test_bench_engine_runs_both_sides_on_the_given_checkpoint(state_dir, small_qwen3_moe):
    r = _bench("engine", state_dir, 300, "--checkpoint", small_qwen3_moe)
    assert r["checkpoint"] == small_qwen3_moe and r["architecture"] == "Qwen3MoeForCausalLM"
    assert (r["d_model"], r["n_layers"], r["n_experts"], r["vocab_size"], r["qk_norm"]) == (64, 2, 4, 512, True)
    for key in ENGINE_FIGURES:
        assert r[key] > 0, key
    # no vLLM in this venv, or (in .venv-vllm) a directory without a tokenizer: the vLLM column is null, and why
    assert r["vllm_tokens_per_s_b32"] is None and r["engine_over_vllm_b1"] is None and r["vllm_version"] is None
    assert r["note"].startswith("no vLLM peer")


def test_bench_engine_refuses_an_unknown_shape_or_a_shape_with_a_checkpoint(small_qwen3_moe):
    from codefleet.bench import engine_bench

    with pytest.raises(ValueError, match="shape must be tiny or one of qwen3-0.6b, moe-1b"):
        engine_bench.run(shape="qwen3-8b", log=lambda msg: None)
    with pytest.raises(ValueError, match="not both"):
        engine_bench.run(shape="moe-1b", checkpoint_dir=small_qwen3_moe, log=lambda msg: None)


@pytest.mark.slow
@pytest.mark.beyond_ci  # ~30 s; `make bench` runs the benchmark itself
def test_bench_engine_builds_the_tiny_qwen3_moe_without_a_checkpoint(state_dir):
    r = _bench("engine", state_dir, 600)
    assert r["checkpoint"] == "tiny-qwen3-moe (built)" and r["architecture"] == "Qwen3MoeForCausalLM"
    assert (r["d_model"], r["n_layers"], r["n_experts"], r["top_k"], r["vocab_size"]) == (192, 4, 16, 2, 4096)
    for key in ENGINE_FIGURES:
        assert r[key] > 0, key
    assert r["native_kernel"] is True  # set-up builds it; without it the figures are the slower fallback's


def test_bench_engine_load_peak_is_the_loads_own_not_the_parents(small_qwen3_moe):
    """A process started from a large one inherits its peak in `ru_maxrss`; the load's figure must not."""
    from codefleet.bench.engine_bench import load_cost

    ballast = bytearray(600 * 2**20)  # this process's peak: 600 MB above anything the load needs
    cost = load_cost(small_qwen3_moe, threads=1)
    del ballast
    assert 0 < cost["load_peak_rss_mb"] < 300
    assert cost["checkpoint_mb"] > 0 and cost["load_s"] > 0


def test_bench_engine_rejects_a_directory_transformers_cannot_load(tmp_path, capsys, monkeypatch):
    from codefleet.bench import engine_bench

    monkeypatch.delenv("CODEFLEET_DEBUG", raising=False)
    assert engine_bench.run_cli(quick=True, checkpoint_dir=str(tmp_path)) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith(f"codefleet bench engine could not run: {tmp_path} is not a Hugging Face model directory")
    )


@pytest.mark.slow
@pytest.mark.beyond_ci  # ~21 s; `make bench` runs the benchmark itself
def test_bench_moe_reports_moe_dense_and_hf_figures(state_dir):
    r = _bench("moe", state_dir, 900)
    for key in ("moe_tokens_per_s", "dense_tokens_per_s", "hf_tokens_per_s"):
        assert r[key] > 0, key
    assert r["native_kernel"] is True  # set-up builds it; without it the figures are the PyTorch path's


def test_bench_engine_prefills_every_timed_prompt(monkeypatch, small_qwen3_moe):
    """The engine parks finished sequences in its prefix cache; a timed prompt seen before (in the warm-up or an
    earlier repeat) would skip its prefill on the engine's side only, while HF prefills every prompt."""
    from codefleet.bench import engine_bench
    from codefleet.inference.engine import Engine

    reused: list[int] = []
    generate = Engine.generate

    def recording(self, prompts, params):
        results = generate(self, prompts, params)
        reused.extend(r.cached_tokens for r in results)
        return results

    monkeypatch.setattr(Engine, "generate", recording)
    monkeypatch.setattr(engine_bench, "hf_peer", lambda path, dtype: None)  # the engine side only
    monkeypatch.setattr(engine_bench, "_multiturn", lambda *a: {})  # measures the prefix cache on purpose
    r = engine_bench.run(quick=True, repeats=2, log=lambda msg: None, checkpoint_dir=small_qwen3_moe)
    assert len(reused) == 2 + 2 * (1 + 32)  # the warm-up's 2 requests, then 2 repeats of b1 and b32
    assert reused == [0] * len(reused)
    assert r["engine_prefix_tokens_reused"] == 0
    assert r["engine_tokens_per_s_b1"] > 0 and r["engine_tokens_per_s_b32"] > 0 and r["hf_tokens_per_s_b32"] is None


def test_sandbox_bench_alternates_a_figure_with_its_peer():
    from codefleet.bench.timing import alternated

    calls: list[str] = []
    times = alternated({"exec": (lambda: calls.append("e"), 6), "subprocess": (lambda: calls.append("s"), 3)}, rounds=3)
    assert "".join(calls) == "ees" * 3  # each round calls both, so a burst of load hits both sides
    assert len(times["exec"]) == 6 and len(times["subprocess"]) == 3
    assert all(t >= 0 for t in times["exec"] + times["subprocess"])


def test_bench_that_cannot_run_says_why_in_one_sentence(monkeypatch, capsys):
    from codefleet.bench import sandbox_bench
    from codefleet.sandbox import namespace

    why = "bubblewrap cannot create namespaces here (no user namespaces); choose backend='local'"
    monkeypatch.setattr(namespace, "unavailable_reason", lambda: why)
    monkeypatch.delenv("CODEFLEET_DEBUG", raising=False)
    assert sandbox_bench.run_cli(quick=True, backend="namespace") == 1
    out, err = capsys.readouterr()
    assert out == ""  # no table, no JSON: there is no figure to print
    assert err.strip().splitlines()[-1] == f"codefleet bench sandbox could not run: {why}"
    assert "Traceback" not in err
