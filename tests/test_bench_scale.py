"""`codefleet bench scale` on a small configuration: the real Controller with 256 attempts in flight over
four simulated node actors, a few seconds measured."""

from __future__ import annotations

import json
import math

import pytest

from codefleet.bench.scale_bench import ScaleConfig, run, table

KEYS = ("concurrency", "controller_ms_per_rollout", "schedule_ms_p99", "driver_mb_per_1k_inflight", "rollouts_per_s")


@pytest.mark.slow
def test_small_scale_run_reports_every_key_and_accounts_for_every_attempt(ray_session):
    cfg = ScaleConfig(
        concurrencies=(256,), nodes=4, offered_rollouts_per_s=100.0, settle_s=1.0, measure_s=6.0, fill_timeout_s=60.0
    )
    r = json.loads(json.dumps(run(cfg, log=lambda msg: None)))
    for key in (*KEYS, "schedule_ms_p50", "driver_ms_per_rollout", "growth_ratio", "target_met", "per_concurrency"):
        assert key in r, key
    assert r["concurrency"] == [256]
    row = r["per_concurrency"][0]
    for key in (
        "controller_ms_per_rollout",
        "driver_ms_per_rollout",
        "schedule_ms_p50",
        "schedule_ms_p99",
        "rollouts_per_s",
        "nodes_ms_per_rollout",
    ):
        assert math.isfinite(row[key]) and row[key] > 0, (key, row[key])
    assert row["schedule_ms_p50"] <= row["schedule_ms_p99"] and row["schedule_samples"] > 100
    # the controller's own threads are part of the driver process
    assert row["controller_ms_per_rollout"] <= row["driver_ms_per_rollout"]
    # every attempt started either finished on its node or was cancelled (there or before it began)
    assert row["started"] == row["finished"] + row["cancelled"] + row["never_began"]
    assert 0 <= row["never_began"] <= 256 and row["infra_failures"] == 0
    assert row["finished"] >= row["trained_rollouts"] > 0
    # admission never lets more than the slots run, and the slots were kept nearly full
    assert row["inflight_max"] <= 256 and row["inflight_mean"] >= 0.8 * 256
    assert row["version_lag_max"] <= cfg.eta
    # a regression worth failing for: one rollout costing the controller's threads more than 5 ms of CPU
    # (the full bench measures ~0.4 ms on a loaded 2-core machine)
    assert row["controller_ms_per_rollout"] < 5.0
    lines = table(r).splitlines()
    assert lines[0].split()[0] == "concurrency" and lines[1].split()[0] == "256"
