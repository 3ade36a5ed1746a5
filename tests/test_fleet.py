"""The sandbox fleet on a real local Ray: hosts, the client, errors across the wire, host death."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from codefleet.fleet import HostCore, HostStats, RemoteSandbox, SandboxCapacityError, SandboxFleet, SandboxHost
from codefleet.fleet.sandbox_fleet import most_free_first
from codefleet.sandbox import PathEscapeError, Sandbox, SandboxClosedError, SandboxDeadError


@pytest.fixture(scope="module")
def fleet(ray_session):
    fleet = SandboxFleet.start(namespace="codefleet-test-fleet")
    yield fleet
    fleet.shutdown()


@pytest.fixture
def small_fleet(ray_session):
    """A fleet of one host with a small capacity (given to the actor, not read from the node)."""
    fleets = []

    def make(capacity: int) -> tuple[SandboxFleet, str]:
        host = SandboxHost.remote(capacity=capacity)
        node_id = ray_session.get(host.stats.remote()).node_id
        fleets.append(SandboxFleet({node_id: host}))
        return fleets[-1], node_id

    yield make
    for f in fleets:
        f.shutdown()


def test_create_exec_keeps_shell_state_and_close_frees_the_slot(fleet, repo, config):
    node_id = next(iter(fleet.hosts))
    before = fleet.stats()[node_id]
    assert before.capacity == 64  # the ray_session's `sandbox` resource
    sb = fleet.create(repo, config)
    assert isinstance(sb, Sandbox) and isinstance(sb, RemoteSandbox)
    assert fleet.stats()[node_id].live == before.live + 1
    assert sb.exec("cd pkg && export GREETING=hi").ok
    result = sb.exec("pwd; echo $GREETING; cat calc.py | head -1")
    assert result.output.split("\n")[:3] == [f"{sb.info.workspace}/pkg", "hi", "def add(a, b):"]
    assert sb.alive()
    sb.close()
    sb.close()  # idempotent
    assert not sb.alive()
    assert fleet.stats()[node_id].live == before.live
    with pytest.raises(SandboxClosedError, match="closed"):
        sb.exec("true")


def test_file_api_and_search_round_trip(fleet, repo, config):
    with fleet.create(repo, config) as sb:
        sb.write_file("notes/todo.txt", "one\ntwo\nthree\n")
        assert sb.read_file("notes/todo.txt", start_line=2, end_line=3) == "two\nthree\n"
        paths = {e.path for e in sb.list_dir(".", recursive=True)}
        assert {"notes/todo.txt", "pkg/calc.py", "README.md"} <= paths
        matches = sb.search(r"def (add|sub)")
        assert sorted((m.path, m.line_number) for m in matches) == [("pkg/calc.py", 1), ("pkg/calc.py", 5)]
        assert sb.run_oneoff(["cat", "notes/todo.txt"]).output == "one\ntwo\nthree\n"
        assert sb.exec("wc -l < notes/todo.txt").output.strip() == "3"


def test_fork_stays_on_the_host_with_independent_workspaces(fleet, repo, config):
    with fleet.create(repo, config) as parent:
        parent.write_file("state.txt", "base\n")
        parent.exec("export ROUND=1")
        children = parent.fork(2)
        try:
            assert len({c.id for c in children} | {parent.id}) == 3
            assert all(c.node_id == parent.node_id for c in children)
            for i, child in enumerate(children):
                child.write_file("state.txt", f"child {i}\n")
            parent.write_file("state.txt", "parent\n")
            assert [c.read_file("state.txt") for c in children] == ["child 0\n", "child 1\n"]
            assert parent.read_file("state.txt") == "parent\n"
            assert children[1].exec("echo $ROUND").output.strip() == "1"
        finally:
            for child in children:
                child.close()


def test_sandbox_errors_come_back_as_themselves(fleet, repo, config):
    sb = fleet.create(repo, config)
    with pytest.raises(PathEscapeError) as caught:
        sb.read_file("../../etc/passwd")
    assert type(caught.value) is PathEscapeError
    assert "RayTaskError" not in str(caught.value) and str(caught.value)
    with pytest.raises(FileNotFoundError):
        sb.read_file("no/such/file.txt")
    with pytest.raises(FileNotFoundError, match="no/such/repo"):
        fleet.create("/no/such/repo", config)
    assert fleet.stats()[sb.node_id].pending == 0  # the failed create gave its slot back
    sb.close()
    with pytest.raises(SandboxClosedError) as closed:
        asyncio.run(sb.aexec("true"))
    assert type(closed.value) is SandboxClosedError and sb.id in str(closed.value)


def test_host_refuses_beyond_capacity_with_a_clear_error(small_fleet, repo, config):
    small, node_id = small_fleet(capacity=2)
    first, second = small.create(repo, config), small.create(repo, config)
    with pytest.raises(SandboxCapacityError, match=r"full \(2 of 2 slots.*close sandboxes"):
        small.create(repo, config)
    with pytest.raises(SandboxCapacityError, match=r"is full: 2 of 2 slots in use, 1 more wanted"):
        first.fork(1)
    second.close()
    third = small.create(repo, config)
    assert third.exec("echo ok").output.strip() == "ok"
    assert small.stats()[node_id].live == 2


def test_warm_pool_counts_against_capacity_and_serves_creates(small_fleet, repo, config):
    small, node_id = small_fleet(capacity=3)
    small.warm(repo, config, size_per_host=2)
    deadline = time.monotonic() + 20
    while small.stats()[node_id].ready < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = small.stats()[node_id]
    assert (stats.warm, stats.ready, stats.free) == (2, 2, 1)
    sb = small.create(repo, config)
    assert sb.read_file("README.md") == "# demo\n"
    with pytest.raises(SandboxCapacityError):
        small.create(repo, config)  # 1 live + 2 warm = 3


def test_hosts_with_the_most_free_slots_come_first():
    stats = {
        "a": HostStats("a", capacity=4, live=3),
        "b": HostStats("b", capacity=8, live=2, warm=2),
        "c": HostStats("c", capacity=2, live=1, pending=1),
    }
    assert most_free_first(stats) == ["b", "a"]  # c is full: 1 live + 1 being created


def test_remote_sandbox_travels_into_a_ray_task(ray_session, fleet, repo, config):
    @ray_session.remote(num_cpus=0)
    def edit(sb: RemoteSandbox) -> str:
        sb.exec("echo from-task > task.txt")
        return sb.read_file("README.md")

    with fleet.create(repo, config) as sb:
        assert ray_session.get(edit.remote(sb)) == "# demo\n"
        assert sb.read_file("task.txt") == "from-task\n"


def test_eight_sandboxes_run_commands_concurrently(fleet, repo, config):
    async def create_eight() -> list[RemoteSandbox]:
        return list(await asyncio.gather(*(fleet.acreate(repo, config) for _ in range(8))))

    sandboxes = asyncio.run(create_eight())
    try:
        assert len({sb.id for sb in sandboxes}) == 8

        async def all_at_once() -> list[str]:
            results = await asyncio.gather(*(sb.aexec(f"sleep 1; echo {i}") for i, sb in enumerate(sandboxes)))
            return [r.output.strip() for r in results]

        started = time.perf_counter()
        outputs = asyncio.run(all_at_once())
        elapsed_s = time.perf_counter() - started
        assert outputs == [str(i) for i in range(8)]
        assert elapsed_s < 4.0, f"8 x `sleep 1` took {elapsed_s:.1f} s: commands ran one after another"
    finally:
        for sb in sandboxes:
            sb.close()


def test_dead_host_gives_a_clear_error_and_is_replaced(ray_session, repo, config):
    fleet = SandboxFleet.start(namespace="codefleet-test-death")
    try:
        sb = fleet.create(repo, config)
        old_pid = fleet.stats()[sb.node_id].pid
        ray_session.kill(fleet.hosts[sb.node_id])
        dead = r"sandbox host on node \w+ died; its sandboxes are gone — create new ones"
        with pytest.raises(SandboxDeadError, match=dead):
            sb.exec("true")
        assert not sb.alive()
        sb.close()  # nothing left to close: no error
        fresh = fleet.create(repo, config)
        assert fresh.exec("cat README.md").output == "# demo\n"
        assert fleet.stats()[fresh.node_id].pid != old_pid
    finally:
        fleet.shutdown()


def test_a_host_whose_process_was_killed_is_replaced_at_once(ray_session, repo, config):
    """SIGKILL, as the OOM killer does (not ray.kill): the dead host keeps its name until the fleet kills it through
    Ray too, so the replacement gets the name at once instead of the old, dead handle for 30 s."""
    fleet = SandboxFleet.start(namespace="codefleet-test-sigkill")
    try:
        sb = fleet.create(repo, config)
        old_pid = fleet.stats()[sb.node_id].pid
        os.kill(old_pid, signal.SIGKILL)
        t0 = time.monotonic()
        fresh = fleet.create(repo, config)
        assert time.monotonic() - t0 < 15
        assert fresh.exec("cat README.md").output == "# demo\n" and fleet.stats()[fresh.node_id].pid != old_pid
    finally:
        fleet.shutdown()


def test_a_fleet_that_lost_its_host_finds_one_again(ray_session, repo, config):
    """A host whose replacement failed (the node looked gone, or the new host did not answer in time) is not lost
    for good: create() looks at the cluster again before it says the fleet is full, as it does every REFRESH_S
    for nodes that joined."""
    fleet = SandboxFleet.start(namespace="codefleet-test-refresh")
    try:
        node_id, host = next(iter(fleet.hosts.items()))
        fleet.hosts.clear()  # what a failed replacement leaves
        sb = fleet.create(repo, config)
        assert sb.node_id == node_id and fleet.hosts == {node_id: host}  # the same named host, found again
        sb.close()
    finally:
        fleet.shutdown()


def test_shutdown_stops_the_hosts_another_copy_of_the_fleet_started(ray_session, repo, config):
    """A rollout worker's fleet may start a host (on a node that joined) that the driver's fleet never saw: the
    driver's shutdown still finds it by name and closes its sandboxes, rather than leaving it to Ray's kill at the
    job's end, which would leave their mounts behind."""
    workers_fleet = SandboxFleet.start(namespace="codefleet-test-shutdown")
    sb = workers_fleet.create(repo, config)
    drivers_fleet = SandboxFleet({}, namespace="codefleet-test-shutdown")  # it never saw that host
    drivers_fleet.shutdown()
    assert not sb.alive()
    with pytest.raises(ray_session.exceptions.RayActorError):  # the host was stopped, not just emptied
        ray_session.get(workers_fleet.hosts[sb.node_id].stats.remote(), timeout=10)


def test_host_core_accounting_without_ray(repo, config):
    core = HostCore("node-x", capacity=1)
    try:
        sandbox_id, info = core.create(repo, config)
        assert info.sandbox_id == sandbox_id and core.stats().free == 0
        with pytest.raises(SandboxCapacityError, match="node-x is full"):
            core.create(repo, config)
    finally:
        core.shutdown()
    assert core.stats().live == 0
    with pytest.raises(SandboxClosedError, match="shut down"):
        core.create(repo, config)


def _mounts_of_owner(state_dir: str, pid: int) -> list[str]:
    """Mount points of the sandbox owner whose process had `pid` (owner directories are named `<pid>-…`)."""
    from codefleet.sandbox import layers

    root = state_dir.rstrip("/") + "/"
    return [m for m in layers.mounts_under(root) if m[len(root) :].startswith(f"{pid}-")]


def test_a_host_killed_with_its_sandboxes_live_leaves_no_mounts_after_shutdown(ray_session, repo, config):
    """SIGKILL a host while its sandboxes (one forked, so with a frozen layer) are live, then shut the fleet down
    at once, as a run does at its end: nothing else starts on that node again, so the shutdown itself must reap the
    dead host's mounts, and the node's state is clean afterwards."""
    fleet = SandboxFleet.start(namespace="codefleet-test-reap")
    try:
        sb = fleet.create(repo, config)
        sb.exec("echo changed > README.md")
        sb.fork(2)
        old_pid = fleet.stats()[sb.node_id].pid
        assert _mounts_of_owner(config.state_dir, old_pid), "the host's sandboxes should be mounted while it lives"
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{old_pid}") and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        fleet.shutdown()
    assert _mounts_of_owner(config.state_dir, old_pid) == []


def test_shutdown_closes_the_sandboxes_of_a_host_another_copy_of_the_fleet_started_in_place_of_a_dead_one(
    ray_session, repo, config
):
    """The driver's fleet still holds a host that a fault killed; a rollout worker's copy replaced it, and the
    replacement holds sandboxes (a killed worker's, never closed). The driver's shutdown must find the replacement
    by its name and close them, or Ray kills it at the job's end with their mounts in place (CI's chaos soak)."""
    drivers = SandboxFleet.start(namespace="codefleet-test-replaced")
    node_id = next(iter(drivers.hosts))
    old_pid = drivers.stats()[node_id].pid
    os.kill(old_pid, signal.SIGKILL)
    workers = SandboxFleet({}, namespace="codefleet-test-replaced")  # a rollout worker's copy
    workers.refresh()
    sb = workers.create(repo, config)  # it finds the dead host and starts the replacement
    new_pid = workers.stats()[node_id].pid
    assert new_pid != old_pid and _mounts_of_owner(config.state_dir, new_pid)
    drivers.shutdown()  # it only knows the dead host
    assert not sb.alive()
    assert _mounts_of_owner(config.state_dir, new_pid) == [] and _mounts_of_owner(config.state_dir, old_pid) == []
