"""`codefleet bench mine` on the cached six sdist (`make sdists`): every key, consistent figures, and the table
then one JSON object; without the cache, one sentence saying how to make it."""

from __future__ import annotations

import json
import os

import pytest

from codefleet.bench import mine_bench
from codefleet.cli import main

SDISTS = os.path.join(os.path.dirname(__file__), "..", ".cache", "sdists")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_bench_mines_six_and_prints_the_table_then_json(capsys, monkeypatch):
    if not os.path.isdir(SDISTS):
        pytest.skip("the cached sdists are missing: run `make sdists` (it fetches them from PyPI once)")
    monkeypatch.setattr(mine_bench, "SDISTS", SDISTS)
    assert main(["bench", "mine", "--quick"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].startswith("codefleet bench mine") and out[1].split()[:3] == ["library", "version", "tried"]
    r = json.loads(out[-1])
    six = r["per_library"]["six"]
    assert 0 < six["kept"] <= 3 and six["kept"] <= six["tried"] and r["tasks"] == six["kept"]
    assert r["tasks_per_min"] == pytest.approx(60 * six["kept"] / six["wall_s"], rel=0.01)
    assert r["kept_share"] == pytest.approx(six["kept"] / six["tried"], abs=0.001)


def test_without_cached_sdists_the_bench_says_how_to_get_them(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(mine_bench, "SDISTS", str(tmp_path))
    assert main(["bench", "mine", "--quick"]) == 1
    err = capsys.readouterr().err
    assert "run `make sdists`" in err and len(err.strip().splitlines()) == 1, err
