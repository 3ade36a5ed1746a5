"""SIGTERM to `codefleet tasks mine` and `codefleet tasks check` while tests run in their worker sandboxes: the
command ends within seconds, as it does on Ctrl-C, and leaves nothing of its sandboxes on the host (no
process, mount, cgroup or state directory); it does not wait for the tests in flight to finish."""

from __future__ import annotations

import signal

import pytest
from helpers import unique_sleep
from test_cli_signals import assert_released, interrupt, one_line, private_state, sleeping, start  # noqa: F401

from codefleet.tasks.spec import save_tasks
from codefleet.types import HiddenChecks, Task

pytestmark = pytest.mark.timeout(180)

SLOW_WHEN_BROKEN = """import subprocess

from slowlib import inc


def test_inc():
    if inc(1) != 2:  # a mutant: its run takes as long as the marker says
        subprocess.run(["sleep", "{marker}"])
    assert inc(1) == 2
"""


def slow_library(root, marker: str) -> str:
    (root / "slowlib").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "slowlib" / "__init__.py").write_text("def inc(x):\n    return x + 1\n")
    (root / "tests" / "test_inc.py").write_text(SLOW_WHEN_BROKEN.format(marker=marker))
    return str(root)


def assert_ended_like_ctrl_c(proc, err: str, held: dict, state_dir: str) -> None:
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert one_line(err)[-1:] == ["codefleet: interrupted by SIGTERM; its sandboxes were closed"], err
    assert "Traceback" not in err
    assert held["exit_s"] < 15, f"it took {held['exit_s']:.0f} s to end"
    assert_released(state_dir, held)


def test_sigterm_ends_tasks_mine_while_mutants_run(tmp_path, private_state):  # noqa: F811
    marker = unique_sleep()
    proc = start(
        private_state, "tasks", "mine", slow_library(tmp_path / "slowlib-1.0", marker), "--out", str(tmp_path / "out")
    )
    out, err, held = interrupt(proc, private_state, signal.SIGTERM, ready=lambda: sleeping(marker))
    assert_ended_like_ctrl_c(proc, err, held, private_state)
    assert not sleeping(marker), "a mutant's test still runs"


def test_sigterm_ends_tasks_check_while_checks_run(tmp_path, private_state):  # noqa: F811
    marker = unique_sleep()
    repo = tmp_path / "repo"
    (repo / "slowlib").mkdir(parents=True)
    (repo / "slowlib" / "__init__.py").write_text("def inc(x):\n    return x - 1\n")
    fix = (
        "--- a/slowlib/__init__.py\n+++ b/slowlib/__init__.py\n@@ -1,2 +1,2 @@\n def inc(x):\n"
        "-    return x - 1\n+    return x + 1\n"
    )
    tests = {"tests/test_inc.py": SLOW_WHEN_BROKEN.format(marker=marker)}
    task = Task(
        id="slow",
        repo=str(repo),
        instruction="Fix inc.",
        reference_patch=fix,
        checks=HiddenChecks("python3 -m pytest -q {tests}", ["tests/test_inc.py::test_inc"], [], tests),
    )
    save_tasks([task], str(tmp_path / "tasks"))
    proc = start(private_state, "tasks", "check", str(tmp_path / "tasks"))
    out, err, held = interrupt(proc, private_state, signal.SIGTERM, ready=lambda: sleeping(marker))
    assert_ended_like_ctrl_c(proc, err, held, private_state)
    assert not sleeping(marker), "a check's test still runs"
