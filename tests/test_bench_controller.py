"""`codefleet bench controller` on a very small configuration: the real Controller and Ray actors,
a few seconds of simulated rollouts."""

from __future__ import annotations

import json
import math
import random

from codefleet.bench.controller_bench import BenchConfig, expected_max_lognormal, run, table


def test_expected_max_matches_sampling():
    rng = random.Random(0)
    draws = [max(min(math.exp(rng.gauss(0, 1.0)), 20.0) for _ in range(64)) for _ in range(20_000)]
    assert abs(expected_max_lognormal(64, 1.0, 20.0) - sum(draws) / len(draws)) < 0.2  # ≈ 11.0
    assert abs(expected_max_lognormal(1, 1.0, 200.0) - math.exp(0.5)) < 0.01  # n=1, cap far out: the mean


def test_small_bench_reports_every_eta_and_synchronous_lags_are_zero(ray_session):
    cfg = BenchConfig(
        median_rollout_s=0.01,
        rollout_slots=16,
        batch_groups=2,
        group_size=4,
        etas=(0, 1, 2),
        sync_steps=3,
        async_steps=6,
        rollout_actors=1,
    )
    r = json.loads(json.dumps(run(cfg, log=lambda msg: None)))
    for key in (
        "sync_rollouts_per_s",
        "async_rollouts_per_s",
        "speedup",
        "trainer_busy_fraction",
        "version_lag_p99",
        "median_rollout_s",
        "trainer_step_s",
        "steps",
    ):
        assert key in r, key
    assert set(r["async_rollouts_per_s"]) == {"1", "2"} and r["steps"] == {"0": 3, "1": 6, "2": 6}
    assert r["per_eta"]["0"]["version_lag_max"] == 0 and r["per_eta"]["0"]["version_lag_p99"] == 0
    for eta in ("1", "2"):
        assert r["per_eta"][eta]["version_lag_max"] <= int(eta)
    assert r["sync_rollouts_per_s"] > 0
    best = max(r["async_rollouts_per_s"].values())
    assert math.isclose(r["speedup"], best / r["sync_rollouts_per_s"], rel_tol=0.01)
    assert 0 < r["trainer_busy_fraction"] <= 1
    # the trainer step is 30% of the expected synchronous step
    expected_sync = expected_max_lognormal(8, 1.0, 20.0) * 0.01 / 0.7
    assert math.isclose(r["trainer_step_s"], 0.3 * expected_sync, rel_tol=0.01)
    # a synchronous step cannot be shorter than its longest attempt plus the trainer step
    assert r["sync_overhead_s_per_step"] >= -0.001
    assert math.isclose(
        r["measured_sync_step_s"],
        r["sync_mean_longest_attempt_s"] + r["trainer_step_s"] + r["sync_overhead_s_per_step"],
        abs_tol=0.002,
    )
    lines = table(r).splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["0", "1", "2"]


def test_run_cli_prints_the_table_then_one_json_object(ray_session, monkeypatch, capsys):
    from codefleet.bench import controller_bench

    tiny = BenchConfig(
        median_rollout_s=0.005,
        rollout_slots=8,
        batch_groups=2,
        group_size=2,
        etas=(0, 1),
        sync_steps=2,
        async_steps=3,
        rollout_actors=1,
        quick=True,
    )
    monkeypatch.setattr(controller_bench, "QUICK", tiny)
    assert controller_bench.run_cli(quick=True, as_json=False) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("codefleet bench controller (median rollout 0.005 s, quick)")
    assert out[1].split()[:3] == ["eta", "rollouts/s", "speedup"]
    r = json.loads(out[-1])
    assert r["quick"] is True and set(r["async_rollouts_per_s"]) == {"1"} and r["steps"] == {"0": 2, "1": 3}
    assert controller_bench.run_cli(quick=True, as_json=True) == 0
    only = capsys.readouterr().out.strip().splitlines()
    assert len(only) == 1 and json.loads(only[0])["per_eta"]["0"]["version_lag_max"] == 0
