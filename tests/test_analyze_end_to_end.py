"""`codefleet analyze` on a real short training run, with `codefleet serve` as the judge, then the report in a real
headless Chromium: the researcher's morning, end to end.

The run is the real CLI (`codefleet train`: SFT for one epoch, then RL); the judge is the run's own tiny checkpoint
behind the real OpenAI-compatible server, whose answers are not verdicts: every row must say so, and the clusters
must fall back to the rules and say why. A policy this young rarely calls a tool; where it did, a transcript must
show the call (the browser test on a hand-made report checks tool calls in every run).
"""

from __future__ import annotations

import glob
import html
import json
import os
import re
import subprocess
import sys
import time

import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from browser_check import browser_missing, check_report_in_browser

ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
TINY = [
    "tasks.n_train=4",
    "tasks.n_eval=2",
    "tasks.families=[bugfix, config]",
    "sft.epochs=1",
    "sft.batch_size=4",
    "rl.steps=3",
    "controller.group_size=2",
    "controller.batch_groups=1",
    "controller.rollout_slots=4",
    "controller.eta=1",
    "rl.max_tokens=48",
    "rl.max_turns=2",
    "eval.max_tokens=24",
    "eval.attempts=1",
    "cluster.num_cpus=4",
]


def _cli(*args: str, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "codefleet.cli", *args], env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def _serve(checkpoint: str) -> tuple[subprocess.Popen, str]:
    server = subprocess.Popen(
        [sys.executable, "-m", "codefleet.cli", "serve", "--checkpoint", checkpoint, "--port", "0"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        assert line or server.poll() is None, "codefleet serve exited before it listened"
        found = re.search(r"(http://[\d.]+:\d+/v1)", line)
        if found:
            return server, found.group(1)
    server.kill()
    raise AssertionError("codefleet serve never said where it listens")


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.timeout(1500)
def test_analyze_a_real_run_with_codefleet_serve_as_judge_and_browse_the_report(tmp_path):
    if (why := browser_missing()) and not os.environ.get("CODEFLEET_REQUIRE_BROWSER"):
        pytest.skip(why)
    run = str(tmp_path / "run")
    _cli("train", "--out", run, "--no-progress", *TINY, timeout=1200)
    checkpoint = sorted(p for p in glob.glob(os.path.join(run, "checkpoints", "rl-step-*")) if os.path.isdir(p))[-1]
    server, url = _serve(checkpoint)
    try:
        analyzed = _cli("analyze", run, "--judge", url, "--judge-timeout-s", "120", "--judge-retries", "0", timeout=900)
    finally:
        server.terminate()
        server.wait(timeout=60)
    out = os.path.join(run, "analysis")
    # a quiet tool: its own bar and result lines; Ray's output in the log file, not on the terminal
    terminal = analyzed.stdout + analyzed.stderr
    assert "judging" in terminal and "rows" in terminal and "wrote " in terminal
    assert not re.search(r"WARNING|DeprecationWarning|concurrency=|\(raylet\)|INFO worker", terminal), terminal
    assert os.path.getsize(os.path.join(out, "ray.log")) > 0

    store_rows = pq.read_table(os.path.join(run, "rollouts")).num_rows
    judged = pq.read_table(os.path.join(out, "judgments.parquet")).to_pylist()
    assert len(judged) == store_rows > 0
    summary = json.load(open(os.path.join(out, "summary.json")))
    # the tiny checkpoint answers with tokens, not verdicts: every row says so, and nothing is lost
    assert summary["judge"]["errors"] + summary["judge"]["scored"] == store_rows
    assert all(r["judge_error"] for r in judged if r["judge_score"] is None)
    # reasons grouped: every failure and every suspicious win in exactly one cluster, the note says where from
    clusters = summary["clusters"]
    failures = sum(r["category"] != "solved" for r in judged)
    assert sum(c["count"] for c in clusters["failures"]) == failures
    assert sum(c["count"] for c in clusters["suspicious_wins"]) == summary["suspicious_wins"]
    if clusters["source"] == "rules" and failures:
        assert "grouped by rules" in clusters["note"]
    assert summary["overview"].startswith(f"{store_rows} rollouts")

    # transcripts: a page for every rollout in the tables, with the task and the turns' tool calls
    report = open(os.path.join(out, "report.html"), encoding="utf-8").read()
    links = set(re.findall(r'href="(rollouts/[^"]+\.html)"', report))
    assert len(links) == min(store_rows, 500)  # the browse table holds every rollout of a short run
    pages = [open(os.path.join(out, link), encoding="utf-8").read() for link in sorted(links)]
    store = pq.read_table(os.path.join(run, "rollouts"), columns=["task_id", "n_tool_calls", "transcript"])
    assert any('class="call' in p for p in pages) == (pc.sum(store.column("n_tool_calls")).as_py() > 0)
    assert all(p.count('class="turn') >= 1 for p in pages)  # each shows the policy's turn
    first = store.slice(0, 1).to_pylist()[0]
    task_line = json.loads(first["transcript"])[0]["content"].splitlines()[1][:60]
    shown = [html.unescape(re.sub(r"<[^>]+>", "", p)) for p in pages if first["task_id"] in p]
    assert shown and any(task_line in text for text in shown), task_line  # the task as the model saw it

    seen = check_report_in_browser(out, str(tmp_path / "screenshots"), need_tool_call=False)
    assert all(os.path.getsize(path) > 10_000 for path in seen["screenshots"].values())
