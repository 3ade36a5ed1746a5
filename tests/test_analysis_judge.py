"""The LLM judge behind a real local HTTP server speaking the OpenAI protocol (tests/openai_stub.py):
scripted verdicts, a malformed answer, a timeout, a retried 503, rate limiting, an endpoint that is
down, and the judge actor pool finishing on a 2-CPU Ray (ray#44687)."""

from __future__ import annotations

import json
import random
import re
import threading

import pyarrow.parquet as pq
import pytest
from openai_stub import OpenAIStub, fail, raw, reply

from codefleet.analysis.judge import JudgeBatch, JudgeConfig
from codefleet.analysis.pipeline import AnalyzeConfig, analyze
from codefleet.analysis.rules import categorise
from codefleet.analysis.synthetic import synthetic_record
from codefleet.store.parquet import RolloutWriter, records_to_table

GOOD = '{"score": 0.9, "reason": "a clean fix of the cause"}'


def records(n: int, run: str = "r", per_step: int = 4) -> list[dict]:
    rng = random.Random(3)
    out = []
    for i in range(n):
        r = synthetic_record(rng, i, run=run, step=i // per_step, group_size=1)
        r["task_id"] = f"t{i:03d}"
        out.append(r)
    return out


class Verdicts:
    """A stub script item: answers by the task id in the prompt; counts attempts per task."""

    def __init__(self, plan: dict[str, str]):
        self.plan = plan  # task id -> "good" | "garbage" | "slow" | "flaky"
        self.attempts: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, body: dict):
        task = re.search(r"Task: (\S+)", body["messages"][1]["content"]).group(1)
        with self.lock:
            self.attempts[task] = self.attempts.get(task, 0) + 1
            attempt = self.attempts[task]
        kind = self.plan.get(task, "good")
        if kind == "garbage":
            return reply("The agent did fine, I'd say seven out of ten.")
        if kind == "slow":
            return reply(GOOD, delay_s=3.0)
        if kind == "flaky" and attempt == 1:
            return fail(503)
        if kind == "no choices":  # a 200 that is not a chat completion
            return raw({"id": "x", "object": "chat.completion", "choices": []})
        if kind == "two objects":
            return reply(GOOD + '\n{"note": "more after the verdict"}')
        return reply(json.dumps({"score": round(int(task[1:]) / 100, 2), "reason": f"judged {task}"}))


def test_judge_batch_scores_marks_garbage_and_timeouts_and_retries():
    plan = {
        "t000": "good",
        "t001": "garbage",
        "t002": "slow",
        "t003": "flaky",
        "t004": "no choices",
        "t005": "two objects",
    }
    verdicts = Verdicts(plan)
    with OpenAIStub([verdicts] * 20) as stub:
        config = JudgeConfig(backend=stub.base_url, model="judge-m", timeout_s=0.5, max_retries=1, requests_in_flight=4)
        judge = JudgeBatch(config, "RUBRIC: be strict")
        out = judge(categorise(records_to_table(records(6)), drop=("tool_calls",))).to_pylist()
    by_task = {r["task_id"]: r for r in out}
    assert (by_task["t000"]["judge_score"], by_task["t000"]["judge_reason"], by_task["t000"]["judge_error"]) == (
        0.0,
        "judged t000",
        None,
    )
    assert by_task["t001"]["judge_score"] is None and by_task["t001"]["judge_error"].startswith(
        "unparseable verdict: no JSON object in the answer"
    )
    assert by_task["t002"]["judge_score"] is None and "Timeout" in by_task["t002"]["judge_error"]
    assert verdicts.attempts["t002"] == 2  # the timeout was retried once, then given up
    assert (by_task["t003"]["judge_score"], verdicts.attempts["t003"]) == (0.03, 2)  # 503, retried, judged
    assert "does not speak the OpenAI chat-completions protocol" in by_task["t004"]["judge_error"]
    assert (by_task["t005"]["judge_score"], by_task["t005"]["judge_error"]) == (0.9, None)  # the first object
    assert all(r["judge_backend"] == stub.base_url for r in out)
    body = stub.requests[0]
    assert body["model"] == "judge-m" and body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": "RUBRIC: be strict"}
    user = body["messages"][1]["content"]
    assert "Final diff:" in user and "Transcript (JSON messages):" in user and "Rule category:" in user


def test_rate_limit_paces_requests():
    with OpenAIStub([Verdicts({})] * 10) as stub:
        judge = JudgeBatch(
            JudgeConfig(backend=stub.base_url, model="m", rate_limit_per_s=10, actors=1, requests_in_flight=4), "rubric"
        )
        judge(categorise(records_to_table(records(6)), drop=("tool_calls",)))
        times = sorted(stub.request_times)
    assert len(times) == 6 and times[-1] - times[0] >= 0.45  # 6 starts at 10/s: at least 0.5 s apart end to end


def _store(tmp_path, n: int) -> str:
    run_dir = tmp_path / "run"
    writer = RolloutWriter(str(run_dir / "rollouts"))
    rows = records(n)
    for i in range(0, n, 4):  # several files, so Ray Data has several read tasks to schedule beside the actors
        writer.append(rows[i : i + 4])
    return str(run_dir)


@pytest.mark.timeout(240)
def test_pipeline_with_a_judge_actor_pool_finishes_on_two_cpus(ray_session, tmp_path):
    run_dir = _store(tmp_path, 24)
    plan = {"t005": "garbage", "t011": "slow"}
    with OpenAIStub([Verdicts(plan)] * 60) as stub:
        config = AnalyzeConfig(
            judge=JudgeConfig(backend=stub.base_url, model="m", timeout_s=0.5, max_retries=0, actors=3, batch_rows=4),
            report=True,
        )
        logged: list[str] = []
        result = analyze(run_dir, config, log=logged.append)
    rows = {r["task_id"]: r for r in pq.read_table(f"{run_dir}/analysis/judgments.parquet").to_pylist()}
    assert len(rows) == 24
    assert rows["t007"]["judge_score"] == 0.07 and rows["t007"]["judge_reason"] == "judged t007"
    assert rows["t005"]["judge_error"].startswith("unparseable verdict") and rows["t011"]["judge_error"]
    assert sorted(t for t, r in rows.items() if r["judge_error"]) == ["t005", "t011"]
    judge = result.summary["judge"]
    assert (judge["scored"], judge["errors"]) == (22, 2)
    assert any("2 of 24 rollouts could not be judged" in p and "judge_error" in p for p in logged)
    with open(f"{run_dir}/analysis/summary.json") as f:
        assert json.load(f)["judge"]["errors"] == 2


@pytest.mark.timeout(240)
def test_a_judge_that_is_down_marks_rows_and_the_run_completes(ray_session, tmp_path):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = _store(tmp_path, 8)
    config = AnalyzeConfig(
        judge=JudgeConfig(backend=f"http://127.0.0.1:{port}/v1", timeout_s=1, max_retries=0), report=False
    )
    result = analyze(run_dir, config, log=lambda msg: None)
    rows = pq.read_table(f"{run_dir}/analysis/judgments.parquet").to_pylist()
    assert len(rows) == 8 and all(r["judge_score"] is None for r in rows)
    assert all(
        r["judge_error"].startswith(f"judge http://127.0.0.1:{port}/v1 unavailable: APIConnectionError") for r in rows
    )
    assert all(r["category"] for r in rows) and result.summary["rollouts"] == 8  # the rules still ran
    assert any("8 of 8 rollouts could not be judged" in p for p in result.problems)


@pytest.mark.slow  # ~17 s: torch and the engine start inside the judge actor
@pytest.mark.timeout(400)
def test_local_checkpoint_judge_runs_the_engine(ray_session, tmp_path):
    """A tiny random checkpoint answers nonsense: every row is judged by the engine and marked unparseable."""
    import torch

    from codefleet.model import checkpoint
    from codefleet.model.config import ModelConfig
    from codefleet.model.transformer import Transformer

    torch.manual_seed(0)
    ckpt = str(tmp_path / "ckpt")
    checkpoint.save(Transformer(ModelConfig.tiny()), ckpt)
    run_dir = _store(tmp_path, 4)
    config = AnalyzeConfig(
        judge=JudgeConfig(
            backend=f"local:{ckpt}", actors=1, max_tokens=8, max_transcript_chars=300, max_diff_chars=200
        ),
        report=False,
    )
    result = analyze(run_dir, config, log=lambda msg: None)
    rows = pq.read_table(f"{run_dir}/analysis/judgments.parquet").to_pylist()
    assert len(rows) == 4 and all(r["judge_backend"] == f"local:{ckpt}" for r in rows)
    assert all(r["judge_error"] and "unavailable" not in r["judge_error"] for r in rows), rows[0]["judge_error"]
    assert result.summary["judge"]["errors"] == 4


class ClusteringJudge:
    """A stub script item that judges, names clusters and merges labels the way a model would: a failure's reason
    says which of two causes it had; batches name the edge-case cause in two wordings (the merge makes them one);
    the second request about failures is answered with prose."""

    def __init__(self):
        self.cluster_requests = self.failure_requests = 0
        self.lock = threading.Lock()

    def __call__(self, body: dict):
        system, user = body["messages"][0]["content"], body["messages"][1]["content"]
        items = re.findall(r"^(\d+)\. (.*)$", user, re.M)
        if system.startswith("You group the reasons"):
            with self.lock:
                self.cluster_requests += 1
                n = self.cluster_requests
                self.failure_requests += user.startswith("Why these rollouts failed")
                prose = user.startswith("Why these rollouts failed") and self.failure_requests == 2
            if prose:
                return reply("These failures are mostly about edge cases, I think.")
            wording = "missed edge cases" if n % 2 else "edge cases were missed"
            edge = [int(i) for i, text in items if "edge" in text]
            other = [int(i) for i, text in items if "edge" not in text]
            return reply(
                json.dumps(
                    {"clusters": [{"label": wording, "members": edge}, {"label": "broke the parser", "members": other}]}
                )
            )
        if system.startswith("You merge cluster labels"):
            edge = [int(i) for i, text in items if "edge" in text]
            return reply(
                json.dumps(
                    {
                        "clusters": [{"label": "missed edge cases", "members": edge}]
                        + [{"label": text, "members": [int(i)]} for i, text in items if "edge" not in text]
                    }
                )
            )
        task = re.search(r"Task: (\S+)", user).group(1)
        cause = "an edge case it missed" if int(task[1:]) % 2 else "it broke the parser"
        return reply(json.dumps({"score": 0.2, "reason": f"{task}: {cause}"}))


@pytest.mark.timeout(240)
def test_a_model_judge_groups_the_reasons_into_merged_clusters(ray_session, tmp_path):
    run_dir = _store(tmp_path, 40)
    judge = ClusteringJudge()
    with OpenAIStub([judge] * 200) as stub:
        config = AnalyzeConfig(
            judge=JudgeConfig(backend=stub.base_url, model="m", max_retries=0, actors=1), report=False
        )
        config.clusters.batch_rows, config.clusters.max_clusters = 8, 5
        result = analyze(run_dir, config, log=lambda msg: None)
    rows = pq.read_table(f"{run_dir}/analysis/judgments.parquet").to_pylist()
    failures = [r for r in rows if r["category"] != "solved"]
    clusters = result.summary["clusters"]
    assert clusters["source"] == "judge" and judge.cluster_requests >= 4
    assert all(
        "at most 5 clusters" in r["messages"][0]["content"]
        for r in stub.requests
        if r["messages"][0]["content"].startswith("You group")
    )  # the analysis's own settings
    by_label = {c["label"]: c for c in clusters["failures"]}
    # the two wordings merged into one cluster; the batch answered with prose kept its rows' rules clusters
    assert "edge cases were missed" not in by_label and "missed edge cases" in by_label
    ids = {r["rollout_id"]: r for r in rows}
    for c in clusters["failures"]:
        assert all(i in ids and ids[i]["category"] != "solved" for i in c["examples"])
    edge = by_label["missed edge cases"]
    assert all("edge case" in ids[i]["judge_reason"] for i in edge["examples"])
    assert all("parser" in ids[i]["judge_reason"] for i in by_label["broke the parser"]["examples"])
    by_rules = sum(c["count"] for c in clusters["failures"] if "(stop:" in c["label"])
    assert 0 < by_rules < len(failures) and "grouped by rules" in clusters["note"]
    assert sum(c["count"] for c in clusters["failures"]) == len(failures)
    assert sum(c["count"] for c in clusters["suspicious_wins"]) == result.summary["suspicious_wins"]
    assert "missed edge cases" in result.summary["overview"]
