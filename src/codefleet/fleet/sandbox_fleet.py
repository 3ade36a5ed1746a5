"""The client side of the sandbox fleet: `SandboxFleet` and `RemoteSandbox`.

    fleet = SandboxFleet.start()             # a host on every node with `sandbox` capacity
    sb = fleet.create("/data/repos/django")  # on the host with the most free room
    sb.exec("cd src && export X=1")
    attempts = sb.fork(8)                    # same host: forks share copy-on-write layers

`SandboxFleet.start()` finds the nodes that advertise the `sandbox`
resource and gets or starts one named `SandboxHost` actor on each (pinned
with a hard node-affinity, `get_if_exists`, so every driver shares them).
`create` picks the host with the most free slots. A `RemoteSandbox` speaks
the `Sandbox` protocol over actor calls (plus `a*` awaitable variants) and
is only an actor handle and an id, so it pickles into other Ray tasks and
actors.

Errors cross the wire as themselves: a `PathEscapeError` raised on the host
is raised again, same type and message, in the caller (Ray's RayTaskError
wrapper is removed). A host that died (node lost, process killed) turns into
`SandboxDeadError`: its sandboxes are gone, and the next `fleet.create()`
starts a replacement host. A fleet from `start()` also looks at the cluster
again every `REFRESH_S`, and before it says it is full: a node that joined
gets a host, and a host it could not replace in time is found again.

Repository paths given to `create`/`warm` are paths *on the chosen host's
node*: on a cluster, put repositories on shared storage or on every node.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from codefleet.fleet.sandbox_host import (
    ADD_CAPACITY_HINT,
    HostStats,
    SandboxCapacityError,
    SandboxHost,
    host_name,
    reap_node,
    sandbox_nodes,
)
from codefleet.sandbox import SandboxConfig, SandboxDeadError, SandboxUnavailableError
from codefleet.types import ExecResult, FileEntry, SandboxInfo, SearchMatch

log = logging.getLogger(__name__)

DEFAULT_NAMESPACE = "codefleet"
REFRESH_S = 10.0  # how often a managed fleet looks for nodes that joined and hosts it lost


def _host_died(node_id: str, e: RayActorError) -> SandboxDeadError:
    return SandboxDeadError(
        f"sandbox host on node {node_id} died; its sandboxes are gone — create new ones "
        f"(fleet.create() starts a replacement host). Ray said: {str(e).splitlines()[0]}"
    )


def _unwrap(e: RayTaskError) -> BaseException:
    """The exception the host raised, as itself (Ray wraps it in RayTaskError)."""
    cause = e.cause
    return cause if isinstance(cause, BaseException) else e


def _get(ref: ray.ObjectRef, node_id: str) -> Any:
    try:
        return ray.get(ref)
    except RayActorError as e:
        raise _host_died(node_id, e) from None
    except RayTaskError as e:
        raise _unwrap(e) from None


async def _aget(ref: ray.ObjectRef, node_id: str) -> Any:
    try:
        return await ref
    except RayActorError as e:
        raise _host_died(node_id, e) from None
    except RayTaskError as e:
        raise _unwrap(e) from None


class RemoteSandbox:
    """A sandbox living on some node's `SandboxHost`, with the `Sandbox` methods.

    Picklable (an actor handle and an id): pass it to Ray tasks and actors,
    which then drive the same sandbox. `a*` methods are the awaitable
    variants for async code. `close()` and `alive()` never raise for a dead
    host: its sandboxes are gone either way.
    """

    def __init__(self, host: ActorHandle, node_id: str, sandbox_id: str, info: SandboxInfo):
        self.host = host
        self.node_id = node_id
        self.id = sandbox_id
        self.info = info

    def _sibling(self, sandbox_id: str, info: SandboxInfo) -> RemoteSandbox:
        return RemoteSandbox(self.host, self.node_id, sandbox_id, info)

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        return _get(self.host.exec.remote(self.id, command, timeout_s), self.node_id)

    def run_oneoff(self, argv: list[str], timeout_s: float | None = None) -> ExecResult:
        return _get(self.host.run_oneoff.remote(self.id, argv, timeout_s), self.node_id)

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        return _get(self.host.read_file.remote(self.id, path, start_line, end_line), self.node_id)

    def write_file(self, path: str, content: str | bytes) -> None:
        _get(self.host.write_file.remote(self.id, path, content), self.node_id)

    def list_dir(self, path: str = ".", recursive: bool = False) -> list[FileEntry]:
        return _get(self.host.list_dir.remote(self.id, path, recursive), self.node_id)

    def search(self, pattern: str, path: str = ".", max_matches: int = 200) -> list[SearchMatch]:
        return _get(self.host.search.remote(self.id, pattern, path, max_matches), self.node_id)

    def fork(self, n: int) -> list[RemoteSandbox]:
        """n sandboxes on the same host, starting from this one's state."""
        return [self._sibling(*child) for child in _get(self.host.fork.remote(self.id, n), self.node_id)]

    def alive(self) -> bool:
        try:
            return _get(self.host.alive.remote(self.id), self.node_id)
        except SandboxDeadError:
            return False

    def close(self) -> None:
        try:
            _get(self.host.close.remote(self.id), self.node_id)
        except SandboxDeadError:
            pass

    async def aexec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        return await _aget(self.host.exec.remote(self.id, command, timeout_s), self.node_id)

    async def arun_oneoff(self, argv: list[str], timeout_s: float | None = None) -> ExecResult:
        return await _aget(self.host.run_oneoff.remote(self.id, argv, timeout_s), self.node_id)

    async def aread_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        return await _aget(self.host.read_file.remote(self.id, path, start_line, end_line), self.node_id)

    async def awrite_file(self, path: str, content: str | bytes) -> None:
        await _aget(self.host.write_file.remote(self.id, path, content), self.node_id)

    async def afork(self, n: int) -> list[RemoteSandbox]:
        return [self._sibling(*child) for child in await _aget(self.host.fork.remote(self.id, n), self.node_id)]

    async def aclose(self) -> None:
        try:
            await _aget(self.host.close.remote(self.id), self.node_id)
        except SandboxDeadError:
            pass

    def __enter__(self) -> RemoteSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<RemoteSandbox {self.id} on node {self.node_id[:12]}>"


class SandboxFleet:
    """Every node's sandbox host behind one `create()`.

    `SandboxFleet.start()` finds the nodes that advertise `sandbox` capacity
    and gets (or starts) the named host on each; such a fleet replaces a host
    that died. `SandboxFleet(hosts)` wraps hosts you started yourself
    (node id -> handle) and only skips dead ones. Picklable.
    """

    def __init__(self, hosts: dict[str, ActorHandle], namespace: str | None = None, detached: bool = False):
        self.hosts = dict(hosts)
        self.namespace = namespace  # None: hosts were given, not managed
        self.detached = detached
        self._refreshed_at = time.monotonic()

    @classmethod
    def start(cls, namespace: str = DEFAULT_NAMESPACE, detached: bool = False) -> SandboxFleet:
        """Connect to the hosts in `namespace`, starting any that are missing.
        `detached` hosts outlive this driver (and must be shut down explicitly)."""
        fleet = cls({}, namespace, detached)
        fleet.refresh()
        return fleet

    def refresh(self) -> None:
        """Follow the cluster: a host on every node with sandbox capacity, none on nodes that left."""
        if self.namespace is None:
            return
        nodes = sandbox_nodes()
        if not nodes:
            raise SandboxUnavailableError(
                "no Ray node advertises the `sandbox` resource; start Ray with ray.init(resources={'sandbox': 64}) "
                "or `ray start --resources='{\"sandbox\": 64}'`"
            )
        self.hosts = {
            node_id: self.hosts.get(node_id) or self._host_on(node_id, capacity) for node_id, capacity in nodes.items()
        }

    def _host_on(self, node_id: str, capacity: int) -> ActorHandle:
        return SandboxHost.options(
            name=host_name(node_id),
            namespace=self.namespace,
            get_if_exists=True,
            lifetime="detached" if self.detached else None,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(capacity=capacity)

    def _replace(self, node_id: str, wait_s: float = 30.0) -> None:
        """Start a new host on `node_id` in place of a dead one (or drop it if the node is gone)."""
        dead = self.hosts.pop(node_id)
        try:  # a host whose process was killed keeps its name until it is killed through Ray as well
            ray.kill(dead)
        except Exception as e:  # noqa: BLE001 - already gone for good
            log.debug("ray.kill of a dead sandbox host: %r", e)
        nodes = sandbox_nodes() if self.namespace is not None else {}
        if node_id not in nodes:
            return
        deadline = time.monotonic() + wait_s
        while True:  # the dead host's name is freed shortly after
            host = self._host_on(node_id, nodes[node_id])
            try:
                ray.get(host.stats.remote())
            except RayActorError as e:
                if time.monotonic() > deadline:
                    raise SandboxUnavailableError(
                        f"could not start a new sandbox host on node {node_id} within "
                        f"{wait_s:g} s ({e}); check the node's Ray logs"
                    ) from e
                time.sleep(0.2)
                continue
            self.hosts[node_id] = host
            log.warning("codefleet: started a new sandbox host on node %s in place of a dead one", node_id)
            return

    def _refresh_if_due(self, now: bool = False) -> None:
        """`refresh()` every REFRESH_S (or `now`), so that a node that joined gets a host, and a node whose host
        could not be replaced in time gets one again; a cluster with no sandbox capacity at the moment is left to
        the caller's error."""
        if self.namespace is None or not (now or time.monotonic() - self._refreshed_at >= REFRESH_S):
            return
        self._refreshed_at = time.monotonic()
        try:
            self.refresh()
        except SandboxUnavailableError as e:
            log.warning("codefleet: %s", e)

    def stats(self) -> dict[str, HostStats]:
        """The load of every live host, by node id; dead hosts are replaced (or dropped), and nodes that joined
        get a host (at most every REFRESH_S)."""
        self._refresh_if_due()
        refs = {node_id: host.stats.remote() for node_id, host in self.hosts.items()}
        out: dict[str, HostStats] = {}
        for node_id, ref in refs.items():
            try:
                out[node_id] = ray.get(ref)
            except RayActorError:
                self._replace(node_id)
                if node_id in self.hosts:
                    out[node_id] = ray.get(self.hosts[node_id].stats.remote())
        return out

    def create(self, repo: str | None = None, config: SandboxConfig | None = None) -> RemoteSandbox:
        """A new sandbox on the host with the most free capacity. `repo` is a path on that host's node."""
        for attempt in range(2):  # a second round if a host died under us (stats() replaces it) or none had room
            if attempt:
                self._refresh_if_due(now=True)  # a node may have joined, or a lost host be back
            stats, host_died = self.stats(), False
            for node_id in most_free_first(stats):
                host = self.hosts[node_id]
                try:
                    sandbox_id, info = _get(host.create.remote(repo, config), node_id)
                except SandboxCapacityError:  # filled up since stats(): try the next host
                    continue
                except SandboxDeadError:
                    host_died = True
                    continue
                return RemoteSandbox(host, node_id, sandbox_id, info)
            if not host_died and self.namespace is None:
                break
        raise _fleet_full(stats)

    async def acreate(self, repo: str | None = None, config: SandboxConfig | None = None) -> RemoteSandbox:
        """`create` for async code (runs in a worker thread)."""
        return await asyncio.to_thread(self.create, repo, config)

    def warm(self, repo: str | None, config: SandboxConfig | None, size_per_host: int) -> None:
        """Keep `size_per_host` sandboxes of (repo, config) started on every host."""
        refs = {node_id: host.warm.remote(repo, config, size_per_host) for node_id, host in self.hosts.items()}
        for node_id, ref in refs.items():
            _get(ref, node_id)

    def shutdown(self, reap_timeout_s: float = 60.0) -> None:
        """Close every sandbox on every host, stop the hosts, then reap every node: what a host killed earlier left
        (mounts, processes, cgroups) is cleaned up now, since nothing else may start there again. A managed fleet
        also stops the hosts in its namespace that another copy of it started (a rollout worker's, on a node that
        joined later): left to Ray at the job's end they would be killed with their sandboxes' mounts in place."""
        nodes, hosts = set(self.hosts), list(self.hosts.values())
        if self.namespace is not None:
            nodes |= set(sandbox_nodes())
            # the host that has the name now, besides the handle this copy holds: another copy (a rollout
            # worker's) may have replaced a host this one still knows as dead, and that replacement holds sandboxes
            for node_id in nodes:
                try:
                    named = ray.get_actor(host_name(node_id), namespace=self.namespace)
                except ValueError:  # no host there
                    continue
                if named not in hosts:  # handles compare by actor id
                    hosts.append(named)
        refs = [host.shutdown.remote() for host in hosts]
        for ref in refs:
            try:
                ray.get(ref)
            except RayActorError:
                pass
        for host in hosts:
            ray.kill(host)
        self.hosts = {}
        _reap_nodes(nodes, reap_timeout_s)


def _reap_nodes(node_ids: set[str], timeout_s: float) -> None:
    """Run `reap_node` on every live node of `node_ids`; a node that does not answer in time is said, not raised."""
    alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    refs = {
        reap_node.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(): node_id
        for node_id in node_ids & alive
    }
    if not refs:
        return
    done, late = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
    for ref in done:
        try:
            reaped = ray.get(ref)
        except ray.exceptions.RayError as e:
            log.warning("codefleet: reaping dead sandbox hosts' state on node %s failed: %s", refs[ref], e)
            continue
        if reaped:
            log.warning(
                "codefleet: reaped %d dead sandbox host(s) on node %s: %s", len(reaped), refs[ref], ", ".join(reaped)
            )
    for ref in late:
        log.warning(
            "codefleet: reaping dead sandbox hosts' state on node %s did not finish in %g s; the next host "
            "that starts there reaps it",
            refs[ref],
            timeout_s,
        )


def most_free_first(stats: dict[str, HostStats]) -> list[str]:
    """Node ids of the hosts with room, the most free slots first."""
    return [node_id for node_id, s in sorted(stats.items(), key=lambda kv: -kv[1].free) if s.free > 0]


def _fleet_full(stats: dict[str, HostStats]) -> SandboxCapacityError:
    used = sum(s.capacity - s.free for s in stats.values())
    total = sum(s.capacity for s in stats.values())
    return SandboxCapacityError(
        f"every sandbox host is full ({used} of {total} slots in use on {len(stats)} node(s)); close sandboxes "
        f"you no longer need, {ADD_CAPACITY_HINT}"
    )
