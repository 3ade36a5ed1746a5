"""The judge: a score in [0, 1] and a reason for every rollout, by backend.

    JudgeConfig(backend="rules")                         # offline default: the rules' own verdict
    JudgeConfig(backend="http://127.0.0.1:8000/v1", model="m")   # any OpenAI-compatible endpoint
    JudgeConfig(backend="local:runs/ckpt")               # a checkpoint on the project's engine

The model backends send the rubric (rubric.md, or `rubric_path`) as the system
message and one rollout per request (task, outcome, rule findings, the diff
and the transcript, each cut to a character budget keeping head and tail),
and expect a JSON object `{"score": float in [0, 1], "reason": str}` back.

`JudgeBatch` is the callable class Ray Data runs over an actor pool
(`map_batches(JudgeBatch, concurrency=(1, actors), num_cpus=actor_num_cpus)`):
each actor keeps one client (or one engine) and sends up to
`requests_in_flight` requests at once, paced so that all actors together stay
under `rate_limit_per_s`. Timeouts and retries (with backoff, honouring
Retry-After) are the `openai` client's. A failure never raises: the actor
could not start (endpoint down, checkpoint unreadable), a request failed after
its retries, or the answer was not a verdict — the row gets `judge_error`
(why) and a null score, and the pipeline goes on.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import resources

import openai
import pyarrow as pa

from codefleet.analysis.answers import first_json_object

JUDGE_FIELDS = [
    pa.field("judge_backend", pa.string()),
    pa.field("judge_score", pa.float64()),
    pa.field("judge_reason", pa.string()),
    pa.field("judge_error", pa.string()),
]
JUDGE_COLUMNS = [f.name for f in JUDGE_FIELDS]
# what the model judges read from a row (store columns + rule columns)
PROMPT_COLUMNS = [
    "task_id",
    "family",
    "stop_reason",
    "checks_passed",
    "checks_total",
    "turns",
    "n_tool_calls",
    "wall_s",
    "category",
    "findings",
    "diff",
    "transcript",
]


@dataclass
class JudgeConfig:
    backend: str = "rules"  # "rules" | "local:CHECKPOINT_DIR" | an OpenAI-compatible base URL (http[s]://…/v1)
    model: str = ""  # model name for a URL backend; "": the first model the endpoint lists
    rubric_path: str = ""  # "": the packaged rubric (codefleet/analysis/rubric.md)
    timeout_s: float = 60.0  # per request
    max_retries: int = 2  # per request, on connection errors, timeouts, 429 and 5xx
    rate_limit_per_s: float = 0.0  # requests per second over all actors; 0: no limit
    requests_in_flight: int = 4  # per actor
    actors: int = 2  # most judge actors at once (the pool starts at 1)
    actor_num_cpus: float = 0.25  # small, so the actors never starve Ray Data's read tasks (ray#44687)
    batch_rows: int = 16  # rollouts per map_batches call
    max_transcript_chars: int = 12_000
    max_diff_chars: int = 4_000
    max_tokens: int = 256  # of the verdict
    api_key_env: str = "OPENAI_API_KEY"  # environment variable holding the key for a hosted API

    @property
    def kind(self) -> str:
        if self.backend == "rules":
            return "rules"
        if self.backend.startswith("local:"):
            return "local"
        if self.backend.startswith(("http://", "https://")):
            return "url"
        raise ValueError(
            f"unknown judge {self.backend!r}; use rules, local:CHECKPOINT_DIR or an "
            "OpenAI-compatible URL such as http://127.0.0.1:8000/v1"
        )

    def rubric(self) -> str:
        if self.rubric_path:
            with open(self.rubric_path, encoding="utf-8") as f:
                return f.read()
        return resources.files("codefleet.analysis").joinpath("rubric.md").read_text(encoding="utf-8")


def rules_verdict(batch: pa.Table, counter=None) -> pa.Table:
    """The `rules` backend: the rule score and reason as the judgment (a map_batches function); `counter`: an actor
    told how many rows were judged (the progress bar)."""
    n = batch.num_rows
    if counter is not None:
        counter.add.remote(n)
    return (
        batch.append_column(JUDGE_FIELDS[0], pa.array(["rules"] * n, pa.string()))
        .append_column(JUDGE_FIELDS[1], batch.column("rule_score"))
        .append_column(JUDGE_FIELDS[2], batch.column("rule_reason"))
        .append_column(JUDGE_FIELDS[3], pa.nulls(n, pa.string()))
    )


def _cut(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def judge_messages(row: dict, rubric: str, config: JudgeConfig) -> list[dict]:
    """The chat request for one rollout."""
    findings = "; ".join(row.get("findings") or []) or "none"
    body = (
        f"Task: {row.get('task_id')} (family {row.get('family') or '?'})\n"
        f"Outcome: stop reason {row.get('stop_reason')}, hidden checks {row.get('checks_passed')}/"
        f"{row.get('checks_total')} passed, {row.get('turns')} turns, {row.get('n_tool_calls')} tool calls, "
        f"{(row.get('wall_s') or 0):.1f} s\n"
        f"Rule category: {row.get('category')}; rule findings: {findings}\n\n"
        f"Final diff:\n{_cut(row.get('diff') or '(empty)', config.max_diff_chars)}\n\n"
        f"Transcript (JSON messages):\n{_cut(row.get('transcript') or '[]', config.max_transcript_chars)}\n\n"
        'Answer with one JSON object: {"score": <number from 0 to 1>, "reason": "<one or two sentences>"}'
    )
    return [{"role": "system", "content": rubric}, {"role": "user", "content": body}]


def parse_verdict(text: str) -> tuple[float, str]:
    """(score, reason) from a judge's answer; ValueError saying what was wrong with it."""
    verdict = first_json_object(text)
    score = verdict.get("score") if isinstance(verdict, dict) else None
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not 0.0 <= score <= 1.0:
        raise ValueError(f"answer has no score between 0 and 1: {text[:120]!r}")
    reason = verdict.get("reason")
    if not isinstance(reason, str) or not reason.strip():
        raise ValueError(f"answer has no reason: {text[:120]!r}")
    return float(score), reason.strip()


class _Pacer:
    """At most `rate_per_s` starts per second (0: unlimited), shared by the actor's threads."""

    def __init__(self, rate_per_s: float):
        self.interval_s = 1.0 / rate_per_s if rate_per_s > 0 else 0.0
        self.next_s = 0.0
        self.lock = threading.Lock()

    def wait(self) -> None:
        if not self.interval_s:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_s)
            self.next_s = start + self.interval_s
        time.sleep(max(0.0, start - now))


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:300]


class JudgeBatch:
    """One judge actor (see the module docstring). Never raises for a judge failure."""

    def __init__(self, config: JudgeConfig, rubric: str, counter=None):
        self.config = config
        self.rubric = rubric
        self.counter = counter  # an actor told how many rows were judged (the progress bar), or None
        self.init_error: str | None = None
        self.complete = None
        self.pacer = _Pacer(config.rate_limit_per_s / max(1, config.actors))
        self.pool = ThreadPoolExecutor(max(1, config.requests_in_flight))
        try:
            self.complete = self._local() if config.kind == "local" else self._openai()
        except Exception as e:  # endpoint down, checkpoint unreadable: every row says so
            self.init_error = f"judge {config.backend} unavailable: {_error(e)}"

    @classmethod
    def configured(cls, config: JudgeConfig, rubric: str, counter=None) -> type[JudgeBatch]:
        """This class with `config`, `rubric` and `counter` built in, for Ray Data's actor pool: they travel with
        the class's definition instead of as constructor arguments in the object store, where an actor restarted
        after its node died might not find them any more."""

        class ConfiguredJudgeBatch(cls):
            def __init__(self):
                super().__init__(config, rubric, counter)

        return ConfiguredJudgeBatch

    def _openai(self):
        client = openai.OpenAI(
            base_url=self.config.backend,
            api_key=os.environ.get(self.config.api_key_env) or "none",
            timeout=self.config.timeout_s,
            max_retries=self.config.max_retries,
        )
        if not (model := self.config.model):
            listed = getattr(client.models.list(), "data", None) or []
            if not listed:
                raise ValueError(f"{self.config.backend} lists no models; name the judge's model with --judge-model")
            model = listed[0].id

        def complete(messages: list[dict]) -> str:
            response = client.chat.completions.create(
                model=model, messages=messages, temperature=0.0, max_tokens=self.config.max_tokens
            )
            choices = getattr(response, "choices", None) or []
            message = getattr(choices[0], "message", None) if choices else None
            if message is None:
                raise ValueError(
                    "the judge's answer has no choices[0].message: the endpoint does not speak the "
                    "OpenAI chat-completions protocol"
                )
            return message.content or ""

        return complete

    def _local(self):
        # here, not at the top: every Ray Data task that runs the rules or the aggregates imports this module, and
        # the engine brings torch (seconds of CPU per worker)
        from codefleet.agent.clients.local_engine import LocalEnginePolicy

        policy = LocalEnginePolicy(
            self.config.backend.removeprefix("local:"), max_tokens=self.config.max_tokens, temperature=0.0
        )
        return lambda messages: policy.generate(messages, []).text

    def _judge_one(self, row: dict) -> tuple[float | None, str | None, str | None]:
        if self.init_error:
            return None, None, self.init_error
        try:
            self.pacer.wait()
            answer = self.complete(judge_messages(row, self.rubric, self.config))
        except Exception as e:  # after the client's own retries
            return None, None, _error(e)
        try:
            score, reason = parse_verdict(answer)
        except ValueError as e:
            return None, None, f"unparseable verdict: {e}"
        return score, reason, None

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.select([c for c in PROMPT_COLUMNS if c in batch.column_names]).to_pylist()
        verdicts = list(self.pool.map(self._judge_one, rows))
        n = batch.num_rows
        columns = [
            [self.config.backend] * n,
            [v[0] for v in verdicts],
            [v[1] for v in verdicts],
            [v[2] for v in verdicts],
        ]
        for field, values in zip(JUDGE_FIELDS, columns):
            batch = batch.append_column(field, pa.array(values, field.type))
        if self.counter is not None:
            self.counter.add.remote(n)
        return batch
