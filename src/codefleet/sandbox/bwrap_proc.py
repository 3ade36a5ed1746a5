"""The outer bwrap process as the host handles it once started (namespace.py starts it): the report it writes on
--info-fd once the sandbox exists (`read_info`), what it said when it exited before that (`bwrap_output`), and
its reaping (`wait_or_kill`)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import time

from codefleet.sandbox.base import SandboxUnavailableError


def wait_or_kill(proc: subprocess.Popen, timeout_s: float = 2.0) -> None:
    """Reap the outer bwrap once its init is dead; kill it if it does not exit."""
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def read_info(fd: int, timeout_s: float = 10.0) -> dict | None:
    """bwrap's --info-fd report; None if bwrap exited without one."""
    data = b""
    deadline = time.monotonic() + timeout_s
    ready = select.poll()  # not select(): with ~500 sandboxes open, their descriptors pass select's limit of 1024
    ready.register(fd, select.POLLIN)
    while not data.rstrip().endswith(b"}"):
        left = deadline - time.monotonic()
        if left <= 0 or not ready.poll(left * 1000):
            raise SandboxUnavailableError(f"bwrap did not start within {timeout_s:g} s")
        chunk = os.read(fd, 4096)
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def bwrap_output(proc: subprocess.Popen) -> str:
    """What an exited bwrap left on its stdout (a one-off's stderr is merged into it)."""
    if proc.stdout is None:
        return ""
    os.set_blocking(proc.stdout.fileno(), False)
    try:
        data = proc.stdout.read() or b""
    except BlockingIOError:
        data = b""
    return data.decode(errors="replace").strip()
