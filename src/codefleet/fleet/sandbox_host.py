"""The sandbox host: one Ray actor per node holding that node's sandboxes.

Capacity is the Ray logical resource `sandbox`: a node started with
`ray start --resources='{"sandbox": 64}'` (or `ray.init(resources=...)`)
hosts at most 64 sandboxes. The host actor itself reserves only
`HOST_RESOURCE_UNITS` of it and no CPU, so it never eats the capacity it
advertises; the sandboxes are processes of the host, not Ray tasks, so the
host counts them itself and refuses one too many with `SandboxCapacityError`.

Two layers, so that the logic is testable without Ray:

- `HostCore` (no Ray): live sandboxes by id, capacity accounting, warm pools
  (`SandboxPool` per (repo, config)). Thread-safe; every method blocks.
- `SandboxHost` (the actor): an async actor whose methods hand `HostCore`
  calls to a thread pool, so one host runs many sandboxes' commands at once
  while its event loop stays free for the next call.

Callers normally never touch a host: `SandboxFleet` and `RemoteSandbox`
(sandbox_fleet.py) find the hosts and hide where a sandbox lives. Exceptions
raised here (PathEscapeError, SandboxClosedError, ...) travel back to the
caller as themselves. Repository paths are paths *on the host's node*.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import ray

from codefleet.sandbox import (
    Sandbox,
    SandboxClosedError,
    SandboxConfig,
    SandboxError,
    SandboxPool,
    SandboxUnavailableError,
    create_sandbox,
    state,
)
from codefleet.types import ExecResult, FileEntry, SandboxInfo, SearchMatch

log = logging.getLogger(__name__)
T = TypeVar("T")

RESOURCE = "sandbox"  # the logical resource a node's sandbox capacity is counted in
HOST_RESOURCE_UNITS = 0.001  # what the host actor itself reserves of it
ADD_CAPACITY_HINT = "or add capacity: start nodes with `ray start --resources='{\"sandbox\": N}'`"


class SandboxCapacityError(SandboxError):
    """Every slot of a host (or of the whole fleet) holds a live sandbox."""


def host_name(node_id: str) -> str:
    """The Ray actor name of the sandbox host on `node_id`."""
    return f"codefleet-sandbox-host-{node_id}"


def node_capacity(node_id: str) -> int:
    """How many sandboxes `node_id` advertises (its `sandbox` resource total)."""
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return int(node["Resources"].get(RESOURCE, 0))
    raise SandboxUnavailableError(f"Ray node {node_id} is not part of this cluster")


def sandbox_nodes() -> dict[str, int]:
    """Live nodes that advertise sandbox capacity: node id -> capacity."""
    return {
        n["NodeID"]: int(n["Resources"].get(RESOURCE, 0))
        for n in ray.nodes()
        if n["Alive"] and n["Resources"].get(RESOURCE, 0) >= 1
    }


def pool_key(repo: str | None, config: SandboxConfig) -> str:
    """Sandboxes from one warm pool are interchangeable iff repo and config match."""
    return json.dumps([os.path.abspath(repo) if repo else None, dataclasses.asdict(config)], sort_keys=True)


@dataclass(frozen=True)
class HostStats:
    """One host's load. `warm` slots are held by warm pools (`ready` of them started)."""

    node_id: str
    capacity: int
    live: int
    warm: int = 0
    ready: int = 0
    pending: int = 0  # creates and forks in progress
    pid: int = 0

    @property
    def free(self) -> int:
        return self.capacity - self.live - self.warm - self.pending


class HostCore:
    """A host's sandboxes and its capacity, without Ray. Thread-safe; methods block.

    Every slot is one sandbox process tree: live sandboxes, creates and forks
    in progress, and the `size` of every warm pool all count against
    `capacity`.
    """

    def __init__(
        self, node_id: str, capacity: int, factory: Callable[[str | None, SandboxConfig], Sandbox] = create_sandbox
    ):
        self.node_id = node_id
        self.capacity = capacity
        self._factory = factory
        self._live: dict[str, Sandbox] = {}
        self._pools: dict[str, SandboxPool] = {}
        self._pending = 0
        self._shut_down = False
        self._lock = threading.Lock()

    def _used(self) -> int:
        return len(self._live) + self._pending + sum(p.size for p in self._pools.values())

    def _full_error(self, wanted: int) -> SandboxCapacityError:
        return SandboxCapacityError(
            f"sandbox host on node {self.node_id} is full: {self._used()} of {self.capacity} slots in use, "
            f"{wanted} more wanted; close sandboxes you no longer need (sandbox.close()), {ADD_CAPACITY_HINT}"
        )

    def _start(self, n: int, make: Callable[[], list[Sandbox]]) -> list[tuple[str, SandboxInfo]]:
        """Reserve n slots, start the sandboxes outside the lock, then adopt them; [(id, info)]."""
        with self._lock:
            if self._shut_down:
                raise SandboxClosedError(f"the sandbox host on node {self.node_id} is shut down; start a new fleet")
            if self._used() + n > self.capacity:
                raise self._full_error(n)
            self._pending += n
        try:
            sandboxes = make()
        except BaseException:
            with self._lock:
                self._pending -= n
            raise
        with self._lock:
            self._pending -= n
            adopted = not self._shut_down
            if adopted:
                self._live.update((sb.id, sb) for sb in sandboxes)
        if adopted:
            return [(sb.id, sb.info) for sb in sandboxes]
        for sb in sandboxes:  # the host shut down while they started
            sb.close()
        raise SandboxClosedError(f"the sandbox host on node {self.node_id} shut down; start a new fleet")

    def create(self, repo: str | None = None, config: SandboxConfig | None = None) -> tuple[str, SandboxInfo]:
        """A new sandbox (from a warm pool when one matches); (id, info)."""
        config = config or SandboxConfig()
        with self._lock:
            pool = self._pools.get(pool_key(repo, config))

        def make() -> list[Sandbox]:
            if pool is not None:
                try:
                    return [pool.acquire()]
                except SandboxClosedError:  # the pool was dropped meanwhile
                    pass
            return [self._factory(repo, config)]

        return self._start(1, make)[0]

    def get(self, sandbox_id: str) -> Sandbox:
        sb = self._live.get(sandbox_id)
        if sb is None:
            raise SandboxClosedError(
                f"sandbox {sandbox_id} is not on the host on node {self.node_id}: it was closed "
                "(or never created here); create a new one"
            )
        return sb

    def fork(self, sandbox_id: str, n: int) -> list[tuple[str, SandboxInfo]]:
        parent = self.get(sandbox_id)
        return self._start(n, lambda: parent.fork(n))

    def alive(self, sandbox_id: str) -> bool:
        sb = self._live.get(sandbox_id)
        return sb is not None and sb.alive()

    def close(self, sandbox_id: str) -> None:
        """Close and forget a sandbox; closing an unknown or closed one does nothing."""
        with self._lock:
            sb = self._live.pop(sandbox_id, None)
        if sb is not None:
            sb.close()

    def warm(self, repo: str | None, config: SandboxConfig | None, size: int) -> None:
        """Keep `size` sandboxes of (repo, config) started ahead of `create`; 0 drops the pool.
        The pool's slots count against capacity."""
        if size < 0:
            raise ValueError(f"a warm pool needs size >= 0, got {size}")
        config = config or SandboxConfig()
        key = pool_key(repo, config)
        with self._lock:
            old = self._pools.get(key)
            if self._used() - (old.size if old else 0) + size > self.capacity:
                raise self._full_error(size)
            self._pools.pop(key, None)
            if size > 0:
                self._pools[key] = SandboxPool(repo, config, size, factory=self._factory)
        if old is not None:
            old.close()

    def ids(self) -> list[str]:
        """The ids of the live sandboxes (not warm pools' spares)."""
        with self._lock:
            return list(self._live)

    def stats(self) -> HostStats:
        with self._lock:
            return HostStats(
                self.node_id,
                self.capacity,
                len(self._live),
                sum(p.size for p in self._pools.values()),
                sum(p.ready_count() for p in self._pools.values()),
                self._pending,
                os.getpid(),
            )

    def shutdown(self) -> None:
        """Close every sandbox and pool; later creates are refused."""
        with self._lock:
            self._shut_down = True
            sandboxes, pools = list(self._live.values()), list(self._pools.values())
            self._live.clear()
            self._pools.clear()
        for sb in sandboxes:
            try:
                sb.close()
            except Exception as e:  # keep closing the others
                log.warning("codefleet: closing %s failed: %s", sb.id, e)
        for pool in pools:
            pool.close()


@ray.remote(num_cpus=0, resources={RESOURCE: HOST_RESOURCE_UNITS})
class SandboxHost:
    """The Ray actor holding one node's sandboxes: a thin async wrapper of `HostCore`.

    Blocking sandbox calls run in a thread pool so that commands in many
    sandboxes run at once. `capacity` defaults to the node's `sandbox`
    resource total. Repository paths are paths on this node.
    """

    def __init__(self, capacity: int | None = None, threads: int | None = None):
        node_id = ray.get_runtime_context().get_node_id()
        capacity = node_capacity(node_id) if capacity is None else capacity
        if capacity < 1:
            raise SandboxUnavailableError(
                f"Ray node {node_id} advertises no `sandbox` capacity; start it with "
                "`ray start --resources='{\"sandbox\": N}'` or give the host a capacity"
            )
        self._core = HostCore(node_id, capacity)
        try:  # claim the node's state directory now: its reaper clears what a killed host left (mounts, cgroups)
            state.owner_for(None)
        except OSError as e:  # the first sandbox tries again, and says what is wrong
            log.warning("codefleet: the sandbox state directory is not usable yet: %s", e)
        # One thread per running command, plus room for file calls, creates and closes.
        self._executor = ThreadPoolExecutor(threads or max(16, 2 * capacity + 8), "codefleet-host")

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _on(self, sandbox_id: str, method: str, *args: Any) -> Any:
        return await self._run(lambda: getattr(self._core.get(sandbox_id), method)(*args))

    async def create(self, repo: str | None = None, config: SandboxConfig | None = None) -> tuple[str, SandboxInfo]:
        return await self._run(self._core.create, repo, config)

    async def exec(self, sandbox_id: str, command: str, timeout_s: float | None = None) -> ExecResult:
        return await self._on(sandbox_id, "exec", command, timeout_s)

    async def run_oneoff(self, sandbox_id: str, argv: list[str], timeout_s: float | None = None) -> ExecResult:
        return await self._on(sandbox_id, "run_oneoff", argv, timeout_s)

    async def read_file(
        self, sandbox_id: str, path: str, start_line: int | None = None, end_line: int | None = None
    ) -> str:
        return await self._on(sandbox_id, "read_file", path, start_line, end_line)

    async def write_file(self, sandbox_id: str, path: str, content: str | bytes) -> None:
        return await self._on(sandbox_id, "write_file", path, content)

    async def list_dir(self, sandbox_id: str, path: str = ".", recursive: bool = False) -> list[FileEntry]:
        return await self._on(sandbox_id, "list_dir", path, recursive)

    async def search(self, sandbox_id: str, pattern: str, path: str = ".", max_matches: int = 200) -> list[SearchMatch]:
        return await self._on(sandbox_id, "search", pattern, path, max_matches)

    async def fork(self, sandbox_id: str, n: int) -> list[tuple[str, SandboxInfo]]:
        return await self._run(self._core.fork, sandbox_id, n)

    async def alive(self, sandbox_id: str) -> bool:
        return await self._run(self._core.alive, sandbox_id)

    async def close(self, sandbox_id: str) -> None:
        return await self._run(self._core.close, sandbox_id)

    async def warm(self, repo: str | None, config: SandboxConfig | None, size: int) -> None:
        return await self._run(self._core.warm, repo, config, size)

    async def ids(self) -> list[str]:
        return self._core.ids()

    async def stats(self) -> HostStats:
        return self._core.stats()

    async def shutdown(self) -> None:
        await self._run(self._core.shutdown)


@ray.remote(num_cpus=0)
def reap_node() -> list[str]:
    """Clean up after every dead sandbox owner on the node this task runs on (pin it there): the mounts, processes,
    cgroups and state that a host killed by any means (SIGKILL, the OOM killer, its node's raylet gone) left, whoever
    started it; the owners' names reaped."""
    return state.reap_dead_owners()
