"""`codefleet bench weightsync` on a small model: every transport runs on the shared Ray session (vLLM's only
where it is installed), every key the issue names is there, and the CLI prints the table then one JSON object."""

from __future__ import annotations

import json

from codefleet.bench import weightsync_bench
from codefleet.bench.weightsync_bench import BenchConfig, model_config, run, table

TINY = BenchConfig(sizes_mb=(20,), bucket_mb=4.0, repeats=1, quick=True)


def test_model_config_reaches_the_size():
    for mb in (50, 500):
        cfg = model_config(mb)
        n = (cfg.vocab_size * cfg.d_model * 4 + cfg.n_layers * cfg.n_experts * 3 * cfg.d_model * cfg.d_expert) * 4
        assert 0.8 * mb * 1e6 < n < 1.25 * mb * 1e6, (mb, n)


def test_small_bench_reports_every_backend(ray_session):
    r = json.loads(json.dumps(run(TINY, log=lambda msg: None)))
    backends = ["bucketed", "gloo", "whole"] + (["vllm"] if weightsync_bench.HAVE_VLLM else [])
    for key in ("sync_s_by_mb", "gb_per_s", "pause_ms_p50"):
        assert set(r[key]) == set(backends) and set(r[key]["bucketed"]) == {"20"}, key
    size = r["per_size"]["20"]
    assert size["buckets"] >= 4 and size["group_setup_s"] > 0  # 20 MB in 4 MB buckets from two ranks
    for backend in backends:
        m = size["backends"][backend]
        assert m["sync_s"] > 0 and abs(m["gb_per_s"] - size["model_mb"] / 1000 / m["sync_s"]) < 0.01 * m["gb_per_s"]
        assert 0 < m["pause_ms_p50"] <= m["pause_ms_max"]
    assert r["speedup_bucketed_vs_whole"]["20"] > 0 and r["skipped"] == {}
    assert [line.split()[1] for line in table(r).splitlines()[1:]] == backends


def test_run_cli_prints_the_table_then_one_json_object(ray_session, monkeypatch, capsys):
    monkeypatch.setattr(weightsync_bench, "QUICK", TINY)
    assert weightsync_bench.run_cli(quick=True, as_json=False) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("codefleet bench weightsync (2 trainer ranks -> 2 engines")
    assert out[1].split()[:3] == ["MB", "backend", "sync"]
    r = json.loads(out[-1])
    assert r["config"]["quick"] is True and set(r["per_size"]) == {"20"}
