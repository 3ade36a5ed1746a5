"""Process-tree helpers over /proc, and the spawner thread.

The spawner exists because of PR_SET_PDEATHSIG (bwrap's --die-with-parent):
Linux sends the signal when the *thread* that forked the child exits, not
the process. Forking every sandbox from one long-lived thread ties each
sandbox's life to its host process, whatever thread asked for it.

Every process it starts has SIGINT and SIGQUIT at their default action, even
when codefleet itself runs with them ignored (`nohup codefleet train &`, a
job runner): an ignored signal is inherited across exec, and a shell that
starts with SIGINT ignored cannot be interrupted, so a timed-out command
running in the sandbox's shell itself could not be stopped as designed.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
from concurrent.futures import Future
from typing import Any


def children(pid: int) -> list[int]:
    """Direct children of `pid` (all its threads), [] if it is gone."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:
            pass
    return out


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (not `pid` itself)."""
    found: set[int] = set()
    stack = children(pid)
    while stack:
        p = stack.pop()
        if p not in found:
            found.add(p)
            stack.extend(children(p))
    return found


def start_time(pid: int) -> int | None:
    """Kernel start time of `pid` in clock ticks: with the pid, a unique process identity."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


def kill_if_same(pid: int, started: int | None, sig: int = 9) -> None:
    """Signal `pid` only if it is still the process that started at `started`."""
    if started is not None and start_time(pid) == started:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def rss_kb(pid: int) -> tuple[int, int]:
    """(RSS, PSS) of a process in KiB, (0, 0) if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line and not line.startswith(" "))
        return int(fields["Rss"].split()[0]), int(fields["Pss"].split()[0])
    except (OSError, KeyError, ValueError):
        return 0, 0


_DEFAULTED = (signal.SIGINT, signal.SIGQUIT)


def _default_signals() -> None:
    """In the forked child, before exec: the default action for the signals a sandbox is stopped with."""
    for s in _DEFAULTED:
        signal.signal(s, signal.SIG_DFL)


class _Spawner:
    """One daemon thread that forks every sandbox process."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[tuple[Future, tuple, dict]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def popen(self, *args: Any, **kwargs: Any) -> subprocess.Popen:
        if any(signal.getsignal(s) == signal.SIG_IGN for s in _DEFAULTED):  # see the module docstring
            kwargs.setdefault("preexec_fn", _default_signals)
        if threading.current_thread() is self._thread:
            return subprocess.Popen(*args, **kwargs)
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="codefleet-spawner", daemon=True)
                self._thread.start()
        fut: Future = Future()
        self._q.put((fut, args, kwargs))
        return fut.result()

    def _loop(self) -> None:
        while True:
            fut, args, kwargs = self._q.get()
            try:
                fut.set_result(subprocess.Popen(*args, **kwargs))
            except BaseException as e:  # handed back to the caller
                fut.set_exception(e)


spawner = _Spawner()
