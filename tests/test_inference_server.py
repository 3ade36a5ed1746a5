"""The OpenAI-compatible server on a real tiny checkpoint, spoken to by the real `openai` client, the agent's
OpenAI policy and raw HTTP. An untrained model writes garbage, so these assert the protocol: shapes,
finish reasons, usage, streaming, errors, batching, and the tool-call path through the response builder."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from codefleet.agent.clients import OpenAIConfig, OpenAIPolicy
from codefleet.agent.tools import tool_schemas
from codefleet.chat.codefleet_template import CALL_OPEN, END, encode_chat
from codefleet.inference.engine import Engine, Result
from codefleet.inference.openai_request import ChatRequest
from codefleet.inference.server import ServerThread, build_completion
from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer

NAME = "tiny-test"
USER = [{"role": "user", "content": "Fix the failing test in pkg/calc.py."}]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("ckpt") / NAME)
    checkpoint.save(Transformer(ModelConfig.tiny()), path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint_dir):
    engine = Engine.load(checkpoint_dir, max_batch=8, max_seq_len=2048)
    with ServerThread(engine, engine.tokenizer, model_name=NAME) as s:
        yield s
    engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def post(server, body: bytes | dict, path: str = "/chat/completions") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.base_url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_openai_client_lists_the_model_and_gets_completions_with_usage_and_logprobs(server, client):
    assert [m.id for m in client.models.list()] == [NAME]
    r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=6, temperature=0, logprobs=True)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == NAME and r.id.startswith("chatcmpl-")
    assert choice.finish_reason in ("length", "stop") and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    prompt = encode_chat(server.server.tokenizer, USER, [])
    assert r.usage.prompt_tokens == len(prompt)
    assert 1 <= r.usage.completion_tokens <= 6 and r.usage.total_tokens == len(prompt) + r.usage.completion_tokens
    assert len(choice.logprobs.content) == r.usage.completion_tokens
    assert all(t.logprob <= 0 for t in choice.logprobs.content)
    again = client.chat.completions.create(model=NAME, messages=USER, max_tokens=6, temperature=0)
    assert again.choices[0].message.content == choice.message.content  # greedy is deterministic
    # the same prompt again: the engine's prefix cache supplies all but its last token, and usage says so
    assert len(prompt) > server.server.engine.min_prefix
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1


def test_streaming_sends_the_same_turn_in_chunks(client):
    whole = client.chat.completions.create(model=NAME, messages=USER, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=USER, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text.strip() == whole.choices[0].message.content.strip()
    assert finishes == [whole.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_the_agents_openai_policy_runs_against_the_server(server):
    policy = OpenAIPolicy(OpenAIConfig(base_url=server.base_url, max_tokens=8, temperature=0, max_retries=0))
    output = policy.generate(USER, tool_schemas())
    assert output.model == NAME  # discovered from GET /v1/models
    assert 1 <= output.completion_tokens <= 8 and output.prompt_tokens > 50  # the tool schemas are in the prompt
    assert output.finish_reason in ("length", "stop", "tool_calls")


def test_concurrent_requests_share_decode_steps(server, client):
    def one(i: int):
        return client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": f"task {i}"}], max_tokens=24, temperature=0
        )

    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(one, range(6)))
    assert all(r.usage.completion_tokens >= 1 for r in results)
    assert server.server.engine.peak_batch > 1


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client):
    cases = [
        (b"{not json", 400, None, "invalid_json"),
        ({"model": NAME}, 400, "messages", "missing_required_parameter"),
        ({"model": NAME, "messages": "hi"}, 400, "messages", "invalid_type"),
        ({"model": NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]", "invalid_value"),
        ({"model": NAME, "messages": USER, "temperature": "hot"}, 400, "temperature", "invalid_type"),
        ({"model": NAME, "messages": USER, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
        ({"model": NAME, "messages": USER, "stop": 5}, 400, "stop", "invalid_type"),
        ({"model": NAME, "messages": USER, "seed": 2**64}, 400, "seed", "invalid_value"),
        ({"model": NAME, "messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
        ({"model": NAME, "messages": USER, "top_logprobs": 3}, 400, "top_logprobs", "invalid_value"),
        ({"model": NAME, "messages": USER, "logprobs": True, "top_logprobs": "3"}, 400, "top_logprobs", "invalid_type"),
        ({"model": NAME, "messages": USER, "tool_choice": "required"}, 400, "tool_choice", "invalid_value"),
        ({"model": "gpt-9", "messages": USER}, 404, "model", "model_not_found"),
        (
            {"model": NAME, "messages": [{"role": "user", "content": "word " * 5000}]},
            400,
            "messages",
            "context_length_exceeded",
        ),
    ]
    for body, status, param, code in cases:
        got_status, got = post(server, body)
        assert got_status == status, (body, got)
        error = got["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        assert (error["param"], error["code"]) == (param, code), (body, error)
    status, got = post(server, {}, path="/nothing")
    assert status == 404 and "POST /v1/chat/completions" in got["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-9", messages=USER)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "word " * 5000}])
    assert client.chat.completions.create(model=NAME, messages=USER, max_tokens=2).usage.completion_tokens >= 1


def test_nulls_count_as_absent_developer_is_system_and_a_tiny_temperature_is_greedy(server, client):
    greedy = {"model": NAME, "messages": USER, "max_tokens": 6, "temperature": 0}
    status, plain = post(server, greedy)
    assert status == 200
    status, nulls = post(server, {**greedy, "n": None, "stream": None, "seed": None, "top_logprobs": None})
    assert status == 200 and nulls["choices"][0]["message"] == plain["choices"][0]["message"]
    status, tiny = post(server, {**greedy, "temperature": 1e-40})  # float32 logits / 1e-40 would be NaN
    assert status == 200 and tiny["choices"][0]["message"] == plain["choices"][0]["message"]
    system = [{"role": "system", "content": "Be brief."}, *USER]
    developer = [{"role": "developer", "content": "Be brief."}, *USER]
    as_system = client.chat.completions.create(model=NAME, messages=system, max_tokens=6, temperature=0)
    as_developer = client.chat.completions.create(model=NAME, messages=developer, max_tokens=6, temperature=0)
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens


def test_a_stream_with_logprobs_carries_the_responses_logprobs(client):
    whole = client.chat.completions.create(model=NAME, messages=USER, max_tokens=10, temperature=0, logprobs=True)
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=USER, max_tokens=10, temperature=0, logprobs=True, stream=True
        )
    )
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in whole.choices[0].logprobs.content]
    assert [t.logprob for t in streamed] == pytest.approx(
        [t.logprob for t in whole.choices[0].logprobs.content], abs=1e-5
    )


def _disconnect_midway(server, body: dict) -> int:
    """Send `body` over a raw socket, hang up once the engine runs it; the engine steps it took afterwards."""
    engine = server.server.engine
    data = json.dumps(body).encode()
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(data) + data
        )
        deadline = time.monotonic() + 30
        while engine.n_running == 0:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.005)
        steps = engine.steps
    while engine.n_running:
        assert time.monotonic() < deadline + 60, "the request still runs a minute after its client left"
        time.sleep(0.005)
    return engine.steps - steps


@pytest.mark.parametrize(
    "extra",
    [{}, {"stream": True, "stop": ["never printed"]}, {"stream": True, "tools": tool_schemas()}],
    ids=["plain", "stream_stop", "tools"],
)
def test_a_client_that_disconnects_cancels_its_engine_request(server, extra):
    # nothing is sent before the end in these modes, so only the closed connection can stop the request
    body = {"model": NAME, "messages": USER, "max_tokens": 900, "temperature": 0, **extra}
    assert _disconnect_midway(server, body) < 100  # of up to 900 steps


def test_a_stream_that_fails_partway_ends_with_an_error_chunk_and_done(server):
    tokenizer, calls = server.server.tokenizer, []

    class BreaksAfterTwoTokens:  # the real tokenizer, until it fails on the third token the stream sends
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def token_bytes(self, token):
            calls.append(token)
            if len(calls) > 2:
                raise RuntimeError("the tokenizer broke")
            return tokenizer.token_bytes(token)

    engine = server.server.engine
    body = {"model": NAME, "messages": USER, "max_tokens": 900, "temperature": 0, "stream": True}
    with ServerThread(engine, BreaksAfterTwoTokens(), model_name=NAME) as broken:
        request = urllib.request.Request(
            broken.base_url + "/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            events = [line[len(b"data: ") :] for line in r.read().splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "the tokenizer broke" in error["message"]
    deadline = time.monotonic() + 30
    while engine.n_running:  # the engine request was cancelled, not left to run 900 tokens
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_response_builder_turns_parsed_tool_calls_into_openai_tool_calls(server):
    tokenizer = server.server.tokenizer
    text = (
        'Reading both.<|tool_call|>{"name": "read_file", "arguments": {"path": "a.py"}}<|/tool_call|>'
        '<|tool_call|>{"name": "run", "arguments": {"command": "pytest -q"}}<|/tool_call|>'
        '<|tool_call|>{"name": oops}<|/tool_call|>'
    )
    ids = tokenizer.encode(text, allow_special=True)
    end = tokenizer.special_id(END)
    result = Result(
        [1, 2, 3], ids + [end], [-0.5] * (len(ids) + 1), [0] * (len(ids) + 1), [], [], "stop", text, stop=end
    )
    request = ChatRequest([1, 2, 3], None, tool_schemas(), False, False, False)
    body = build_completion(result, request, tokenizer, NAME, "chatcmpl-abc12345", 0)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["read_file", "run"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"command": "pytest -q"}
    assert len({c["id"] for c in calls}) == 2 and all(c["type"] == "function" for c in calls)
    assert choice["message"]["content"] == "Reading both."
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": len(ids) + 1,
        "total_tokens": len(ids) + 4,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    cut = build_completion(
        Result([1], ids, [0.0] * len(ids), [0] * len(ids), [], [], "length", text),
        request,
        tokenizer,
        NAME,
        "chatcmpl-x",
        0,
    )
    assert cut["choices"][0]["finish_reason"] == "length"  # ran out of tokens: the calls may be incomplete


def test_the_serve_command_runs_a_server_process(checkpoint_dir, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "codefleet.inference.serve_cli",
            "--checkpoint",
            checkpoint_dir,
            "--port",
            str(port),
            "--max-seq-len",
            "512",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        deadline = time.monotonic() + 45
        while True:
            try:
                models = [m.id for m in client.models.list()]
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                time.sleep(0.2)
        assert models == [NAME]  # the checkpoint directory's name
        r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=3)
        assert r.usage.completion_tokens >= 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    missing = subprocess.run(
        [sys.executable, "-m", "codefleet.inference.serve_cli", "--checkpoint", str(tmp_path / "nope"), "--port", "1"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    for flag, value in (("--max-batch", "0"), ("--max-seq-len", "-5")):
        bad = subprocess.run(
            [
                sys.executable,
                "-m",
                "codefleet.inference.serve_cli",
                "--checkpoint",
                checkpoint_dir,
                "--port",
                "1",
                flag,
                value,
            ],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 2 and f"{flag} must be at least" in bad.stderr and "Traceback" not in bad.stderr


def test_a_bare_prompt_policy_is_served_the_conversation_it_was_trained_on(checkpoint_dir):
    """A `codefleet train` policy (model.prompt=bare) never saw a system prompt or tool schemas: served so, a
    client sending the full prompt (as `codefleet agent run` does) gets the prompt the policy was trained on."""
    system = [{"role": "system", "content": "You are a fast, careful coding agent."}]
    engine = Engine.load(checkpoint_dir, max_batch=4, max_seq_len=2048)
    try:
        with (
            ServerThread(engine, engine.tokenizer, model_name=NAME, prompt="bare") as bare,
            ServerThread(engine, engine.tokenizer, model_name=NAME) as full,
        ):
            body = {"messages": system + USER, "tools": tool_schemas(), "max_tokens": 2, "temperature": 0}
            status, served = post(bare, body)
            assert status == 200
            assert served["usage"]["prompt_tokens"] == len(encode_chat(engine.tokenizer, USER, None))
            status, as_sent = post(full, body)
            assert status == 200
            assert as_sent["usage"]["prompt_tokens"] == len(
                encode_chat(engine.tokenizer, system + USER, tool_schemas())
            )
            status, error = post(bare, {"messages": system, "max_tokens": 2})
            assert status == 400 and "send the task as a user message" in error["error"]["message"]
    finally:
        engine.close()
    with pytest.raises(ValueError, match="is not a prompt style"):
        ServerThread(engine, engine.tokenizer, prompt="short")


def test_the_serve_command_serves_a_checkpoint_in_the_prompt_style_it_says(checkpoint_dir, tmp_path):
    shutil.copytree(checkpoint_dir, tmp_path / "rl")
    checkpoint.write_usage(str(tmp_path / "rl"), prompt="bare")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "codefleet.inference.serve_cli",
            "--checkpoint",
            str(tmp_path / "rl"),
            "--port",
            "0",
            "--max-seq-len",
            "512",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        banner = proc.stdout.readline()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert "codefleet serve: rl on" in banner and "bare prompt" in banner, banner


# -- OpenAI's promises, as a new user of the official client tries them ---------------------------------------

# Schemas that bound a call (a closed object, an enum): a random model's call ends within a few dozen tokens,
# where a free string could run to max_tokens.
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather where the user is.",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


def test_tool_choice_required_or_a_named_function_makes_even_a_random_model_call(client):
    ask = {"model": NAME, "messages": USER, "tools": [WEATHER, CLOCK], "max_tokens": 160}
    for seed in range(3):
        required = client.chat.completions.create(**ask, seed=seed, tool_choice="required").choices[0]
        assert required.message.tool_calls and required.message.content is None, required  # calls, no text
        assert {c.function.name for c in required.message.tool_calls} <= {"get_weather", "get_time"}
        named = client.chat.completions.create(
            **ask, seed=seed, tool_choice={"type": "function", "function": {"name": "get_weather"}}
        )
        choice = named.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        [call] = choice.message.tool_calls  # one call, of that function
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) in ({"unit": "celsius"}, {"unit": "fahrenheit"})
    greedy = client.chat.completions.create(
        **ask, temperature=0, tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    [call] = greedy.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_time", {})
    chunks = list(client.chat.completions.create(**ask, seed=5, tool_choice="required", stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert streamed and all(tc.function.name in ("get_weather", "get_time") for tc in streamed)
    assert not "".join(d.content or "" for d in deltas)


@pytest.fixture(scope="module")
def eager_caller(checkpoint_dir):
    """A client of the tiny model made to want a tool call at every step: the call marker's logit dwarfs the rest."""
    engine = Engine.load(checkpoint_dir, max_batch=2, max_seq_len=512)
    model = engine.model
    assert not model.config.tie_embeddings
    with torch.no_grad():
        model.embed.weight[:, 0] = 1e3  # every hidden state points along dimension 0 ...
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[engine.tokenizer.call_open_id, 0] = 10.0  # ... where only the call marker scores
    with ServerThread(engine, engine.tokenizer, model_name=NAME) as s:
        yield openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=60)
    engine.close()


def test_tool_choice_none_keeps_a_model_that_wants_to_call_from_opening_a_call(eager_caller):
    ask = {"model": NAME, "messages": USER, "max_tokens": 8, "temperature": 0, "logprobs": True}
    wants = eager_caller.chat.completions.create(**ask, tools=[WEATHER, CLOCK]).choices[0]  # "auto", unconstrained
    assert wants.logprobs.content[0].token == CALL_OPEN
    for tools in ([WEATHER, CLOCK], None):
        kept = eager_caller.chat.completions.create(**ask, tool_choice="none", **({"tools": tools} if tools else {}))
        message = kept.choices[0].message
        assert not message.tool_calls and "<|" not in message.content
        assert CALL_OPEN not in [t.token for t in kept.choices[0].logprobs.content]


def test_logprobs_with_top_logprobs_return_the_likeliest_tokens_in_openais_shape(client):
    ask = {"model": NAME, "messages": USER, "max_tokens": 6, "temperature": 0, "logprobs": True}
    whole = client.chat.completions.create(**ask, top_logprobs=5)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for t in content:
        top = t.top_logprobs
        assert len(top) == 5 and [a.logprob for a in top] == sorted((a.logprob for a in top), reverse=True)
        assert top[0].token == t.token and top[0].logprob == pytest.approx(t.logprob, abs=1e-5)  # greedy: the likeliest
        assert sum(math.exp(a.logprob) for a in top) <= 1 + 1e-5
        assert all(bytes(a.bytes).decode("utf-8", errors="replace") == a.token for a in top)
    chunks = list(client.chat.completions.create(**ask, top_logprobs=5, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [[a.token for a in t.top_logprobs] for t in streamed] == [[a.token for a in t.top_logprobs] for t in content]
    assert all(
        t.top_logprobs == [] for t in client.chat.completions.create(**ask, top_logprobs=0).choices[0].logprobs.content
    )
    assert len(client.chat.completions.create(**ask, top_logprobs=20).choices[0].logprobs.content[0].top_logprobs) == 20
    for bad in ({"logprobs": True, "top_logprobs": 21}, {"top_logprobs": 2}, {"logprobs": False, "top_logprobs": 0}):
        with pytest.raises(openai.BadRequestError, match="top_logprobs") as e:
            client.chat.completions.create(model=NAME, messages=USER, max_tokens=2, **bad)
        assert (e.value.param, e.value.type) == ("top_logprobs", "invalid_request_error")


def test_a_prompt_of_megabytes_is_refused_at_once_and_does_not_stall_other_clients(server, client):
    """Its characters alone prove it longer than the context, so it is refused before it is tokenized, and the
    body is parsed off the event loop: until 2026-12-06 a 16 MB request held every other request for 10-14 s."""
    huge = json.dumps({"model": NAME, "messages": [{"role": "user", "content": "word " * 3_300_000}]}).encode()
    assert len(huge) > 16_000_000

    def send_huge() -> list[tuple[int, dict, float]]:
        answers = []
        for _ in range(3):
            start = time.monotonic()
            status, body = post(server, huge)
            answers.append((status, body, time.monotonic() - start))
        return answers

    waits_s: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        huge_answers = pool.submit(send_huge)
        while not huge_answers.done() or not waits_s:
            start = time.monotonic()
            assert client.chat.completions.create(model=NAME, messages=USER, max_tokens=1).usage.completion_tokens == 1
            waits_s.append(time.monotonic() - start)
    for status, body, took_s in huge_answers.result():
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert "context is 2048 tokens" in body["error"]["message"] and took_s < 5
    assert max(waits_s) < 2, waits_s


def test_max_tokens_over_the_room_the_prompt_leaves_is_refused_as_openai_does(checkpoint_dir):
    engine = Engine.load(checkpoint_dir, max_batch=2, max_seq_len=64)
    try:
        with ServerThread(engine, engine.tokenizer, model_name=NAME) as small:
            client = openai.OpenAI(base_url=small.base_url, api_key="unused", max_retries=0, timeout=60)
            room = 64 - len(encode_chat(engine.tokenizer, USER, []))
            assert room > 8
            fits = client.chat.completions.create(model=NAME, messages=USER, max_tokens=room, temperature=0)
            assert 1 <= fits.usage.completion_tokens <= room
            for field in ("max_tokens", "max_completion_tokens"):
                with pytest.raises(openai.BadRequestError, match=f"leave {room} of this model's context of 64") as e:
                    client.chat.completions.create(model=NAME, messages=USER, **{field: room + 1})
                assert (e.value.param, e.value.code) == (field, "context_length_exceeded")
            with pytest.raises(openai.BadRequestError, match="context"):  # a stream is refused before it starts
                client.chat.completions.create(model=NAME, messages=USER, max_tokens=room + 1, stream=True)
            unsent = client.chat.completions.create(model=NAME, messages=USER)  # not sent: the room left
            assert 1 <= unsent.usage.completion_tokens <= room
            with pytest.raises(openai.BadRequestError, match="context") as e:  # the prompt alone is too long
                client.chat.completions.create(
                    model=NAME, messages=[{"role": "user", "content": "word " * 80}], max_tokens=1
                )
            assert (e.value.param, e.value.code) == ("messages", "context_length_exceeded")
    finally:
        engine.close()


def test_serve_on_port_0_prints_the_real_port_and_a_port_in_use_is_one_line_and_exit_2(checkpoint_dir):
    command = [
        sys.executable,
        "-m",
        "codefleet.inference.serve_cli",
        "--checkpoint",
        checkpoint_dir,
        "--max-seq-len",
        "256",
        "--threads",
        "1",
    ]
    proc = subprocess.Popen(
        [*command, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        banner = proc.stdout.readline()
        found = re.search(r"on http://127\.0\.0\.1:(\d+)/v1", banner)
        assert found and int(found[1]) != 0, banner
        port = int(found[1])
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        assert [m.id for m in client.models.list()] == [NAME]  # the line came once it listened, on that port
        taken = subprocess.run(
            [*command, "--port", str(port)], check=False, capture_output=True, text=True, timeout=120
        )
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert taken.returncode == 2 and "codefleet serve:" not in taken.stdout, taken.stdout  # no line saying it serves
    errors = [line for line in taken.stderr.splitlines() if "codefleet serve:" in line]
    assert len(errors) == 1 and f"cannot listen on 127.0.0.1:{port}" in errors[0] and "in use" in errors[0], (
        taken.stderr
    )
    assert "Traceback" not in taken.stderr


def test_a_body_nested_too_deep_or_with_a_huge_integer_is_a_400_not_a_500(server, client):
    """A hostile body (100,000 nested `[`, an integer of 5,000 digits) is the client's mistake, answered as OpenAI
    answers one: a 400 with an invalid_request_error the real `openai` client raises as BadRequestError."""
    hostile = [
        b"[" * 100_000,
        b'{"model": "x", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
        b'{"a": ' * 100_000 + b"1" + b"}" * 100_000,
        b'{"model": "' + NAME.encode() + b'", "messages": [], "max_tokens": ' + b"9" * 5000 + b"}",
    ]
    for body in hostile:
        status, got = post(server, body)
        assert status == 400, got
        assert got["error"]["type"] == "invalid_request_error" and got["error"]["code"] == "invalid_json"
        assert set(got["error"]) == {"message", "type", "param", "code"} and got["error"]["message"]
        with pytest.raises(openai.BadRequestError, match="too deeply|not valid JSON") as e:
            client.post(
                "/chat/completions",
                cast_to=object,
                content=body,
                options={"headers": {"Content-Type": "application/json"}},
            )
        assert e.value.status_code == 400 and e.value.code == "invalid_json"
    assert client.chat.completions.create(model=NAME, messages=USER, max_tokens=2).usage.completion_tokens >= 1
