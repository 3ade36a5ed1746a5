"""`codefleet bench env --quick`: a real image built from the host's userland, imported, and real
sandboxes created, forked and run in it next to the host userland's."""

from __future__ import annotations

import json
import math
import os

import pytest

from codefleet.bench import env_bench
from codefleet.bench.image_fixture import HOST_PYTHON
from codefleet.sandbox.bwrap import unavailable_reason

UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"namespace sandboxes cannot run here: {UNAVAILABLE}"),
    pytest.mark.skipif(
        not os.path.exists(HOST_PYTHON) or not os.path.exists("/bin/bash"),
        reason="builds its image from the host's /usr/bin/python3 and /bin/bash",
    ),
]

FIGURES = (
    "import_s_cold",
    "import_s_cached",
    "create_ms_p50_image",
    "create_ms_p50_host",
    "fork_ms_p50_image",
    "fork_ms_p50_host",
    "exec_ms_p50_image",
    "exec_ms_p50_host",
    "disk_mb_per_extra_image_sharing_base",
    "image_mb",
)
KEYS = FIGURES + (
    "create_delta_ms",
    "fork_delta_ms",
    "target_met",
    "quick",
    "create_rounds",
    "fork_rounds",
    "exec_per_side",
    "cold_imports",
)


@pytest.fixture(scope="module")
def quick_run() -> dict:
    return json.loads(json.dumps(env_bench.run(quick=True, log=lambda msg: None)))


def test_every_figure_is_there_positive_and_consistent(quick_run):
    r = quick_run
    assert set(KEYS) <= set(r), set(KEYS) - set(r)
    assert r["quick"] is True
    if os.geteuid() == 0:  # env build needs root; without it the run says so
        assert r["build_s_cold"] > r["build_s_cached"] > 0 and "not_measured" not in r
    else:
        assert r["not_measured"] == "codefleet env build (it needs root)" and "build_s_cold" not in r
    for key in FIGURES:
        assert isinstance(r[key], (int, float)) and r[key] > 0, (key, r[key])
    for what in ("create", "fork"):
        delta = r[f"{what}_ms_p50_image"] - r[f"{what}_ms_p50_host"]
        assert math.isclose(r[f"{what}_delta_ms"], delta, abs_tol=1e-3), what
    assert r["target_met"] == (max(r["create_delta_ms"], r["fork_delta_ms"]) <= env_bench.TARGET_DELTA_MS)
    assert "python3" in r["image_tools"] and "git" in r["image_tools"]


def test_a_cached_import_is_a_no_op_and_a_shared_base_is_stored_once(quick_run):
    r = quick_run
    assert r["import_s_cached"] < r["import_s_cold"] / 5
    # The base layer (python3, bash, git, coreutils, their libraries: megabytes) is not stored again:
    # the second image adds its small top layer and its rootfs's directories.
    assert r["image_mb"] > 5
    assert r["disk_mb_per_extra_image_sharing_base"] < r["image_mb"] / 10


def test_disk_bytes_counts_a_hard_link_once(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 100_000)
    one = env_bench.disk_bytes(str(tmp_path))
    os.link(tmp_path / "a", tmp_path / "b")
    assert env_bench.disk_bytes(str(tmp_path)) == one
    (tmp_path / "c").write_bytes(b"x" * 100_000)
    assert env_bench.disk_bytes(str(tmp_path)) >= one + 100_000


def test_the_cli_prints_the_table_then_one_json_object(monkeypatch, capsys):
    from codefleet.cli import main

    monkeypatch.setattr(
        env_bench, "QUICK", {"create_rounds": 2, "fork_rounds": 1, "exec_per_side": 20, "cold_imports": 1}
    )
    assert main(["bench", "env", "--quick"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("codefleet bench env (") and "quick" in out[0]
    assert out[1].split()[:4] == ["figure", "image", "host", "delta"]
    assert any(line.startswith("target (create and fork within 2.0 ms") for line in out)
    r = json.loads(out[-1])
    assert r["create_rounds"] == 2 and set(KEYS) <= set(r)
    assert main(["bench", "env", "--quick", "--json"]) == 0
    only = capsys.readouterr().out.strip().splitlines()
    assert len(only) == 1 and json.loads(only[0])["quick"] is True
