"""Serving a Hugging Face checkpoint: the server answers in the checkpoint's own chat template and tool-call
format (a tiny random Qwen3-MoE built locally by `bench.tiny_hf`), spoken to by the official `openai` client
and run as `codefleet serve`. The model is random, so these assert the protocol and the format."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import openai
import pytest

from codefleet.agent.tools import tool_schemas
from codefleet.chat import formats
from codefleet.inference.engine import Engine, Result
from codefleet.inference.openai_request import ChatRequest
from codefleet.inference.server import ServerThread, build_completion

pytest.importorskip("transformers")
NAME = "tiny-qwen3-moe"
USER = [{"role": "user", "content": "Fix the failing test in pkg/calc.py."}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["unit"],
            "properties": {"unit": {"type": "string", "enum": ["celsius", "kelvin"]}},
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> str:
    from codefleet.bench.tiny_hf import make_tiny_hf

    return make_tiny_hf(str(tmp_path_factory.mktemp("hf") / NAME))


@pytest.fixture(scope="module")
def served(hf_dir):
    engine = Engine.load(hf_dir, max_batch=4, max_seq_len=1024)
    with ServerThread(engine, engine.tokenizer, model_name=NAME) as server:
        yield server, engine
    engine.close()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].base_url, api_key="unused", max_retries=0, timeout=60)


def test_requests_are_rendered_with_the_checkpoints_own_template(served, client):
    _, engine = served
    tok = engine.tokenizer
    fmt = formats.of(tok)
    assert fmt.name == "template" and fmt.tool_calls.name == "hermes"
    r = client.chat.completions.create(model=NAME, messages=USER, max_tokens=4, seed=0)
    assert r.usage.prompt_tokens == len(fmt.encode_chat(tok, USER))
    assert r.choices[0].finish_reason in ("stop", "length")
    with_tools = client.chat.completions.create(model=NAME, messages=USER, tools=tool_schemas(), max_tokens=2)
    ids = fmt.encode_chat(tok, USER, tool_schemas())
    assert with_tools.usage.prompt_tokens == len(ids)
    assert tok.decode(ids).startswith("<|im_start|>system\n# Tools") and "<tools>" in tok.decode(ids)
    streamed = list(client.chat.completions.create(model=NAME, messages=USER, max_tokens=4, seed=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == r.choices[0].message.content


def test_tool_choice_required_and_named_answer_in_the_checkpoints_call_format(client):
    ask = {"model": NAME, "messages": USER, "tools": [WEATHER, CLOCK], "max_tokens": 160}
    for seed in range(2):
        required = client.chat.completions.create(**ask, seed=seed, tool_choice="required").choices[0]
        assert required.message.tool_calls and required.message.content is None, required
        assert {c.function.name for c in required.message.tool_calls} <= {"get_weather", "get_time"}
        named = client.chat.completions.create(
            **ask, seed=seed, tool_choice={"type": "function", "function": {"name": "get_weather"}}
        )
        [call] = named.choices[0].message.tool_calls
        assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
        assert json.loads(call.function.arguments) in ({"unit": "celsius"}, {"unit": "kelvin"})
    none = client.chat.completions.create(**{**ask, "max_tokens": 8}, seed=1, tool_choice="none").choices[0]
    assert not none.message.tool_calls
    chunks = list(client.chat.completions.create(**ask, seed=3, tool_choice="required", stream=True))
    streamed = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert streamed and all(tc.function.name in ("get_weather", "get_time") for tc in streamed)


def test_hermes_calls_in_a_completion_become_openai_tool_calls(served):
    tok = served[1].tokenizer
    text = (
        'Reading.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>\n'
        '<tool_call>\n{"name": oops}\n</tool_call>'
    )
    ids = tok.encode(text, allow_special=True)
    end = tok.special_id("<|im_end|>")
    result = Result([1], ids + [end], [0.0] * (len(ids) + 1), [0] * (len(ids) + 1), [], [], "stop", text, stop=end)
    body = build_completion(
        result, ChatRequest([1], None, tool_schemas(), False, False, False), tok, NAME, "chatcmpl-abc12345", 0
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Reading."
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "read_file" and json.loads(call["function"]["arguments"]) == {"path": "a.py"}


def test_codefleet_serve_serves_a_hugging_face_directory(hf_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "codefleet.inference.serve_cli",
            "--checkpoint",
            hf_dir,
            "--port",
            str(port),
            "--max-seq-len",
            "512",
            "--threads",
            "1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=30)
        deadline = time.monotonic() + 60
        while True:
            try:
                assert [m.id for m in client.models.list()] == [NAME]
                break
            except openai.APIConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()
                time.sleep(0.2)
        # A random model's call takes 26-38 tokens and "required" allows more than one: room for a whole one.
        r = client.chat.completions.create(
            model=NAME, messages=USER, tools=[CLOCK], tool_choice="required", max_tokens=160, seed=0
        )
        calls = r.choices[0].message.tool_calls
        assert calls and {c.function.name for c in calls} == {"get_time"}, r
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_a_checkpoint_without_a_chat_template_is_refused_with_what_to_do(hf_dir, tmp_path):
    import shutil

    bare = str(tmp_path / "no-template")
    shutil.copytree(hf_dir, bare)
    config = json.load(open(os.path.join(bare, "tokenizer_config.json")))
    del config["chat_template"]
    json.dump(config, open(os.path.join(bare, "tokenizer_config.json"), "w"))
    out = subprocess.run(
        [sys.executable, "-m", "codefleet.inference.serve_cli", "--checkpoint", bare, "--port", "0"],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert 'tokenizer_config.json has no "chat_template"' in out.stderr and "chat_template.jinja" in out.stderr


def test_the_local_policy_keeps_the_exact_tokens_across_turns_of_a_hugging_face_model(served):
    from codefleet.agent.clients.local_engine import LocalEnginePolicy

    _, engine = served
    tok = engine.tokenizer
    fmt = formats.of(tok)
    end = fmt.stop_ids(tok)[0]
    episode = LocalEnginePolicy(engine=engine, max_tokens=12, seed=0).for_episode()
    messages = [{"role": "system", "content": "You are a coding agent."}, *USER]
    first = episode.generate(messages, [])
    n_prompt = len(fmt.encode_chat(tok, messages, []))
    after_first = list(episode.tokens.ids)
    assert after_first[:n_prompt] == fmt.encode_chat(tok, messages, [])
    assert after_first[n_prompt : n_prompt + len(first.token_ids)] == first.token_ids and after_first[-1] == end
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "go on <|im_end|>"}]
    second = episode.generate(messages, [])
    ids = episode.tokens.ids
    assert ids[: len(after_first)] == after_first  # turn 2's prompt extends exactly what turn 1 sampled
    added = ids[len(after_first) : second.prompt_tokens]  # the engine's turn-2 prompt is the sequence up to here
    assert ids[second.prompt_tokens : second.prompt_tokens + len(second.token_ids)] == second.token_ids
    assert tok.decode(added) == "\n<|im_start|>user\ngo on <|im_end|><|im_end|>\n<|im_start|>assistant\n"
    assert added.count(end) == 1  # the user's "<|im_end|>" is plain text
    assert episode.tokens.mask.count(1) == len(first.token_ids) + len(second.token_ids)
