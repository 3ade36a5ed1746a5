"""`codefleet sandbox run`, run as a user would: a separate process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import tree_digest

CODEFLEET = os.path.join(os.path.dirname(sys.executable), "codefleet")


def run_cli(state_dir, *args, timeout_s=120):
    env = dict(os.environ, CODEFLEET_STATE_DIR=state_dir)
    return subprocess.run(
        [sys.executable, "-m", "codefleet.cli", *args], capture_output=True, text=True, env=env, timeout=timeout_s
    )


def test_prints_the_output_and_exits_with_the_commands_code(repo, state_dir):
    result = run_cli(state_dir, "sandbox", "run", "--repo", repo, "--", "sh", "-c", "cat README.md; exit 7")
    assert result.stdout == "# demo\n"
    assert result.returncode == 7


def test_one_argument_is_a_shell_line(repo, state_dir):
    result = run_cli(state_dir, "sandbox", "run", "--repo", repo, "--", "cd pkg && ls && pwd")
    assert result.returncode == 0
    assert result.stdout == "__init__.py\ncalc.py\n/workspace/pkg\n"


@pytest.mark.skipif(not os.path.exists(CODEFLEET), reason="the console script is not installed")
def test_console_script(state_dir):
    result = subprocess.run(
        [CODEFLEET, "sandbox", "run", "--", "echo", "hi there"],
        capture_output=True,
        text=True,
        env=dict(os.environ, CODEFLEET_STATE_DIR=state_dir),
        timeout=120,
    )
    assert (result.returncode, result.stdout) == (0, "hi there\n")


def test_the_repository_is_never_modified(repo, state_dir):
    before = tree_digest(repo)
    result = run_cli(
        state_dir,
        "sandbox",
        "run",
        "--repo",
        repo,
        "--",
        "echo x > README.md && rm -r pkg && mkdir new && cat README.md",
    )
    assert (result.returncode, result.stdout) == (0, "x\n")
    assert tree_digest(repo) == before


def test_timeout_exits_124(state_dir):
    result = run_cli(state_dir, "sandbox", "run", "--timeout", "1", "--", "sleep", "60")
    assert result.returncode == 124
    assert "timed out" in result.stdout


def test_memory_limit_is_accepted(repo, state_dir):
    result = run_cli(state_dir, "sandbox", "run", "--repo", repo, "--memory-mb", "256", "--", "echo", "ok")
    assert (result.returncode, result.stdout) == (0, "ok\n")


def test_missing_repository_exits_2_with_a_clear_message(tmp_path, state_dir):
    missing = str(tmp_path / "nope")
    result = run_cli(state_dir, "sandbox", "run", "--repo", missing, "--", "true")
    assert result.returncode == 2
    assert f"repository directory {missing!r} does not exist" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "memory=1"], "unknown config key"),
        (["--set", "memory_mb=lots"], "memory_mb: expected int"),
        (["--set", "backend=bogus"], "unknown sandbox backend 'bogus'"),
        (["--config", "/no/such/file.yaml"], "cannot read config file"),
    ],
)
def test_bad_configuration_exits_2_with_a_clear_message(state_dir, args, message):
    result = run_cli(state_dir, "sandbox", "run", *args, "--", "true")
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_no_command_exits_2(state_dir):
    result = run_cli(state_dir, "sandbox", "run", "--")
    assert result.returncode == 2
    assert "give the command after `--`" in result.stderr
