"""The host identity that sandboxed processes run as, and the idmapped view
that lets that identity own a repository it does not own on disk.

Inside a sandbox every command runs as uid 1000 (`agent`). On the host that
uid must be someone who owns nothing: the kernel's own permission checks then
protect the host's files, devices and /proc entries, whatever a command
reaches through /proc/1/exe, a device node or a mask that was forgotten.

- Started as root, codefleet runs each bwrap as the system user
  `codefleet-sandbox` (created by `scripts/setup.sh`; it has no home, no
  shell and owns no file). bwrap then runs unprivileged and maps uid 1000 to
  that user. Without it the namespace backend refuses to start: it never
  maps a sandbox to root.
- Started as any other user, the sandbox runs as that user, who is not root;
  bwrap is that user's own, as before.

The repository a sandbox works on belongs to whoever checked it out (root,
on a training node), and the sandbox user must be able to change it. So the
overlay's bottom layer is an idmapped bind mount of the repository: a file
owned on disk by the repository's owner is seen, and may be changed, as the
sandbox user's. The overlay's upper layer is a tmpfs owned by the sandbox
user, so what a command writes is owned on the host by that user too, never
by root. Idmapped mounts need Linux 5.19 or later and a filesystem that
supports them (ext4, xfs, btrfs, tmpfs...; not NFS or an overlay): a
repository elsewhere gets one clear error.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import pwd
import subprocess
import threading
import time
from dataclasses import dataclass

from codefleet.sandbox.base import SandboxUnavailableError

SANDBOX_USER = "codefleet-sandbox"
CREATE_USER = (
    f"useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin {SANDBOX_USER}"
)


@dataclass(frozen=True)
class Identity:
    """Who a sandbox's processes are on the host."""

    uid: int
    gid: int
    name: str

    @property
    def switches(self) -> bool:
        """True when bwrap must be started as this identity rather than as ourselves."""
        return self.uid != os.geteuid()

    def popen_kwargs(self) -> dict:
        """subprocess.Popen arguments that start a process as this identity."""
        if not self.switches:
            return {}
        return {"user": self.uid, "group": self.gid, "extra_groups": []}


def host_identity() -> Identity:
    """The identity sandboxes run as here; SandboxUnavailableError where there is none but root."""
    if os.geteuid() != 0:
        try:
            name = pwd.getpwuid(os.getuid()).pw_name
        except KeyError:  # a uid with no passwd entry (a container's)
            name = f"uid {os.getuid()}"
        return Identity(os.getuid(), os.getgid(), name)
    try:
        entry = pwd.getpwnam(SANDBOX_USER)
    except KeyError:
        raise SandboxUnavailableError(
            f"codefleet runs sandboxes as the unprivileged system user {SANDBOX_USER!r}, which this host lacks; "
            f"create it with `{CREATE_USER}` (scripts/setup.sh does), or start codefleet as a user other than "
            "root"
        ) from None
    if entry.pw_uid == 0 or entry.pw_gid == 0:
        raise SandboxUnavailableError(
            f"the system user {SANDBOX_USER!r} has uid {entry.pw_uid} and gid "
            f"{entry.pw_gid}; it must not be root: recreate it with `{CREATE_USER}`"
        )
    return Identity(entry.pw_uid, entry.pw_gid, SANDBOX_USER)


# -- idmapped bind mounts --------------------------------------------------------------

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.syscall.restype = ctypes.c_long
_SYS_OPEN_TREE, _SYS_MOVE_MOUNT, _SYS_MOUNT_SETATTR = 428, 429, 442  # the same number on every architecture
_OPEN_TREE_CLONE, _OPEN_TREE_CLOEXEC = 1, os.O_CLOEXEC
_AT_FDCWD, _AT_EMPTY_PATH = -100, 0x1000
_MOUNT_ATTR_RDONLY, _MOUNT_ATTR_NOSUID, _MOUNT_ATTR_NODEV = 0x1, 0x2, 0x4
_MOUNT_ATTR_IDMAP = 0x100000
_MOVE_MOUNT_F_EMPTY_PATH = 0x4


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _check(result: int, what: str, path: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} {path}: {os.strerror(err)}")
    return result


class _MappingNamespaces:
    """One user namespace per (disk uid, disk gid, identity) whose only mapping is disk id -> identity.

    An idmapped mount takes its mapping from a user namespace; this one is made by a
    short-lived `unshare --user` child whose maps we write from outside, and kept open
    (by its fd) for the life of the process."""

    def __init__(self) -> None:
        self._fds: dict[tuple[int, int, int, int], int] = {}
        self._lock = threading.Lock()

    def fd(self, disk_uid: int, disk_gid: int, ident: Identity) -> int:
        key = (disk_uid, disk_gid, ident.uid, ident.gid)
        with self._lock:
            if key not in self._fds:
                try:
                    self._fds[key] = make_userns(f"{disk_uid} {ident.uid} 1\n", f"{disk_gid} {ident.gid} 1\n")
                except OSError as e:
                    raise SandboxUnavailableError(
                        f"could not create a user namespace for the workspace's idmapped view ({e})"
                    ) from None
            return self._fds[key]


def make_userns(uid_map: str, gid_map: str) -> int:
    """A descriptor of a new user namespace with these maps: a child unshares it and waits on its stdin while we
    write its maps from outside (as root: any range), then we keep the namespace by its descriptor. OSError with
    what `unshare` said when the host cannot make one."""
    child = subprocess.Popen(
        ["unshare", "--user", "cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        ours = os.readlink("/proc/self/ns/user")
        deadline = time.monotonic() + 10
        while True:  # until the child has unshared (its user namespace is no longer ours)
            try:
                if os.readlink(f"/proc/{child.pid}/ns/user") != ours:
                    break
            except FileNotFoundError:
                pass
            if child.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"`unshare --user`: {child.stderr.read().decode(errors='replace').strip()[:200]}")
            time.sleep(0.001)
        for name, text in (("uid_map", uid_map), ("gid_map", gid_map)):
            with open(f"/proc/{child.pid}/{name}", "w") as f:
                f.write(text)
        return os.open(f"/proc/{child.pid}/ns/user", os.O_RDONLY | os.O_CLOEXEC)
    finally:
        child.stdin.close()
        child.wait()
        child.stderr.close()


class IdmapUnsupported(OSError):
    """The filesystem (or the kernel) cannot give an idmapped mount."""


def bind_idmapped(source: str, target: str, userns_fd: int) -> None:
    """Bind `source` read-only, nosuid and nodev on `target`, its ids seen through the mapping of the user namespace
    `userns_fd`. IdmapUnsupported where the filesystem cannot be idmapped; OSError naming the step otherwise."""
    tree = _check(
        _libc.syscall(_SYS_OPEN_TREE, _AT_FDCWD, os.fsencode(source), _OPEN_TREE_CLONE | _OPEN_TREE_CLOEXEC),
        "open_tree",
        source,
    )
    try:
        attr = _MountAttr(
            _MOUNT_ATTR_IDMAP | _MOUNT_ATTR_RDONLY | _MOUNT_ATTR_NOSUID | _MOUNT_ATTR_NODEV, 0, 0, userns_fd
        )
        if _libc.syscall(_SYS_MOUNT_SETATTR, tree, b"", _AT_EMPTY_PATH, ctypes.byref(attr), ctypes.sizeof(attr)) < 0:
            err = ctypes.get_errno()
            raise IdmapUnsupported(err, f"mount_setattr {source}: {os.strerror(err)}")
        _check(
            _libc.syscall(_SYS_MOVE_MOUNT, tree, b"", _AT_FDCWD, os.fsencode(target), _MOVE_MOUNT_F_EMPTY_PATH),
            "move_mount",
            target,
        )
    finally:
        os.close(tree)


_namespaces = _MappingNamespaces()


def mount_idmapped(source: str, target: str, ident: Identity) -> None:
    """Bind `source` read-only on `target`, its owner's files seen as `ident`'s (and nothing else changed)."""
    st = os.stat(source)
    try:
        bind_idmapped(source, target, _namespaces.fd(st.st_uid, st.st_gid, ident))
    except IdmapUnsupported as e:
        raise SandboxUnavailableError(
            f"cannot make an idmapped view of the repository {source!r} ({e.strerror}): sandboxes started "
            "as root need Linux 5.19 or later and the repository on a filesystem with idmapped mounts (ext4, "
            "xfs, btrfs, tmpfs; not NFS or overlayfs); copy it to such a filesystem"
        ) from None


def write_exec_only_shell(path: str) -> str:
    """Write at `path` a copy of bash that the sandbox user may run but not read; `path`.

    A process started from a binary its user cannot read is not dumpable: no other
    process of that user may ptrace it or open its /proc/<pid>/mem, fd/, environ.
    The persistent shell runs from this copy, so the commands it runs cannot read
    the protocol's nonce from its memory nor reach its pipes through /proc; what it
    starts from ordinary binaries is dumpable as usual (a debugger still works)."""
    with open("/bin/bash", "rb") as src, open(path + ".tmp", "wb") as dst:
        dst.write(src.read())
    os.chmod(path + ".tmp", 0o111)
    os.replace(path + ".tmp", path)
    return path
