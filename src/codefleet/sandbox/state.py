"""Where sandboxes keep their state, and the reaper that cleans up after crashes.

Every host process that creates sandboxes is an *owner*: it gets
`<state_dir>/<owner>/` holding a `lock` file it flocks for its whole life,
its sandboxes' directories (mount points) and its frozen fork layers, and
the cgroups `codefleet/<owner>/...`. Sandboxes are tied to their owner by
bwrap's --die-with-parent, so when an owner dies (even by SIGKILL) their
processes die with it; what is left — mounts, cgroups, directories — is
reaped by the next owner that starts on the machine (or by `reap_dead_owners`,
which a sandbox fleet's shutdown runs on every node): an owner directory
whose lock nobody holds belongs to a dead process. Not quite all die: an
owner killed while it starts a sandbox can leave that sandbox's bwrap (PID 1
of its namespace) running, before its pids were recorded; the reaper kills
every process running under the dead owner's process name (`process_name`),
the argv[0] of each of its bwraps: a digest of the owner's name, so that what
a sandbox reads as its PID 1's command line names no host path and no pid.

A dead owner's state directory may never be visited again: a test run's
private one, deleted since around the mounts it could not delete (lock file
included). So a starting owner also looks at what owners hold on the whole
machine, workspace mounts (`<owner>/sb/<sandbox>/rw|merged`) and cgroups
beside its own with no process left in them, and reaps those whose owner is
gone: no process has the pid in the owner's name, or the one that has it
started at another kernel time than the name records (the pid was reused).
Owner names are `<pid>-<start ticks>-<6 hex>`: liveness is read from /proc
alone, never from file times, which a wall-clock step can make disagree.

The state directory must not be visible inside sandboxes (it is not: only
/usr, /etc and the workspace are bound in). Where sandboxes run as another
host user (identity.py), that user's bwrap must reach the workspaces and the
files it binds: the state directory is then mode 0710, its group the sandbox
user's, so that user may walk through it but not list it, and nobody else
may enter it. It is, by default,
/var/lib/codefleet for root and $XDG_RUNTIME_DIR/codefleet (or
/tmp/codefleet-<uid>) otherwise; `CODEFLEET_STATE_DIR` overrides it.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import json
import logging
import os
import re
import threading
import weakref

from codefleet.sandbox import cgroups, layers, procs

log = logging.getLogger(__name__)


def default_state_dir() -> str:
    if os.environ.get("CODEFLEET_STATE_DIR"):
        return os.environ["CODEFLEET_STATE_DIR"]
    if os.geteuid() == 0:
        return "/var/lib/codefleet"
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(runtime, "codefleet") if runtime else f"/tmp/codefleet-{os.getuid()}"


class Owner:
    """This process's claim on a state directory. One per (process, state dir)."""

    def __init__(self, state_dir: str):
        self.state_dir = os.path.abspath(state_dir)
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self.pid = os.getpid()
        # pid and kernel start time (clock ticks since boot) identify this process exactly, whatever the
        # wall clock does: a reaper compares them with /proc, never with file times (no /proc: the old form)
        started = procs.start_time(self.pid)
        self.name = f"{self.pid}-{'' if started is None else f'{started}-'}{os.urandom(3).hex()}"
        self.dir = os.path.join(self.state_dir, self.name)
        self.process_name = process_name(self.name)
        os.makedirs(os.path.join(self.dir, "sb"))
        os.makedirs(os.path.join(self.dir, "layers"))
        self._lock_fd = os.open(os.path.join(self.dir, "lock"), os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.cgroups = cgroups.CgroupTree(self.name)
        self._live: weakref.WeakSet = weakref.WeakSet()
        self.shared_with_gid: int | None = None
        self.reaped = self.reap_dead()

    def reap_dead(self) -> list[str]:
        """Clean up after every dead owner this one can see (its state directory, and what owners hold on the whole
        machine); the names reaped. Run when the owner starts, and again by a sandbox host that shuts down, for an
        owner that died while this one was running."""
        return _reap_all(self.state_dir, self.cgroups)

    def let_through(self, gid: int) -> None:
        """Let group `gid` (the sandbox user's) walk through the state directory, and nobody else."""
        if self.shared_with_gid != gid:
            os.chown(self.state_dir, -1, gid)
            os.chmod(self.state_dir, 0o710)
            self.shared_with_gid = gid

    def track(self, sandbox: object) -> None:
        """Remember a sandbox so that a normal interpreter exit closes it."""
        self._live.add(sandbox)

    def untrack(self, sandbox: object) -> None:
        """Forget a sandbox that was closed."""
        self._live.discard(sandbox)

    def close_all(self) -> None:
        for sb in list(self._live):
            try:
                sb.close()
            except Exception as e:  # exiting anyway: the reaper gets the rest
                log.warning("codefleet: closing %s at exit failed: %s", sb, e)

    def release(self) -> None:
        """Forget this owner (all its sandboxes must be closed)."""
        try:
            self.cgroups.remove()
            layers.remove_tree(self.dir)
        finally:
            os.close(self._lock_fd)


def reap_dead_owners(state_dir: str | None = None) -> list[str]:
    """Clean up after every dead owner on this machine: those under `state_dir` (default: this process's), and
    those found by what they hold anywhere (Owner.reap_dead), without becoming an owner; the names reaped. For a
    process that starts no sandbox of its own: a fleet's shutdown, on a node whose host was killed."""
    state_dir = os.path.abspath(state_dir or default_state_dir())
    if not os.path.isdir(state_dir):
        return reap_orphans(cgroups.CgroupTree(_REAPER, create=False))
    return _reap_all(state_dir, cgroups.CgroupTree(_REAPER, create=False))


_REAPER = "reaper"  # the cgroup view of a reaper that is no owner (not an owner's name: never reaped itself)


def _reap_all(state_dir: str, tree: cgroups.CgroupTree) -> list[str]:
    return reap(state_dir, tree) + reap_orphans(tree)


def reap(state_dir: str, tree: cgroups.CgroupTree) -> list[str]:
    """Clean up every dead owner under `state_dir`; return the names reaped."""
    reaped = [name for name in sorted(os.listdir(state_dir)) if _reap_if_dead(os.path.join(state_dir, name), tree)]
    if reaped:
        log.warning("codefleet: reaped state of %d dead sandbox owner(s) in %s", len(reaped), state_dir)
    return reaped


def reap_orphans(tree: cgroups.CgroupTree) -> list[str]:
    """Clean up dead owners found by what they hold on the whole machine, whatever
    their state directory: workspace mounts anywhere, cgroups beside ours."""
    reaped = []
    for point in layers.mounts_under("/"):
        found = _WORKSPACE_MOUNT.fullmatch(point)
        if found and found["name"] not in reaped + [tree.owner] and _reap_if_dead(found["dir"], tree):
            reaped.append(found["name"])
    for name, changed_at in tree.other_owners().items():
        if name in reaped or _owner_alive(name, changed_at):
            continue
        groups = tree.stale_groups(name)
        if any(group.procs() for group in groups):
            continue  # something still runs there: only a lock can say whose it is
        for group in groups:
            group.remove(timeout_s=1.0)
        reaped.append(name)
    if reaped:
        log.warning("codefleet: reaped %d dead sandbox owner(s) outside this state directory", len(reaped))
    return reaped


# Owner.name: "<pid>-<start ticks>-<6 hex>"; "<pid>-<6 hex>" from older versions (no start time)
_OWNER_NAME = re.compile(r"(?P<pid>\d+)-(?:(?P<ticks>\d+)-)?[0-9a-f]{6}")
# what an owner mounts: a sandbox's upper layer, workspace and repository view; a frozen layer
_WORKSPACE_MOUNT = re.compile(
    rf"(?P<dir>.*/(?P<name>{_OWNER_NAME.pattern}))/"
    r"(sb/sb-[0-9a-f]{10}/(rw|merged|repo)|layers/l[0-9a-f]{8})"
)


def _reap_if_dead(owner_dir: str, tree: cgroups.CgroupTree) -> bool:
    """Reap the owner whose directory is `owner_dir` if it is dead; True if it was."""
    name = os.path.basename(owner_dir)
    try:
        fd = os.open(os.path.join(owner_dir, "lock"), os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        # No lock: an owner still being created, or one whose state directory
        # was deleted around its mounts after it died. Its pid tells which.
        try:
            changed_at = os.stat(owner_dir).st_mtime
        except OSError:
            return False
        if _owner_alive(name, changed_at):
            return False
        _reap_owner(owner_dir, name, tree)
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False  # alive: its owner holds the lock
    else:
        _reap_owner(owner_dir, name, tree)
        return True
    finally:
        os.close(fd)


def _owner_alive(name: str, changed_at: float) -> bool:
    """Whether the owner called `name` may still run: in doubt, yes. It is dead if no
    process has its pid, or the one that has it started at another time than the name
    records (the pid was reused). Names without a start time (older owners) fall back
    to the time their directory or cgroup last changed, `changed_at`: dead if the pid's
    process started after it. That compares boot-relative ticks with the wall clock,
    which a clock step (NTP on a fresh machine) can throw off; the ticks cannot be."""
    parts = _OWNER_NAME.fullmatch(name)
    if not parts:
        return True  # not an owner's: not ours to remove
    started_ticks = procs.start_time(int(parts["pid"]))
    if started_ticks is None:
        return False
    if parts["ticks"] is not None:
        return started_ticks == int(parts["ticks"])
    started_at = _boot_time() + started_ticks / os.sysconf("SC_CLK_TCK")
    return started_at <= changed_at + 1.0  # btime is in whole seconds


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


def _reap_owner(owner_dir: str, name: str, tree: cgroups.CgroupTree) -> None:
    sb_root = os.path.join(owner_dir, "sb")
    for sb in os.listdir(sb_root) if os.path.isdir(sb_root) else []:
        meta = os.path.join(sb_root, sb, "pids.json")
        try:
            with open(meta) as f:
                for pid, started in json.load(f):
                    procs.kill_if_same(pid, started)
        except (OSError, ValueError):
            pass
    # a bwrap whose owner died before recording its pids (killed while starting a sandbox) outlives
    # --die-with-parent as its PID namespace's init; every bwrap of the owner runs under its process name
    _kill_named(process_name(name))
    for group in tree.stale_groups(name):
        group.remove(timeout_s=1.0)
    for point in layers.mounts_under(owner_dir):
        try:
            layers.umount(point)
        except OSError as e:
            log.warning("codefleet: could not unmount %s: %s", point, e)
    layers.remove_tree(owner_dir)


def process_name(owner_name: str) -> str:
    """The argv[0] of every bwrap of the owner called `owner_name`, which its sandboxes read as their PID 1's:
    "bwrap-" and 16 hex digits of a digest of the name, unique to the owner like its name, naming no path or pid."""
    return "bwrap-" + hashlib.sha256(owner_name.encode()).hexdigest()[:16]


def _kill_named(argv0: str) -> None:
    """SIGKILL every process whose argv[0] is `argv0`."""
    needle = os.fsencode(argv0) + b"\0"
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read(len(needle)) == needle:
                    os.kill(int(entry), 9)
        except OSError:  # gone meanwhile, or not ours to read
            continue


_owners: dict[str, Owner] = {}
_owners_lock = threading.Lock()


def owner_for(state_dir: str | None, let_through_gid: int | None = None) -> Owner:
    """The process-wide owner for `state_dir` (created, and the reaper run, on first use);
    `let_through_gid`: see Owner.let_through."""
    key = os.path.abspath(state_dir or default_state_dir())
    with _owners_lock:
        owner = _owners.get(key)
        if owner is None or owner.pid != os.getpid():
            owner = Owner(key)
            _owners[key] = owner
        if let_through_gid is not None:
            owner.let_through(let_through_gid)
        return owner


@atexit.register
def _release_all() -> None:
    for owner in list(_owners.values()):
        if owner.pid == os.getpid():
            owner.close_all()
            owner.release()
    _owners.clear()
