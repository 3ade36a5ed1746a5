"""Ctrl-C, SIGTERM and SIGHUP to a `codefleet` command, as a user or a service manager sends them: one line
on stderr, the status 128 + the signal, and nothing of its sandboxes left on the host — no process, mount,
cgroup or state directory (the RAM-backed workspace included)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
from helpers import processes_with, unique_sleep, wait_for
from openai_stub import OpenAIStub, call, reply

from codefleet.sandbox.layers import mounts_under


@pytest.fixture
def private_state():
    """A state directory of its own: whatever is in it after the command ends was left by the command."""
    with tempfile.TemporaryDirectory(prefix="codefleet-test-signals-", dir="/var/tmp") as d:
        os.chmod(d, 0o755)
        yield d


def start(state_dir: str, *args: str) -> subprocess.Popen:
    # SIGINT as a terminal's Ctrl-C delivers it, even where the tests run with it ignored (`nohup ... &`)
    return subprocess.Popen(
        [sys.executable, "-m", "codefleet.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, CODEFLEET_STATE_DIR=state_dir),
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def sleeping(marker: str) -> list[int]:
    """The `sleep <marker>` processes (not the command's own, nor a child it forked that has not run exec yet)."""
    found = []
    for pid in processes_with(marker):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "sleep":
                    found.append(pid)
        except OSError:
            pass
    return found


def cgroup_dirs(owner: str) -> list[str]:
    """The cgroups the sandbox owner `owner` has now (cgroups.py: `codefleet/<owner>` below the cgroup of the
    process, in each hierarchy; the command runs in ours)."""
    found = []
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            roots = ["/sys/fs/cgroup"] if controllers == "" else [f"/sys/fs/cgroup/{c}" for c in controllers.split(",")]
            found += [os.path.join(root, path.lstrip("/"), "codefleet", owner) for root in roots]
    return sorted({p for p in found if os.path.isdir(p)})


def interrupt(proc: subprocess.Popen, state_dir: str, signum: int, ready) -> tuple[str, str, dict]:
    """Wait until `ready()`, note what the command holds, send `signum`; (stdout, stderr, what it held and
    how many seconds it took to exit)."""
    try:
        assert wait_for(ready, timeout_s=60), "the command did not get going"
        (owner,) = os.listdir(state_dir)
        held = {"owner": owner, "mounts": mounts_under(state_dir), "cgroups": cgroup_dirs(owner)}
        assert held["mounts"], "a running sandbox has its workspace mounted under the state directory"
        sent = time.monotonic()
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
        held["exit_s"] = time.monotonic() - sent
    finally:
        proc.kill()  # no-op once it exited; never left running after a failure
    return out, err, held


def assert_released(state_dir: str, held: dict) -> None:
    assert os.listdir(state_dir) == [], "the owner directory (and the sandbox's state in it) is left"
    assert mounts_under(state_dir) == [], "mounts are left under the state directory"
    left = [p for p in held["cgroups"] if os.path.exists(p)]
    assert not left, f"cgroups left: {left}"


def one_line(err: str) -> list[str]:
    """stderr without the reaper's note about other (dead) owners, which a command may print as it starts."""
    return [line for line in err.splitlines() if "reaped" not in line]


@pytest.mark.parametrize(
    "signum, name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT (Ctrl-C)"), (signal.SIGHUP, "SIGHUP")]
)
def test_a_signal_to_sandbox_run_releases_everything_and_says_so_in_one_line(private_state, signum, name):
    marker = unique_sleep()
    proc = start(private_state, "sandbox", "run", "--", "sleep", marker)
    out, err, held = interrupt(proc, private_state, signum, ready=lambda: sleeping(marker))
    assert proc.returncode == 128 + signum, err
    assert one_line(err) == [f"codefleet: interrupted by {name}; its sandboxes were closed"], err
    assert "Traceback" not in err and out == ""
    assert_released(private_state, held)
    assert wait_for(lambda: not sleeping(marker), timeout_s=5), "the sandbox's command still runs"


def test_sigterm_to_agent_run_releases_its_sandbox_at_once(repo, private_state):
    with OpenAIStub([reply("", call("list_dir", {}), delay_s=60)]) as stub:  # the model thinks for a minute
        proc = start(private_state, "agent", "run", "--repo", repo, "--task", "Look around.", "--model", stub.base_url)
        out, err, held = interrupt(proc, private_state, signal.SIGTERM, ready=lambda: stub.requests)
    assert proc.returncode == 143, err
    assert one_line(err) == ["codefleet: interrupted by SIGTERM; its sandboxes were closed"], err
    assert "Traceback" not in err and out == ""
    assert_released(private_state, held)
    assert held["exit_s"] < 20  # not the minute the model call would take
