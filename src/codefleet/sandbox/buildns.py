"""The user namespace a `codefleet env build` step runs in: root inside, nobody on the host.

A step runs whatever its base image's /bin/sh and packages do, so it is hostile. It runs as uids and gids
0..65535 of a user namespace mapped to a block of host ids that no user has (`store_ids`): root's
subordinate range in /etc/subuid and /etc/subgid, else the first block of 65536 ids from 100000 on that no
user, group or subordinate range of this host has; the store records the block on its first build and
keeps it. Root inside has every capability over the step's own namespaces (apt and dpkg chown files, set
set-ID bits, drop to `_apt`) and none over the host's, where it is an unprivileged uid: it cannot make
device nodes, mount the host's disk, reopen host files by handle or reconfigure the host's network. This is
how rootless builders and `mmdebstrap --mode=unshare` work. There is no fallback to the host's root: where
the kernel cannot make the namespace, a build is refused with what to enable.

Owners on the host's disk. Root's files are the host's root's (as an import leaves every file), and a
file of inside id k > 0 belongs to host id base+k, which no user of this host has: an image whose app user
is 1000 does not hand the store's files to this host's user 1000. The step's rootfs is an overlay that the
host's root mounts (overlayfs needs it):

- its lower layer is the layers below, merged (hard links into the store), seen through an idmapped bind
  mount (`idmapped_view`) that shows the host's root as base, which is root inside, and base+k as itself,
  which is k inside. The store's files are never chowned;
- its upper layer is a plain directory: what the step writes there belongs to base+k for inside id k.
  envbuild stores it so (`stored_ids`), with base itself (the step's root) back to the host's root.

Idmapped mounts need Linux 5.19 or later and the store on a filesystem that has them (ext4, xfs, btrfs,
tmpfs); elsewhere the build is refused with that sentence. (An overlay itself cannot be idmapped, and an
overlay whose upper layer is idmapped cannot make its work directory as the host's root: so only the
lower layer is a view.)
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
from dataclasses import dataclass

from codefleet.sandbox.identity import IdmapUnsupported, bind_idmapped, make_userns
from codefleet.sandbox.oci import ImageError

IDS = 65536  # uids and gids 0..65535 inside, as a Debian userland uses them (nobody is 65534)
DEFAULT_BASE = 100_000
IDS_FILE = "build-ids"  # in the store: the host uid and gid its build steps' block starts at
_MAX_USERNS = "/proc/sys/user/max_user_namespaces"


@dataclass(frozen=True)
class HostIds:
    """Where inside ids 0..IDS-1 lie on the host."""

    uid: int
    gid: int


def store_ids(store: str, subuid: str = "/etc/subuid", subgid: str = "/etc/subgid") -> HostIds:
    """The host ids whose block the store's build steps run as and its build layers' owners lie in: those it
    recorded, else root's subordinate range, else the first free block (then recorded). Refused if a user,
    group or another's subordinate range has come to overlap them since."""
    path = os.path.join(store, IDS_FILE)
    try:
        with open(path) as f:
            ids = HostIds(*map(int, f.read().split()))
    except FileNotFoundError:
        ids = _choose(subuid, subgid)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{ids.uid} {ids.gid}\n")
        os.replace(tmp, path)
    except (ValueError, TypeError):
        raise ImageError(
            f"the store's {path} is not two numbers (the host uid and gid its build layers were "
            "stored with); restore it, or build into a new store"
        ) from None
    clash = _users_of(ids, _claims(subuid, subgid))
    if clash:
        raise ImageError(
            f"the store {store} keeps the owners of its build layers as host ids {ids.uid}.. and "
            f"{ids.gid}.., which {clash[0]} now has; give that user other ids, or build into a new "
            "store"
        )
    return ids


def _choose(subuid: str, subgid: str) -> HostIds:
    uid, gid = _subordinate(subuid), _subordinate(subgid)
    if uid is not None and gid is not None:
        return HostIds(uid, gid)
    if uid is not None or gid is not None:
        raise ImageError(
            f"root has a subordinate range of {IDS} ids in only one of {subuid} and {subgid}; give it "
            f"one in both (`usermod --add-subuids N-M --add-subgids N-M root`) or in neither"
        )
    claims = _claims(subuid, subgid)
    for base in range(DEFAULT_BASE, 1 << 31, IDS):
        if not _users_of(HostIds(base, base), claims):
            return HostIds(base, base)
    raise ImageError(
        f"no block of {IDS} host ids is free for a build step's user namespace; give root a "
        "subordinate range: `usermod --add-subuids N-M --add-subgids N-M root`"
    )


def _claims(subuid: str, subgid: str) -> list[tuple[bool, str, int, int]]:
    """(a uid?, who, first id, how many) of every user, group and subordinate range of this host but root's."""
    found = [(True, f"user {p.pw_name}", p.pw_uid, 1) for p in pwd.getpwall()]
    found += [(False, f"group {g.gr_name}", g.gr_gid, 1) for g in grp.getgrall()]
    for path, is_uid in ((subuid, True), (subgid, False)):
        found += [
            (is_uid, f"the subordinate range of {name} in {path}", start, count)
            for name, start, count in _ranges(path)
            if name not in ("root", "0")
        ]
    return found


def _users_of(ids: HostIds, claims: list[tuple[bool, str, int, int]]) -> list[str]:
    """Who of `claims` has an id of the blocks at `ids`."""
    return [
        who
        for is_uid, who, start, count in claims
        if start < (ids.uid if is_uid else ids.gid) + IDS and (ids.uid if is_uid else ids.gid) < start + count
    ]


def _ranges(path: str) -> list[tuple[str, int, int]]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        parts = line.strip().split(":")
        if len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            out.append((parts[0], int(parts[1]), int(parts[2])))
    return out


def _subordinate(path: str) -> int | None:
    return next((start for name, start, count in _ranges(path) if name in ("root", "0") and count >= IDS), None)


def unavailable_reason() -> str | None:
    """Why this host cannot run a build step in a user namespace, else None."""
    missing = [tool for tool in ("unshare", "nsenter", "bwrap") if not shutil.which(tool)]
    if missing:
        return f"{' and '.join(missing)} is not installed (apt-get install util-linux bubblewrap)"
    try:
        with open(_MAX_USERNS) as f:
            if f.read().strip() == "0":
                return "user.max_user_namespaces is 0"
    except OSError:
        pass
    return None


def _refusal(detail: str) -> ImageError:
    return ImageError(
        f"codefleet env build runs each step as root of a user namespace, an unprivileged user on "
        f"the host, and this host cannot make one ({detail}): enable user namespaces (sysctl "
        "user.max_user_namespaces=15000, and allow unshare(CLONE_NEWUSER) in a container's seccomp "
        "profile); a step never runs as the host's root"
    )


class StepNamespace:
    """The user namespaces of a build's steps, held open by descriptors: `fd`, where the steps run (inside k is
    host base+k), and the one `idmapped_view` takes its mapping from (host root as base, base+k as itself)."""

    def __init__(self, ids: HostIds):
        why = unavailable_reason()
        if why:
            raise _refusal(why)
        self.ids = ids
        self.fd = self.view_fd = -1
        try:
            self.fd = make_userns(f"0 {ids.uid} {IDS}\n", f"0 {ids.gid} {IDS}\n")
            self.view_fd = make_userns(
                f"0 {ids.uid} 1\n{ids.uid + 1} {ids.uid + 1} {IDS - 1}\n",
                f"0 {ids.gid} 1\n{ids.gid + 1} {ids.gid + 1} {IDS - 1}\n",
            )
        except OSError as e:
            self.close()
            raise _refusal(str(e)) from None
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd in (self.fd, self.view_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.view_fd = -1

    def enter(self) -> list[str]:
        """The command prefix that runs a program as root of the steps' namespace (`pass_fds=(self.fd,)`)."""
        return ["nsenter", f"--user=/proc/self/fd/{self.fd}", "--setuid", "0", "--setgid", "0", "--"]

    def running_ids(self, stored_uid: int, stored_gid: int) -> tuple[int, int]:
        """The host ids a stored owner has while a step runs (the view's mapping)."""
        return (stored_uid or self.ids.uid), (stored_gid or self.ids.gid)

    def stored_ids(self, host_uid: int, host_gid: int) -> tuple[int, int]:
        """The owner to store for a file a step left on the host's disk: its own ids, the step's root as the
        host's root, and the host's root for what the step did not make (the overlay's own whiteouts)."""

        def one(host: int, base: int) -> int:
            return host if base < host < base + IDS else 0

        return one(host_uid, self.ids.uid), one(host_gid, self.ids.gid)

    def idmapped_view(self, source: str, target: str) -> None:
        """Bind `source` read-only (nosuid, nodev) on `target`, seen with the view's mapping."""
        try:
            bind_idmapped(source, target, self.view_fd)
        except IdmapUnsupported as e:
            raise ImageError(
                f"codefleet env build shows a step the layers below it through an idmapped mount, "
                f"which {source!r} cannot have ({e.strerror}): it needs Linux 5.19 or later and the "
                "store on ext4, xfs, btrfs or tmpfs; choose such a store (--store or "
                "CODEFLEET_ENV_DIR)"
            ) from None


def shift_tree(path: str, ids: HostIds) -> None:
    """Give every file of `path` owned by inside id k > 0 host id base+k, as a build step's layer stores it (a root
    filesystem made as the host's root: mmdebstrap's)."""

    def one(inside: int, base: int) -> int:
        return base + inside if 0 < inside < IDS else inside

    for here, dirs, files in os.walk(path):
        for entry in [os.path.join(here, name) for name in dirs + files] + ([here] if here == path else []):
            st = os.lstat(entry)
            owner = one(st.st_uid, ids.uid), one(st.st_gid, ids.gid)
            if owner != (st.st_uid, st.st_gid):
                os.lchown(entry, *owner)
