"""`codefleet analyze` end to end on synthetic rollouts, and every kind of bad input:
corrupt Parquet, missing columns, an older schema version, an empty or missing directory."""

from __future__ import annotations

import json
import os
import random
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from codefleet.analysis.pipeline import AnalyzeConfig, NoRollouts, analyze
from codefleet.analysis.synthetic import planted_category, synthetic_record, synthetic_records
from codefleet.cli import main
from codefleet.store.parquet import RolloutWriter, read_rollouts, records_to_table
from codefleet.store.schema import SCHEMA, to_file_table


def test_cli_analyze_writes_summary_judgments_and_report(ray_session, tmp_path, capsys):
    run_dir = tmp_path / "run"
    writer = RolloutWriter(str(run_dir / "rollouts"))
    records = [r for chunk in synthetic_records(600, run="r1", seed=1, rows_per_step=100) for r in chunk]
    for i in range(0, 600, 100):
        writer.append(records[i : i + 100])
    assert main(["analyze", str(run_dir)]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert "600 rollouts" in out and f"wrote {run_dir}/analysis/summary.json" in out
    assert "judging" in captured.err and "600/600" in captured.err  # its own bar over the rows judged
    judged = pq.read_table(str(run_dir / "analysis" / "judgments.parquet")).to_pylist()
    assert len(judged) == 600
    planted = {(r["step"], r["group"], r["attempt"]): planted_category(r) for r in records}
    wrong = [r for r in judged if planted[(r["step"], r["group"], r["attempt"])] != r["category"]]
    assert len(wrong) <= 3
    summary = json.loads((run_dir / "analysis" / "summary.json").read_text())
    # the aggregates equal a direct computation over the judgments
    assert summary["rollouts"] == 600 and summary["solved"] == sum(r["category"] == "solved" for r in judged)
    assert summary["suspicious_wins"] == sum(r["suspicious"] for r in judged) > 0
    assert summary["categories"] == {
        c: n
        for c, n in sorted(
            {c: sum(r["category"] == c for r in judged) for c in {r["category"] for r in judged}}.items(),
            key=lambda kv: -kv[1],
        )
    }
    step3 = [r for r in judged if r["step"] == 3]
    row3 = [s for s in summary["per_step"] if s["step"] == 3][0]
    assert row3["rollouts"] == len(step3)
    assert row3["success_rate"] == pytest.approx(sum(r["success"] for r in step3) / len(step3))
    assert row3["turns"] == pytest.approx(sum(r["turns"] for r in step3) / len(step3))
    calc = [r for r in judged if r["family"] == "calc"]
    assert summary["per_family"]["calc"]["rollouts"] == len(calc)
    assert sum(summary["per_family"]["calc"]["categories"].values()) == len(calc)
    assert sum(summary["tool_mix"].values()) == sum(r["n_tool_calls"] for r in judged)
    calls = sum(r["n_tool_calls"] for r in judged)
    assert sum(int(k) * v for k, v in summary["parallel_calls_per_turn"].items()) == calls
    assert sum(summary["histograms"]["turns"]["counts"]) == 600
    assert summary["judge"] == {"backend": "rules", "scored": 600, "errors": 0, "error_examples": []}
    from ray.data import DataContext

    assert DataContext.get_current().default_hash_shuffle_parallelism != 2  # our settings were restored
    html = (run_dir / "analysis" / "report.html").read_text()
    assert len(re.findall(r'<img alt="" src="data:image/png;base64,[A-Za-z0-9+/=]{200,}">', html)) == 7
    # self-contained: nothing loads from elsewhere, and the page forbids it
    assert not re.search(r"""(src|href)=["']?(https?:|//)""", html) and "Content-Security-Policy" in html
    analysis = run_dir / "analysis"
    links = set(re.findall(r'href="(rollouts/[^"]+\.html)"', html))
    assert len(links) >= 500  # the browse table's 500 and the other tables' rows (which may overlap)
    assert {link.split("/", 1)[1] for link in links} == set(os.listdir(analysis / "rollouts"))  # a page per link
    assert summary["browse"] == {"shown": 500, "of": 600}
    # reasons grouped by rules: every failure and every suspicious win in exactly one cluster
    clusters = summary["clusters"]
    assert clusters["source"] == "rules"
    assert sum(c["count"] for c in clusters["failures"]) == 600 - summary["solved"]
    assert sum(c["count"] for c in clusters["suspicious_wins"]) == summary["suspicious_wins"]
    by_id = {r["rollout_id"]: r for r in judged}
    for cluster in clusters["failures"]:
        assert all(by_id[i]["category"] != "solved" for i in cluster["examples"]) and cluster["examples"]
    assert summary["overview"].startswith(f"600 rollouts over steps 0–5; {summary['solved']} solved")
    assert summary["overview"] in html.replace("&#x27;", "'")
    win = next(r for r in judged if r["suspicious"])
    wins_section = html.split("<h2>Suspicious wins</h2>")[1].split("<h2>Worst failures</h2>")[0]
    assert win["task_id"] in wins_section and "suspicious win" in wins_section
    worst = html.split('<table class="rows" id="worst_failures">')[1].split("</table>")[0]
    assert worst.count("<tr") == 21  # header + the 20 worst


def test_bad_files_are_named_and_the_rest_is_analysed(ray_session, tmp_path):
    store = tmp_path / "rollouts"
    rng = random.Random(5)
    RolloutWriter(str(store)).append([synthetic_record(rng, i, run="r", step=0) for i in range(30)])
    step1 = store / "run=r" / "step=1"
    step1.mkdir(parents=True)
    (step1 / "part-corrupt.parquet").write_bytes(b"PAR1" + os.urandom(64))
    pq.write_table(pa.table({"task_id": ["x"], "turns": [2]}), step1 / "part-noreward.parquet")
    # schema version 0: no run/step/split/tool_calls columns, an int reward; still analysed
    pq.write_table(
        pa.table(
            {
                "task_id": ["old-1", "old-2"],
                "reward": pa.array([1, 0], pa.int32()),
                "stop_reason": ["submit", "max_turns"],
                "all_passed": [True, False],
                "checks_passed": [2, 0],
                "checks_total": [2, 2],
                "turns": [3, 40],
                "diff": ["--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-return f(x)\n+return 1\n", "d"],
            }
        ),
        step1 / "part-old.parquet",
    )
    (step1 / ".part-inflight.parquet.tmp").write_bytes(b"half a file")  # a writer's temp file: ignored
    # a footer that reads, pages that do not: found when the first pass fails, left out, pass rerun
    RolloutWriter(str(tmp_path / "tmp")).append([synthetic_record(rng, i, run="r", step=2) for i in range(20)])
    good = next((tmp_path / "tmp").rglob("*.parquet")).read_bytes()
    footer = int.from_bytes(good[-8:-4], "little") + 8
    (step1 / "part-badbody.parquet").write_bytes(good[:4] + b"\0" * (len(good) - footer - 4) + good[-footer:])
    logged: list[str] = []
    result = analyze(str(store), AnalyzeConfig(out_dir=str(tmp_path / "out"), report=False), log=logged.append)
    assert result.summary["rollouts"] == 32
    judged = {r["task_id"]: r for r in pq.read_table(str(tmp_path / "out" / "judgments.parquet")).to_pylist()}
    assert (judged["old-1"]["run"], judged["old-1"]["step"], judged["old-1"]["category"]) == ("r", 1, "solved")
    assert judged["old-2"]["category"] == "budget_exhausted"
    text = "\n".join(logged)
    assert re.search(r"part-corrupt\.parquet: not a readable Parquet file .*; skipped", text)
    assert "part-noreward.parquet: lacks required column(s) reward, stop_reason; skipped" in text
    assert "part-old.parquet: older or different schema" in text and "upgraded on read" in text
    assert re.search(r"part-badbody\.parquet: its data could not be read .*; skipped", text)
    assert "inflight" not in text
    assert len(result.problems) == 4 and result.summary["files"]["read"] == 2


def test_empty_or_missing_directory_says_so(tmp_path, capsys):
    (tmp_path / "rollouts").mkdir()
    with pytest.raises(NoRollouts, match="no readable rollouts under .*rollouts"):
        analyze(str(tmp_path))
    assert main(["analyze", str(tmp_path)]) == 1
    assert "no readable rollouts under" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path), "--judge", "gpt-9"]) == 2
    assert "unknown judge 'gpt-9'" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path), "--judge", f"local:{tmp_path}/no-ckpt"]) == 2
    assert "is not a directory; give --judge local:DIR" in capsys.readouterr().err
    assert main(["analyze", str(tmp_path), "--judge", "http://127.0.0.1:1/v1", "--rubric", "/no/rubric.md"]) == 2
    assert "/no/rubric.md" in capsys.readouterr().err
    assert not (tmp_path / "analysis").exists()


def test_figures_equal_a_direct_computation_and_damaged_values_are_left_out(ray_session, tmp_path):
    """Means and p50/p90 against numpy over the store; a NaN, infinite or null figure, a null tool-call list
    and a row without a step neither crash the analysis nor count as 0."""
    import numpy as np

    store = tmp_path / "rollouts"
    writer = RolloutWriter(str(store))
    for chunk in synthetic_records(300, run="r", seed=4, rows_per_step=100):
        writer.append(chunk)
    rng = random.Random(9)
    damaged = records_to_table([synthetic_record(rng, i, run="r", step=5) for i in range(4)]).to_pylist()
    damaged[0]["wall_s"], damaged[1]["turns"], damaged[2]["tool_calls_per_turn"] = float("nan"), None, float("inf")
    damaged[3]["tool_calls"], damaged[3]["step"] = None, None
    os.makedirs(store / "run=r" / "step=5")
    damaged_table = to_file_table(pa.Table.from_pylist(damaged, schema=SCHEMA))
    pq.write_table(damaged_table.slice(0, 3), store / "run=r" / "step=5" / "part-damaged.parquet")
    pq.write_table(damaged_table.slice(3), store / "run=r" / "part-nostep.parquet")  # no step= in its path
    result = analyze(str(tmp_path), AnalyzeConfig(out_dir=str(tmp_path / "out")), log=lambda m: None)
    s = result.summary
    rows = read_rollouts(str(store), on_problem=pytest.fail).to_pandas()
    rows["tokens"] = rows["prompt_tokens"] + rows["completion_tokens"]
    assert s["rollouts"] == len(rows) == 304 and result.problems == []
    for column in ("turns", "wall_s", "tool_calls_per_turn", "tokens"):
        values = rows[column].to_numpy(dtype=float)
        values = values[np.isfinite(values)]
        assert s["means"][column] == pytest.approx(values.mean()), column
        for q in (0.5, 0.9) if column in s["quantiles"] else ():  # within 1% of the value at that rank
            assert s["quantiles"][column][f"p{int(q * 100)}"] == pytest.approx(
                np.quantile(values, q, method="lower"), rel=0.016
            ), (column, q)
    assert max(s["quantiles"]["turns"].values()) <= rows["turns"].max()
    assert sum(s["histograms"]["wall_s"]["counts"]) == 303  # the NaN is in no bin
    assert [r["rollouts"] for r in s["per_step"] if r["step"] is None] == [1]  # the row without a step: last
    assert (tmp_path / "out" / "report.html").exists()


def test_every_rollout_taking_6_turns_reads_p50_and_p90_of_6(ray_session, tmp_path):
    rng = random.Random(2)
    records = [synthetic_record(rng, i, run="r", step=0) for i in range(40)]
    for r in records:
        r["turns"] = 6
    RolloutWriter(str(tmp_path / "rollouts")).append(records)
    result = analyze(str(tmp_path), AnalyzeConfig(report=False), log=lambda m: None)
    assert result.summary["quantiles"]["turns"] == {"p50": 6.0, "p90": 6.0}  # the 1-2-5 bins read 7.6 / 9.5


def test_a_store_whose_files_hold_no_rows_says_so(tmp_path, capsys):
    os.makedirs(tmp_path / "rollouts" / "run=r" / "step=0")
    pq.write_table(SCHEMA.empty_table(), tmp_path / "rollouts" / "run=r" / "step=0" / "part-0.parquet")
    assert main(["analyze", str(tmp_path)]) == 1
    assert "its 1 Parquet file(s) hold no rows" in capsys.readouterr().err
    assert not (tmp_path / "analysis").exists()


def test_a_second_analysis_of_the_same_output_waits_for_the_first(ray_session, tmp_path):
    """Two analyses writing one OUT: the second waits, then writes its own judgments only (no doubled counts)."""
    import fcntl
    import threading
    import time

    RolloutWriter(str(tmp_path / "rollouts")).append(
        [synthetic_record(random.Random(1), i, run="r", step=0) for i in range(30)]
    )
    out = tmp_path / "analysis"
    out.mkdir()
    logged: list[str] = []
    results = []
    with open(out / ".analyze.lock", "a") as other:  # the first analysis, still running
        fcntl.flock(other, fcntl.LOCK_EX)
        thread = threading.Thread(
            target=lambda: results.append(analyze(str(tmp_path), AnalyzeConfig(report=False), log=logged.append))
        )
        thread.start()
        deadline = time.monotonic() + 60
        while not any("another analysis is writing" in m for m in logged) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any(f"another analysis is writing {out}; waiting for it" in m for m in logged), logged
        (out / "judgments.parquet").mkdir()  # the first one's judgments, half written
        pq.write_table(read_rollouts(str(tmp_path)), out / "judgments.parquet" / "first.parquet")
        assert thread.is_alive() and not (out / "summary.json").exists()
    thread.join(timeout=120)
    assert results and results[0].summary["rollouts"] == 30
    assert pq.read_table(str(out / "judgments.parquet")).num_rows == 30


@pytest.mark.slow
def test_shuffle_aggregate_matches_the_driver_combine(ray_session, tmp_path):
    writer = RolloutWriter(str(tmp_path / "rollouts"))
    for chunk in synthetic_records(300, rows_per_step=100):
        writer.append(chunk)
    a = analyze(str(tmp_path), AnalyzeConfig(out_dir=str(tmp_path / "a"), report=False), log=lambda m: None)
    b = analyze(
        str(tmp_path),
        AnalyzeConfig(out_dir=str(tmp_path / "b"), report=False, shuffle_aggregate=True),
        log=lambda m: None,
    )
    for key in ("rollouts", "solved", "categories", "per_family", "per_step", "tool_mix", "histograms"):
        assert _rounded(a.summary[key]) == _rounded(b.summary[key]), key  # sums in another order: float noise


def _rounded(value):
    if isinstance(value, float):
        return round(value, 9)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value
