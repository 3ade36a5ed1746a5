"""`codefleet agent run` end to end: a real OpenAI-protocol server, real sandboxes, a real repository."""

from __future__ import annotations

import io
import json
import os
import subprocess
import threading
import time

import pytest
from helpers import read_tree
from openai_stub import OpenAIStub, call, reply

from codefleet.agent.cli import main

FIX = call("edit_file", {"path": "pkg/calc.py", "old_text": "return a - b", "new_text": "return a - b  # checked"})


def run_cli(stub: OpenAIStub, repo: str, state_dir: str, *extra: str, stdin=None) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(
        [
            "agent",
            "run",
            "--repo",
            repo,
            "--task",
            "Mark sub as checked.",
            "--model",
            stub.base_url,
            "--set",
            f"state_dir={state_dir}",
            *extra,
        ],
        stdin=stdin or io.StringIO(),
        out=out,
        err=err,
    )
    return code, out.getvalue(), err.getvalue()


def test_json_run_leaves_the_repository_untouched(repo, state_dir):
    before = read_tree(repo)
    script = [
        reply("reading", call("read_file", {"path": "pkg/calc.py"}), call("list_dir", {})),
        reply("", FIX, call("write_file", {"path": "NOTES.md", "content": "checked\n"})),
        reply("", call("submit", {"summary": "marked"})),
    ]
    with OpenAIStub(script) as stub:
        code, out, err = run_cli(stub, repo, state_dir, "--json")
    assert code == 0
    result = json.loads(out.strip().splitlines()[-1])  # the last thing printed is one JSON object
    assert {"diff", "turns", "tool_calls", "stop_reason", "wall_s"} <= set(result)
    assert (result["turns"], result["tool_calls"], result["stop_reason"]) == (3, 5, "submit")
    assert result["applied"] is False and len(result["attempts"]) == 1
    assert "+    return a - b  # checked" in result["diff"] and "+++ b/NOTES.md" in result["diff"]
    assert ".codefleet" not in result["diff"]
    assert read_tree(repo) == before  # never modified without --apply
    assert "turn 1: read_file, list_dir" in err and "stopped (submit) after 3 turns" in err


def test_apply_changes_the_repository_with_the_diff(repo, state_dir):
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    script = [
        reply(
            "",
            FIX,
            call("write_file", {"path": "pkg/new.py", "content": "X = 1\n"}),
            call("run", {"command": "rm README.md"}),
        ),
        reply("", call("submit", {})),
    ]
    with OpenAIStub(script) as stub:
        code, out, err = run_cli(stub, repo, state_dir, "--apply")
    assert code == 0 and "applied the diff" in err
    files = read_tree(repo)
    assert files["pkg/calc.py"].endswith("return a - b  # checked\n") and files["pkg/new.py"] == "X = 1\n"
    assert "README.md" not in files and not os.path.exists(os.path.join(repo, ".codefleet"))
    assert out.startswith("diff --git")  # without --json the diff goes to stdout


def test_attempts_run_in_parallel_and_the_one_whose_tests_pass_is_kept(repo, state_dir):
    lock = threading.Lock()
    first_turns = []

    def by_turn(body: dict):
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        if turn == 1:
            return reply("", call("submit", {}))
        with lock:  # the two attempts' first turns differ: one breaks add, one does not
            first_turns.append(1)
            good = len(first_turns) == 1
        new = "return a + b  # fine" if good else "return a * b"
        return reply(
            "", call("edit_file", {"path": "pkg/calc.py", "old_text": "return a + b", "new_text": new}), delay_s=0.8
        )

    test = "python3 -c 'from pkg.calc import add; assert add(2, 3) == 5'"
    with OpenAIStub([by_turn] * 4) as stub:
        code, out, err = run_cli(stub, repo, state_dir, "--attempts", "2", "--test-command", test, "--json")
    result = json.loads(out)
    assert code == 0 and len(result["attempts"]) == 2
    assert sorted(a["tests_passed"] for a in result["attempts"]) == [False, True]
    assert result["tests_passed"] is True and "+    return a + b  # fine" in result["diff"]
    assert result["attempts"][result["best_attempt"]]["diff"] == result["diff"]
    assert "[attempt 1]" in err and "[attempt 2]" in err
    first = sorted(stub.request_times)[:2]
    assert first[1] - first[0] < 0.7  # both attempts asked the model at once (each answer takes 0.8 s)


def test_a_line_on_stdin_is_sent_as_a_correction(repo, state_dir):
    read_fd, write_fd = os.pipe()
    stdin = os.fdopen(read_fd, "r")
    writer = os.fdopen(write_fd, "w")

    def first_turn(body: dict):
        writer.write("please also keep the docstring\n")
        writer.flush()
        return reply("", call("run", {"command": "sleep 0.3"}))

    with OpenAIStub([first_turn, reply("", call("submit", {}))]) as stub:
        code, out, err = run_cli(stub, repo, state_dir, "--json", stdin=stdin)
    writer.close()
    assert code == 0
    contents = [m["content"] for m in stub.requests[1]["messages"] if m["role"] == "user"]
    assert contents[-1] == "please also keep the docstring"
    assert all(m["content"] != "please also keep the docstring" for m in stub.requests[0]["messages"])
    assert "correction delivered: please also keep the docstring" in err


def test_an_unreachable_model_fails_with_the_url_in_the_message(repo, state_dir):
    with OpenAIStub() as stub:
        url = stub.base_url
    out, err = io.StringIO(), io.StringIO()
    code = main(
        [
            "agent",
            "run",
            "--repo",
            repo,
            "--task",
            "x",
            "--model",
            url,
            "--json",
            "--timeout-s",
            "2",
            "--max-retries",
            "0",
            "--set",
            f"state_dir={state_dir}",
        ],
        stdin=io.StringIO(),
        out=out,
        err=err,
    )
    result = json.loads(out.getvalue())
    assert code == 1 and result["stop_reason"] == "error" and url in result["error"]
    assert f"model error: PolicyError: could not connect to the model endpoint {url}" in err.getvalue()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--repo", "/nonexistent/repo"], "is not a directory"),
        (["--model", "ftp://x"], "OpenAI-compatible base URL"),
        (["--attempts", "0"], "at least 1"),
        (["--max-turns", "0"], "--max-turns must be at least 1, got 0"),
        (["--max-turns", "-1"], "--max-turns must be at least 1, got -1"),
        (["--max-wall-s", "0"], "--max-wall-s must be a positive number of seconds, got 0"),
        (["--max-wall-s", "nan"], "--max-wall-s must be a positive number of seconds, got nan"),
    ],
)
def test_bad_arguments_say_what_is_wrong(repo, argv, message):
    err = io.StringIO()
    base = {"--repo": repo, "--task": "x", "--model": "http://127.0.0.1:9/v1"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    code = main(
        ["agent", "run", *[x for kv in base.items() for x in kv]], stdin=io.StringIO(), out=io.StringIO(), err=err
    )
    assert code == 2 and message in err.getvalue()


def test_a_correction_typed_before_the_attempts_start_reaches_every_attempt(repo, state_dir):
    read_fd, write_fd = os.pipe()
    with os.fdopen(write_fd, "w") as writer:
        writer.write("only touch pkg/calc.py\n")  # typed before any loop exists
    stdin = os.fdopen(read_fd, "r")

    def by_turn(body: dict):
        turn = sum(m["role"] == "assistant" for m in body["messages"])
        return reply("", call("run", {"command": "sleep 0.2"})) if turn == 0 else reply("", call("submit", {}))

    with OpenAIStub([by_turn] * 4) as stub:
        code, out, err = run_cli(stub, repo, state_dir, "--attempts", "2", "--json", stdin=stdin)
    assert code == 0 and len(json.loads(out)["attempts"]) == 2
    last_requests = [r for r in stub.requests if sum(m["role"] == "assistant" for m in r["messages"]) == 1]
    assert len(last_requests) == 2
    for request in last_requests:
        assert {"role": "user", "content": "only touch pkg/calc.py"} in request["messages"]


def test_files_git_tracks_despite_gitignore_and_non_utf8_bytes_reach_the_diff_and_the_repository(repo, state_dir):
    with open(os.path.join(repo, ".gitignore"), "w") as f:
        f.write("*.cfg\n")
    with open(os.path.join(repo, "app.cfg"), "w") as f:
        f.write("debug = false\n")
    with open(os.path.join(repo, "latin.txt"), "wb") as f:
        f.write(b"caf\xe9\nprice = 1\n")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-f", "app.cfg"], cwd=repo, check=True)  # tracked, though ignored
    with open(os.path.join(repo, ".git", "info", "exclude"), "a") as f:
        f.write("*.local\n")  # ignored by this clone only
    script = [
        reply(
            "",
            call("edit_file", {"path": "app.cfg", "old_text": "false", "new_text": "true"}),
            call("edit_file", {"path": "latin.txt", "old_text": "price = 1", "new_text": "price = 2"}),
            call("write_file", {"path": "notes.local", "content": "scratch\n"}),
        ),
        reply("", call("submit", {})),
    ]
    with OpenAIStub(script) as stub:
        code, out, err = run_cli(stub, repo, state_dir, "--apply")
    assert code == 0 and "applied the diff" in err and "+debug = true" in out and "+price = 2" in out
    assert "notes.local" not in out
    with open(os.path.join(repo, "app.cfg")) as f:
        assert f.read() == "debug = true\n"
    with open(os.path.join(repo, "latin.txt"), "rb") as f:
        assert f.read() == b"caf\xe9\nprice = 2\n"  # the byte that is not UTF-8 is still there


def test_a_big_diff_comes_back_whole_and_nested_repositories_are_named(repo, state_dir):
    os.makedirs(os.path.join(repo, "vendor", "lib"))
    subprocess.run(["git", "init", "-q"], cwd=os.path.join(repo, "vendor", "lib"), check=True)
    make_big = "python3 -c \"open('big.txt', 'w').write('line\\n' * 30000)\""  # 180 KB of diff
    script = [reply("", call("run", {"command": make_big})), reply("", call("submit", {}))]
    with OpenAIStub(script) as stub:
        code, out, err = run_cli(stub, repo, state_dir, "--json")
    diff = json.loads(out)["diff"]
    assert code == 0 and diff.count("\n+line") == 30000 and "cut" not in diff
    assert "vendor/lib/ is a git repository of its own" in err


def test_a_diff_that_cannot_be_taken_is_reported_and_fails_the_run(repo, state_dir):
    script = [reply("", FIX, call("run", {"command": "rm -rf .codefleet"})), reply("", call("submit", {}))]
    with OpenAIStub(script) as stub:
        code, out, err = run_cli(stub, repo, state_dir)
    assert code == 1 and "could not take the diff, so its changes are lost" in err and "(no changes)" not in err


def test_the_test_command_gets_only_the_time_left(repo, state_dir):
    with OpenAIStub([reply("", call("submit", {}))]) as stub:
        started = time.perf_counter()
        code, out, err = run_cli(stub, repo, state_dir, "--json", "--max-wall-s", "5", "--test-command", "sleep 60")
    assert time.perf_counter() - started < 40
    assert code == 0 and json.loads(out)["tests_passed"] is False, err[-3000:]


def test_the_first_ctrl_c_keeps_the_work_and_the_second_quits_at_once(repo, state_dir):
    import signal
    import sys

    cli = [
        sys.executable,
        "-m",
        "codefleet.cli",
        "agent",
        "run",
        "--repo",
        repo,
        "--task",
        "Mark sub as checked.",
        "--set",
        f"state_dir={state_dir}",
        "--apply",
        "--test-command",
        "sleep 60",
    ]

    def interrupt(stub: OpenAIStub, times: int) -> tuple[subprocess.CompletedProcess, float]:
        proc = subprocess.Popen(
            cli + ["--model", stub.base_url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        # (a terminal's Ctrl-C, even where the tests run with SIGINT ignored, as under `nohup ... &`)
        deadline = time.monotonic() + 30
        while len(stub.requests) < 2 and time.monotonic() < deadline:  # the edit is made, the next answer is slow
            time.sleep(0.05)
        started = time.monotonic()
        for _ in range(times):
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
        try:
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()  # no-op once it exited; never left running after a failure
        return subprocess.CompletedProcess(cli, proc.returncode, out, err), time.monotonic() - started

    slow = [reply("", FIX), reply("", call("submit", {}), delay_s=3)]
    with OpenAIStub(slow) as stub:
        done, _ = interrupt(stub, 1)
    assert done.returncode == 130, done.stderr[-2000:]
    assert "Ctrl-C again to quit at once" in done.stderr and "was not applied" in done.stderr
    assert "+    return a - b  # checked" in done.stdout  # the edit is printed, not lost; no test command ran
    assert "# checked" not in open(os.path.join(repo, "pkg", "calc.py")).read()
    with OpenAIStub([reply("", FIX), reply("", call("submit", {}), delay_s=30)]) as stub:
        done, waited = interrupt(stub, 2)
    assert done.returncode == 130 and "interrupted; the repository was not changed" in done.stderr
    assert waited < 15  # not the 30 s the model call would take


def test_a_local_checkpoint_runs_in_process_and_a_missing_one_is_one_sentence(repo, state_dir, tmp_path):
    import torch

    from codefleet.model import checkpoint
    from codefleet.model.config import ModelConfig
    from codefleet.model.transformer import Transformer

    torch.manual_seed(0)
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a checkpoint that says how it is prompted
    checkpoint.save(
        Transformer(ModelConfig.tiny()), str(tmp_path / "run" / "checkpoints" / "sft"), metadata={"prompt": "bare"}
    )
    for extra, bare in (([], True), (["--prompt", "full"], False)):
        out, err = io.StringIO(), io.StringIO()
        code = main(
            [
                "agent",
                "run",
                "--repo",
                repo,
                "--task",
                "look around",
                "--model",
                f"local:{tmp_path / 'run' / 'checkpoints' / 'sft'}",
                "--max-turns",
                "1",
                "--json",
                "--set",
                f"state_dir={state_dir}",
                *extra,
            ],
            stdin=io.StringIO(),
            out=out,
            err=err,
        )
        result = json.loads(out.getvalue())
        assert code == 0 and result["turns"] == 1 and result["tokens"] > 0, err.getvalue()
        assert ("bare prompt: the model sees the task alone" in err.getvalue()) == bare  # the checkpoint's prompt
    for model, extra, words in (
        (f"local:{tmp_path / 'missing'}", [], "is not a checkpoint directory"),
        ("http://127.0.0.1:9/v1", ["--tool-grammar", "auto"], "codefleet serve --tool-grammar"),
    ):
        err = io.StringIO()
        code = main(
            ["agent", "run", "--repo", repo, "--task", "x", "--model", model, *extra],
            stdin=io.StringIO(),
            out=io.StringIO(),
            err=err,
        )
        assert code == 2 and words in err.getvalue()
        assert "Traceback" not in err.getvalue() and len(err.getvalue().strip().splitlines()) == 1


def test_bytecode_the_tests_write_stays_out_of_the_diff_unless_git_tracks_it(repo, state_dir):
    os.makedirs(os.path.join(repo, "legacy", "__pycache__"))
    with open(os.path.join(repo, "legacy", "__pycache__", "old.cpython-311.pyc"), "wb") as f:
        f.write(b"\x00old")
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)  # this repository tracks one bytecode file
    script = [
        reply(
            "",
            FIX,
            call("run", {"command": "python3 -c 'import pkg.calc'"}),
            call("run", {"command": "printf '\\001new' > legacy/__pycache__/old.cpython-311.pyc"}),
        ),
        reply("", call("submit", {})),
    ]
    with OpenAIStub(script) as stub:
        code, out, err = run_cli(stub, repo, state_dir)
    assert code == 0 and "+    return a - b  # checked" in out
    assert "pkg/__pycache__" not in out  # written by the import
    assert "legacy/__pycache__/old.cpython-311.pyc" in out  # tracked, so its change is shown
