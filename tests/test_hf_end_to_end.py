"""A tiny random Qwen3-MoE Hugging Face directory through every command: `codefleet train model.init=DIR` (SFT
and a few RL steps), `serve` (the official openai client), `agent run`, `eval`, `analyze` and `export`; every
checkpoint the run writes is itself a Hugging Face directory that transformers loads with equal logits."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM

from codefleet.bench.tiny_hf import make_tiny_hf
from codefleet.chat.tokenizer import is_hf_dir
from codefleet.model import checkpoint
from codefleet.tasks.generate import generate_tasks

TINY = [
    "tasks.n_train=3",
    "tasks.n_eval=1",
    "tasks.families=[config]",
    "sft.epochs=1",
    "sft.batch_size=3",
    "rl.steps=2",
    "controller.group_size=2",
    "controller.batch_groups=1",
    "controller.rollout_slots=2",
    "rl.max_tokens=24",
    "rl.max_turns=2",
    "eval.max_tokens=24",
    "eval.attempts=1",
    "cluster.num_cpus=4",
    "model.prompt=full",
    "model.max_seq_len=4096",
]
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", "codefleet.cli", *args], env=ENV, capture_output=True, text=True, timeout=timeout
    )
    assert out.returncode == 0, (args, out.stderr[-3000:])
    return out


def _equal_to_transformers(path: str) -> None:
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    tokens = torch.randint(0, 4000, (1, 24))
    with torch.no_grad():
        diff = (reference(tokens).logits - checkpoint.load(path).eval()(tokens).logits_BTV).abs().max()
    assert diff <= 1e-4, (path, float(diff))


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_a_qwen3_moe_directory_goes_through_train_serve_agent_eval_analyze_and_export(tmp_path):
    start = make_tiny_hf(str(tmp_path / "qwen3-moe"), arch="qwen3_moe")
    run = str(tmp_path / "run")
    _cli("train", "--out", run, "--no-progress", f"model.init={start}", *TINY, timeout=1200)
    sft, rl = os.path.join(run, "checkpoints", "sft"), os.path.join(run, "checkpoints", "rl-step-000002")
    for ckpt in (sft, rl):
        assert is_hf_dir(ckpt) and os.path.isfile(os.path.join(ckpt, "tokenizer_config.json")), ckpt
        _equal_to_transformers(ckpt)
    assert checkpoint.tensor_hash(rl) != checkpoint.tensor_hash(start)  # SFT and RL moved the weights
    results = json.load(open(os.path.join(run, "results.json")))["results"]
    assert set(results) == {"sft", "rl"}

    server = subprocess.Popen(
        [sys.executable, "-m", "codefleet.cli", "serve", "--checkpoint", rl, "--port", "0"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = None
        deadline = time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = server.stdout.readline()
            assert line or server.poll() is None, "the server exited"
            found = re.search(r"(http://[\d.]+:\d+/v1)", line)
            url = found.group(1) if found else None
        assert url, "the server never said where it listens"
        client = OpenAI(base_url=url, api_key="none")
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "submit",
                    "description": "Finish.",
                    "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
                },
            }
        ]
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            max_tokens=64,
            tools=tools,
            messages=[{"role": "user", "content": "Say hi."}],
            tool_choice="required",
        )
        call = reply.choices[0].message.tool_calls[0]
        assert call.function.name == "submit"  # the checkpoint's own format, constrained to a call
        repo = tmp_path / "repo"
        repo.mkdir()
        (repo / "a.txt").write_text("hello\n")
        agent = _cli(
            "agent",
            "run",
            "--repo",
            str(repo),
            "--task",
            "Read a.txt.",
            "--model",
            url,
            "--max-turns",
            "2",
            "--json",
            timeout=300,
        )
        assert "turns" in json.loads(agent.stdout.strip().splitlines()[-1])
    finally:
        server.terminate()
        server.wait(timeout=60)

    tasks = str(tmp_path / "tasks")
    generate_tasks(tasks, n=1, seed=9, families=["config"], split="test")
    evaluated = _cli(
        "eval", "--checkpoint", rl, "--tasks", tasks, "--max-tokens", "24", "--max-turns", "2", "--json", timeout=300
    )
    assert "success" in evaluated.stdout
    _cli("analyze", run, timeout=600)
    summary = json.load(open(os.path.join(run, "analysis", "summary.json")))
    assert summary  # the run's rollouts, tokenized by the checkpoint's own tokenizer, analysed
    out = str(tmp_path / "exported")
    _cli("export", rl, "--hf", out)
    _equal_to_transformers(out)
    assert os.path.isfile(os.path.join(out, "tokenizer_config.json"))
