"""A warm pool: sandboxes over one repository, started before anyone asks.

`acquire()` hands out a ready sandbox at once (a fresh one is started if the
pool is empty) and a background thread refills the pool to `size`. Handed
out sandboxes belong to the caller, who closes them; `close()` closes the
ones still waiting. A waiting sandbox whose shell died is dropped, not
handed out.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable

from codefleet.contracts import Sandbox
from codefleet.sandbox.backends import create_sandbox
from codefleet.sandbox.base import SandboxClosedError, SandboxConfig

log = logging.getLogger(__name__)


class SandboxPool:
    def __init__(
        self,
        repo: str | None = None,
        config: SandboxConfig | None = None,
        size: int = 4,
        factory: Callable[[str | None, SandboxConfig], Sandbox] | None = None,
    ):
        if factory is None:
            factory = create_sandbox
        self.repo = repo
        self.config = config or SandboxConfig()
        self.size = size
        self._factory = factory
        self._ready: collections.deque[Sandbox] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self._failures = 0
        self._thread = threading.Thread(target=self._refill, name="codefleet-pool", daemon=True)
        self._thread.start()

    def acquire(self) -> Sandbox:
        """A ready sandbox; the caller owns it and must close it."""
        with self._cond:
            if self._closed:
                raise SandboxClosedError("the sandbox pool is closed")
            while self._ready:
                sb = self._ready.popleft()
                self._cond.notify_all()
                if sb.alive():
                    return sb
                sb.close()
        return self._factory(self.repo, self.config)

    def ready_count(self) -> int:
        with self._cond:
            return len(self._ready)

    def wait_full(self, timeout_s: float = 30.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: len(self._ready) >= self.size or self._closed, timeout_s)

    def _refill(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or len(self._ready) < self.size)
                if self._closed:
                    return
            try:
                sb = self._factory(self.repo, self.config)
                self._failures = 0
            except Exception as e:  # keep serving: acquire() creates on demand
                self._failures += 1
                log.warning("codefleet pool: could not start a sandbox (%s); retrying", e)
                with self._cond:
                    self._cond.wait(min(0.1 * 2**self._failures, 10.0))
                continue
            with self._cond:
                if self._closed:
                    sb.close()
                    return
                self._ready.append(sb)
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            waiting = list(self._ready)
            self._ready.clear()
            self._cond.notify_all()
        for sb in waiting:
            sb.close()
        self._thread.join(timeout=30)

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
