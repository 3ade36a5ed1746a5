"""Per-sandbox cgroups on v1 (per-controller hierarchies) and v2 (unified).

Each sandbox gets `codefleet/<owner>/<sandbox>` below the cgroup the host
process already lives in (so delegated subtrees work), with memory, pids
and CPU-bandwidth limits. When no controller is writable — no root, no
delegation — `available()` is false and the sandbox falls back to rlimits.
"""

from __future__ import annotations

import logging
import os
import signal
import stat
import time

log = logging.getLogger(__name__)

ROOT = "/sys/fs/cgroup"
_V1_CONTROLLERS = ("memory", "pids", "cpu")


def _own_path(controller: str | None) -> str:
    """This process's cgroup path in `controller`'s hierarchy (None: v2)."""
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if (controller is None and ctrls == "") or (controller and controller in ctrls.split(",")):
                return path
    return "/"


def _mode() -> str:
    if os.path.exists(os.path.join(ROOT, "cgroup.controllers")):
        return "v2"
    if all(os.path.isdir(os.path.join(ROOT, c)) for c in _V1_CONTROLLERS):
        return "v1"
    return "none"


class CgroupTree:
    """The `codefleet/<owner>` subtree(s) of one host process."""

    def __init__(self, owner: str, create: bool = True):
        """`create=False`: only a view of the owners' cgroups (for a reaper that owns none), nothing made."""
        self.owner = owner
        self.mode = _mode()
        self.bases: dict[str, str] = {}  # controller ("" on v2) -> directory of codefleet/<owner>
        if self.mode == "v1":
            for c in _V1_CONTROLLERS:
                self.bases[c] = os.path.join(ROOT, c, _own_path(c).lstrip("/"), "codefleet", owner)
        elif self.mode == "v2":
            self.bases[""] = os.path.join(ROOT, _own_path(None).lstrip("/"), "codefleet", owner)
        self.ok = self._prepare() if create else False

    def _prepare(self) -> bool:
        if not self.bases:
            return False
        try:
            for base in self.bases.values():
                os.makedirs(base, exist_ok=True)
            if self.mode == "v2":
                # Enable controllers down the path; fails if the parent has processes (no delegation).
                parent = os.path.dirname(self.bases[""])
                for d in (os.path.dirname(parent), parent, self.bases[""]):
                    with open(os.path.join(d, "cgroup.subtree_control"), "w") as f:
                        f.write("+memory +pids +cpu")
        except OSError:
            return False
        return True

    def create(self, name: str, memory_mb: int, max_processes: int, cpu_cores: float) -> Cgroup | None:
        if not self.ok:
            return None
        paths = {c: os.path.join(base, name) for c, base in self.bases.items()}
        try:
            for p in paths.values():
                os.mkdir(p)
            cg = Cgroup(self.mode, paths)
            cg.set_limits(memory_mb, max_processes, cpu_cores)
            return cg
        except OSError as e:
            # said, not raised: the sandbox still runs, its limits enforced by rlimits instead
            log.warning(
                "codefleet: could not create cgroup %s (%s); this sandbox's limits fall back to rlimits", name, e
            )
            Cgroup(self.mode, paths).remove()
            return None

    def other_owners(self) -> dict[str, float]:
        """Owners with cgroups beside ours: name -> when their directory last changed
        (the latest mtime across controllers, seconds since the epoch)."""
        found: dict[str, float] = {}
        for base in self.bases.values():
            parent = os.path.dirname(base)
            try:
                names = os.listdir(parent)
            except OSError:
                continue
            for name in names:
                try:
                    st = os.stat(os.path.join(parent, name))
                except OSError:
                    continue
                if name != self.owner and stat.S_ISDIR(st.st_mode):
                    found[name] = max(found.get(name, 0.0), st.st_mtime)
        return found

    def stale_groups(self, other_owner: str) -> list[Cgroup]:
        """Cgroups left by a dead owner (for the reaper)."""
        groups = []
        names: set[str] = set()
        dirs = {c: os.path.join(os.path.dirname(base), other_owner) for c, base in self.bases.items()}
        for d in dirs.values():
            try:
                names.update(n for n in os.listdir(d) if os.path.isdir(os.path.join(d, n)))
            except OSError:
                pass
        for n in names:
            groups.append(Cgroup(self.mode, {c: os.path.join(d, n) for c, d in dirs.items()}))
        groups.append(Cgroup(self.mode, dirs))  # the owner directory itself, removed last
        return groups

    def remove(self) -> None:
        Cgroup(self.mode, dict(self.bases)).remove()


class Cgroup:
    def __init__(self, mode: str, paths: dict[str, str]):
        self.mode = mode
        self.paths = paths

    def _write(self, controller: str, name: str, value: str) -> None:
        with open(os.path.join(self.paths[controller], name), "w") as f:
            f.write(value)

    def set_limits(self, memory_mb: int, max_processes: int, cpu_cores: float) -> None:
        mem = str(memory_mb * 1024 * 1024)
        period = 100_000
        quota = str(max(int(cpu_cores * period), 1000))
        if self.mode == "v1":
            self._write("memory", "memory.limit_in_bytes", mem)
            try:  # no swap either, where swap accounting exists
                self._write("memory", "memory.memsw.limit_in_bytes", mem)
            except OSError:
                pass
            self._write("pids", "pids.max", str(max_processes))
            self._write("cpu", "cpu.cfs_period_us", str(period))
            self._write("cpu", "cpu.cfs_quota_us", quota)
        else:
            self._write("", "memory.max", mem)
            try:
                self._write("", "memory.swap.max", "0")
            except OSError:
                pass
            self._write("", "pids.max", str(max_processes))
            self._write("", "cpu.max", f"{quota} {period}")

    def add(self, pid: int) -> None:
        for p in self.paths.values():
            with open(os.path.join(p, "cgroup.procs"), "w") as f:
                f.write(str(pid))

    def procs(self) -> set[int]:
        path = self.paths.get("pids") or self.paths.get("")
        if path is None:
            return set()
        try:
            with open(os.path.join(path, "cgroup.procs"), "rb") as f:
                return {int(x) for x in f.read().split()}
        except OSError:
            return set()

    def oom_kills(self) -> int:
        """How many processes the memory limit has killed so far."""
        path = self.paths.get("memory") or self.paths.get("")
        name = "memory.oom_control" if self.mode == "v1" else "memory.events"
        try:
            with open(os.path.join(path or "", name)) as f:
                for line in f:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except OSError:
            pass
        return 0

    def kill_all(self) -> None:
        if self.mode == "v2":
            try:
                self._write("", "cgroup.kill", "1")
                return
            except OSError:
                pass
        for _ in range(50):  # a fork bomb may still be forking: repeat until empty
            pids = self.procs()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)

    def remove(self, timeout_s: float = 2.0) -> None:
        """Kill what is left and remove the directories (retrying while processes exit)."""
        self.kill_all()
        deadline = time.monotonic() + timeout_s
        for p in self.paths.values():
            while os.path.isdir(p):
                try:
                    os.rmdir(p)
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    self.kill_all()
                    time.sleep(0.005)
