"""Small helpers shared by the sandbox tests."""

from __future__ import annotations

import functools
import glob
import hashlib
import os
import secrets
import stat
import time

import pytest

from codefleet.sandbox import procs
from codefleet.sandbox.bwrap import unavailable_reason
from codefleet.sandbox.layers import mounts_under
from codefleet.sandbox.vm import vm_unavailable_reason

# The backends the sandbox suite runs against, as values of the `sandbox_backend` fixture (conftest.py):
# `make test` runs the namespace one, `make test-vm` (-m vm) the vm one. A module of the suite overrides the
# fixture with these params; a test there about one backend's internals says so with `namespace_only`, and a
# test elsewhere that keeps the contract says `every_backend`. A vm's commands may run 10-100 times slower (under
# TCG, without a usable KVM): its tests get a longer timeout than their modules give.
BACKENDS = ("namespace", pytest.param("vm", marks=[pytest.mark.vm, pytest.mark.timeout(300)]))
every_backend = pytest.mark.parametrize("sandbox_backend", BACKENDS)
namespace_only = pytest.mark.parametrize("sandbox_backend", ["namespace"])

# What a vm sandbox of the suite is given: each (memory, vCPUs, disk) shape boots a template of its own once,
# ~10 s under TCG, so the tests share this one where they can; a small VM also forks faster.
VM_SHAPE = {"memory_mb": 512}


@functools.cache
def backend_unavailable(backend: str) -> str | None:
    """Why this host cannot make sandboxes of `backend`, or None ('auto' and 'local' always can)."""
    if backend == "namespace":
        return unavailable_reason()
    if backend == "vm":
        return vm_unavailable_reason()
    return None


def tree_digest(root: str) -> str:
    """A hash of everything a sandbox could change in a directory tree: names,
    types, modes, file contents and symlink targets."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            h.update(f"{os.path.relpath(path, root)}\0{st.st_mode:o}\0".encode())
            if stat.S_ISLNK(st.st_mode):
                h.update(os.readlink(path).encode())
            elif stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def read_tree(root: str) -> dict[str, str]:
    """Every text file under `root` (outside .git) by relative path, newlines kept as written."""
    files = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d != ".git"]
        for name in filenames:
            path = os.path.join(dirpath, name)
            with open(path, encoding="utf-8", newline="") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


# -- what is running and what is left on the host --------------------------------------


def unique_sleep() -> str:
    """A `sleep` argument no other process on the machine has: its cmdline is our marker."""
    return f"1000.{secrets.randbelow(10**9):09d}"


def processes_with(marker: str) -> list[int]:
    """Host pids whose command line contains `marker` (never this process)."""
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        pid = int(path.split("/")[2])
        try:
            with open(path, "rb") as f:
                if marker.encode() in f.read() and pid != os.getpid():
                    found.append(pid)
        except OSError:
            pass
    return found


def running(sb, marker: str) -> list[int]:
    """Pids of the processes whose command line holds `marker`, looked for where `sb`'s processes run: the
    whole host for a namespace sandbox (never this process), the guest for a vm one."""
    if sb.backend != "vm":
        return processes_with(marker)
    return [int(pid) for pid in sb.run_oneoff(["pgrep", "-f", marker], timeout_s=30).output.split()]


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def sandbox_pids(sb) -> set[int]:
    """Every host process of a sandbox: a namespace one's outer bwrap, its PID 1 and what runs below; a vm
    one's QEMU."""
    if sb.backend == "vm":
        return {sb.vm.proc.pid} if sb.vm is not None and sb.vm.proc.poll() is None else set()
    if sb.cgroup is not None:
        return set(sb.cgroup.procs())
    return {pid for pid, _ in sb._pids} | procs.descendants(sb._init_pid)


def footprint(sb) -> dict:
    """Everything of `sb` on the host: directory, cgroups, processes (pid, start time)."""
    cgroup = getattr(sb, "cgroup", None)  # a vm sandbox has none: its VM is the limit
    return {
        "dir": sb.dir,
        "cgroups": list(cgroup.paths.values()) if cgroup else [],
        "procs": [(pid, procs.start_time(pid)) for pid in sandbox_pids(sb)],
    }


def needs_cgroup(sb) -> None:
    """Skip a test of cgroup limits where this user could make no cgroup (they are rlimits then). A vm
    sandbox needs none: its memory is the VM's."""
    if sb.backend != "vm" and sb.cgroup is None:
        pytest.skip(
            "no cgroup could be made here (an unprivileged user without a delegated cgroup): limits are rlimits"
        )


def assert_released(prints: list[dict]) -> None:
    """Nothing of these sandboxes is left: no process, mount, cgroup or directory."""
    mounts = mounts_under("/")
    for fp in prints:
        alive = [pid for pid, started in fp["procs"] if started is not None and procs.start_time(pid) == started]
        assert not alive, f"processes of a closed sandbox are still running: {alive}"
        assert not [m for m in mounts if (m + "/").startswith(fp["dir"] + "/")], f"mounts left under {fp['dir']}"
        assert not os.path.exists(fp["dir"]), f"directory left: {fp['dir']}"
        left = [p for p in fp["cgroups"] if os.path.exists(p)]
        assert not left, f"cgroups left: {left}"
