"""Copy-on-write workspaces: overlay mounts, per-sandbox tmpfs, frozen layers.

A workspace is an overlay: the repository directory is the bottom (read-only,
never modified), zero or more *frozen layers* sit on it, and the sandbox's
own upper layer takes every change. The upper layer lives on a tmpfs sized
`workspace_mb`, so a command that fills the disk fills only its own tmpfs
(ENOSPC inside the sandbox, nothing on the host) and its pages are charged
to the sandbox's memory cgroup.

Where sandboxes run as another host user than ours (identity.py), the
repository is stacked through an idmapped view, so that its owner's files are
that user's inside, and the upper layer belongs to that user: what a command
creates is owned on the host by the sandbox user, never by root.

`fork` freezes a sandbox's changes by copying its upper layer (usually
small: only what changed) into a new frozen layer that all children stack on
their parent's lowers. The parent keeps writing to its own upper; the
children never see those later writes. As root, a frozen layer is a tmpfs of
its own no larger than the workspace (`workspace_mb`), never the host's disk:
its pages are charged to the process that forks (the sandbox owner), and
set-user-ID and set-group-ID bits are not carried into it.

Strategies, best first: a kernel overlay mount (root), fuse-overlayfs
(unprivileged, if installed), or a plain copy of the repository (last
resort, slow for big repositories).

A kernel overlay's options are in every mount table that shows it, the
sandbox's own /proc/self/mountinfo included, exactly as they were given. So
its layers are given as /proc/self/fd/N (`mount_overlay`), never by path:
inside, a workspace reads `lowerdir=/proc/self/fd/7:...,upperdir=...`, not
the state directory. A FUSE mount's table entry names no layer at all.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
import shutil
import stat
import subprocess

from codefleet.sandbox.base import SandboxError
from codefleet.sandbox.identity import Identity, mount_idmapped

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
MNT_DETACH = 2
# The kernel takes mount options in one page; leave room for upper and work dirs.
_MAX_LOWERDIR_CHARS = 3500
_OCTAL_ESCAPE = re.compile(rb"\\([0-7]{3})")


def mount(source: str, target: str, fstype: str, options: str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    if _libc.mount(os.fsencode(source), os.fsencode(target), fstype.encode(), flags, os.fsencode(options)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {fstype} on {target} failed: {os.strerror(err)}")


def umount(target: str) -> None:
    """Lazily unmount `target`; fine if it is not mounted."""
    if _libc.umount2(os.fsencode(target), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (22, 2):  # EINVAL: not a mount point; ENOENT: gone
            raise OSError(err, f"umount {target} failed: {os.strerror(err)}")


def mounts_under(prefix: str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points at or below `prefix`, deepest first (so they unmount cleanly)."""
    prefix = prefix.rstrip("/")
    points = []
    with open(mountinfo, "rb") as f:
        for line in f:
            point = mountinfo_path(line.split()[4])
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return sorted(points, key=len, reverse=True)


def mountinfo_path(field: bytes) -> str:
    """A path as /proc/self/mountinfo writes it: raw bytes (UTF-8 or not) with
    space, tab, newline and backslash as octal escapes (\\040)."""
    return os.fsdecode(_OCTAL_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def _escape(path: str) -> str:
    return path.replace("\\", "\\\\").replace(":", "\\:").replace(",", "\\,")


def mount_overlay(
    target: str, lowers: list[str], upper: str | None = None, work: str | None = None, flags: int = MS_NOSUID | MS_NODEV
) -> None:
    """Mount at `target` an overlay of `lowers` (top first), writable through `upper` and `work` if given,
    naming each directory as /proc/self/fd/N of a descriptor held only for the mount: the kernel records and
    shows the options as given, so no mount table, not even a sandbox's, names their host paths."""
    writable = [upper, work] if upper is not None and work is not None else []
    fds: list[int] = []
    try:
        for path in lowers + writable:
            fds.append(os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
        named = [f"/proc/self/fd/{fd}" for fd in fds]
        lowerdir = ":".join(named[: len(lowers)])
        _check_lowerdir(lowerdir, len(lowers))
        options = f"lowerdir={lowerdir}" + (f",upperdir={named[-2]},workdir={named[-1]}" if writable else "")
        mount("overlay", target, "overlay", options, flags)
    finally:
        for fd in fds:
            os.close(fd)


def _check_lowerdir(lowerdir: str, layers: int) -> None:
    if len(lowerdir) > _MAX_LOWERDIR_CHARS:
        raise SandboxError(
            f"too many stacked fork layers ({layers}) for one overlay mount; "
            "fork from a fresh sandbox instead of a fork of a fork of ..."
        )


def choose_strategy() -> str:
    """'overlay' as root, 'fuse-overlayfs' if installed and usable, else 'copy'."""
    if os.geteuid() == 0:
        return "overlay"
    if shutil.which("fuse-overlayfs") and os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "fuse-overlayfs"
    return "copy"


class Workspace:
    """The directories of one sandbox's workspace and how they are mounted.

    Layout under `root` (a per-sandbox state directory):
      rw/       tmpfs (overlay strategies): rw/upper and rw/work
      repo/     the repository's idmapped view (when the sandbox runs as another user)
      merged/   what the sandbox sees as /workspace
    """

    def __init__(self, root: str, lowers: list[str], strategy: str, size_mb: int, ident: Identity | None = None):
        self.root = root
        self.lowers = list(lowers)  # top first; the repository is last
        self.strategy = strategy
        self.size_mb = size_mb
        self.ident = ident if ident is not None and ident.switches else None
        self.rw = os.path.join(root, "rw")
        self.upper = os.path.join(self.rw, "upper")
        self.merged = os.path.join(root, "merged")

    def mount(self) -> None:
        os.makedirs(self.merged, exist_ok=True)
        os.makedirs(self.rw, exist_ok=True)
        if self.strategy == "copy":
            _copy_tree(self.lowers, self.merged)
            return
        if self.strategy == "overlay":
            mount("tmpfs", self.rw, "tmpfs", f"size={self.size_mb}m,mode=0755")
        work = os.path.join(self.rw, "work")
        os.makedirs(self.upper, exist_ok=True)
        os.makedirs(work, exist_ok=True)
        lowers = self.lowers
        if self.ident is not None:
            os.chown(self.upper, self.ident.uid, self.ident.gid)
            view = os.path.join(self.root, "repo")
            os.mkdir(view)
            mount_idmapped(lowers[-1], view, self.ident)
            lowers = lowers[:-1] + [view]
        if self.strategy == "overlay":
            mount_overlay(self.merged, lowers, self.upper, work)
            return
        lowerdir = ":".join(_escape(p) for p in lowers)
        _check_lowerdir(lowerdir, len(lowers))
        options = f"lowerdir={lowerdir},upperdir={_escape(self.upper)},workdir={_escape(work)}"
        subprocess.run(["fuse-overlayfs", "-o", options, self.merged], check=True, capture_output=True, timeout=30)

    def unmount(self) -> None:
        for point in mounts_under(self.root):
            if self.strategy == "fuse-overlayfs" and point == self.merged:
                subprocess.run(["fusermount", "-uz", point], capture_output=True, timeout=30)
            else:
                umount(point)

    def freeze(self, layer_dir: str) -> bool:
        """Copy this workspace's changes into `layer_dir`; False if there are none.
        As root, `layer_dir` becomes a tmpfs of `size_mb` (drop_layer removes it)."""
        src = self.merged if self.strategy == "copy" else self.upper
        if self.strategy != "copy" and not os.listdir(src):
            return False
        os.makedirs(layer_dir)
        if self.strategy == "overlay":
            mount("tmpfs", layer_dir, "tmpfs", f"size={self.size_mb}m,mode=0755")
        try:
            copy_layer(src, layer_dir)
        except BaseException:
            drop_layer(layer_dir)
            raise
        return True


def drop_layer(layer_dir: str) -> None:
    """Remove a frozen layer: unmount its tmpfs (if it has one) and delete what is left."""
    try:
        if os.path.ismount(layer_dir):
            umount(layer_dir)
    finally:
        remove_tree(layer_dir)


def _copy_tree(lowers: list[str], dest: str) -> None:
    """'copy' strategy: materialise the stacked lowers (bottom first) into dest."""
    for lower in reversed(lowers):
        copy_layer(lower, dest)


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class TreeChangedError(SandboxError):
    """A directory was moved while codefleet walked the tree it is in."""


class _Cursor:
    """One open directory that walks a tree a level at a time, however deep (a sandbox can make a tree
    thousands of directories deep: no recursion, one descriptor, no path longer than a name). Down opens a
    child without following a symlink; up goes through '..' and checks it is the directory it came from."""

    def __init__(self, path: str):
        self.fd = os.open(path, _DIR_FLAGS)
        self._trail = [_identity(os.fstat(self.fd))]

    def down(self, name: str) -> None:
        new = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        os.close(self.fd)
        self.fd = new
        self._trail.append(_identity(os.fstat(new)))

    def up(self) -> None:
        self._trail.pop()
        new = os.open("..", _DIR_FLAGS, dir_fd=self.fd)
        if _identity(os.fstat(new)) != self._trail[-1]:
            os.close(new)
            raise TreeChangedError(
                "a directory was moved while codefleet copied or removed the tree it is in; "
                "try again once the sandbox's processes are done"
            )
        os.close(self.fd)
        self.fd = new

    def close(self) -> None:
        os.close(self.fd)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def copy_layer(src: str, dst: str) -> None:
    """Copy an overlay upper layer exactly: whiteouts (0/0 char devices),
    opaque-directory xattrs, modes, owners and symlinks included; only the
    set-user-ID bit and a file's set-group-ID bit are dropped. What `dst`
    already holds is merged into (the 'copy' strategy stacks layers so).

    The sandbox may still be running: its processes can rename, delete or swap
    a file for a symlink while we copy. So the walk holds the directory it is
    in open (_Cursor) and opens nothing by a path through a symlink: a symlink
    to /etc planted mid-copy is copied as a symlink, never followed on the
    host; an entry that vanishes is left out; a directory moved from under the
    walk stops it with TreeChangedError."""
    os.makedirs(dst, exist_ok=True)
    os.chmod(dst, 0o700)  # writable while it is filled (its own mode comes last)
    source, target = _Cursor(src), _Cursor(dst)
    try:
        # per level: the names still to copy (last first), and the directory's name and stat, whose
        # metadata is copied once its content is (a read-only directory must stay writable until then)
        todo = [(sorted(os.listdir(source.fd), reverse=True), "", os.fstat(source.fd))]
        while todo:
            names, dir_name, dir_st = todo[-1]
            if not names:
                todo.pop()
                if todo:
                    source.up()
                    target.up()
                    _copy_meta(f"/proc/self/fd/{source.fd}/{dir_name}", f"/proc/self/fd/{target.fd}/{dir_name}", dir_st)
                continue
            name = names.pop()
            st = _copy_entry(source.fd, target.fd, name)
            if st is None:
                continue
            try:
                source.down(name)
            except OSError as e:  # gone, or swapped for a file or a symlink: left empty
                if not isinstance(e, (FileNotFoundError, NotADirectoryError)) and e.errno != errno.ELOOP:
                    raise
                _copy_meta(f"/proc/self/fd/{source.fd}/{name}", f"/proc/self/fd/{target.fd}/{name}", st)
                continue
            target.down(name)
            todo.append((sorted(os.listdir(source.fd), reverse=True), name, st))
    finally:
        source.close()
        target.close()
    _copy_meta(src, dst, os.lstat(src))


def _copy_entry(src_fd: int, dst_fd: int, name: str) -> os.stat_result | None:
    """Copy the entry `name` of directory src_fd into dst_fd; for a directory (made, to descend into and
    whose metadata is copied last) its stat, else None."""
    src, dst = f"/proc/self/fd/{src_fd}/{name}", f"/proc/self/fd/{dst_fd}/{name}"  # never paths to follow
    try:
        st = os.lstat(name, dir_fd=src_fd)
        if stat.S_ISDIR(st.st_mode):
            if not _is_dir_at(dst_fd, name):
                _remove_at(dst_fd, name)
                os.mkdir(name, 0o700, dir_fd=dst_fd)
            else:
                os.chmod(dst, 0o700, follow_symlinks=False)  # writable while it is filled
            return st
        _remove_at(dst_fd, name)  # what a lower layer had there
        if stat.S_ISLNK(st.st_mode):
            os.symlink(os.readlink(name, dir_fd=src_fd), name, dir_fd=dst_fd)
        elif stat.S_ISREG(st.st_mode):
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=src_fd)
            with open(fd, "rb") as fi:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None  # swapped for a FIFO since it was listed: left out
                out = os.open(
                    name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dst_fd
                )
                with open(out, "wb") as fo:
                    shutil.copyfileobj(fi, fo, 1 << 20)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) or stat.S_ISFIFO(st.st_mode):
            try:
                os.mknod(name, st.st_mode, st.st_rdev, dir_fd=dst_fd)
            except PermissionError:  # a device node, copied by a user who may not make one: left out
                return None
        else:
            return None  # sockets are not part of a filesystem state
        _copy_meta(src, dst, st)
    except (FileNotFoundError, NotADirectoryError):  # renamed or deleted since it was listed
        return None
    except OSError as e:
        # a file swapped for a symlink since it was listed (ELOOP), or a symlink for a file (EINVAL)
        if e.errno not in (errno.ELOOP, errno.EINVAL):
            raise
        return None
    return None


def _is_dir_at(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode)
    except FileNotFoundError:
        return False


def _remove_at(dir_fd: int, name: str) -> None:
    """Remove the entry `name` of directory dir_fd, whatever it is; fine if there is none."""
    if _is_dir_at(dir_fd, name):
        remove_tree(f"/proc/self/fd/{dir_fd}/{name}")
    else:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass


def remove_tree(path: str) -> None:
    """Delete `path` and everything below it, however deep, never through a symlink and never into
    another filesystem (a mount point is left, as `rm --one-file-system` does); what cannot be deleted
    stays, silently: the reaper tries again."""
    try:
        cursor = _Cursor(path)
    except FileNotFoundError:
        return
    except OSError:  # not a directory (or a symlink to one): one unlink
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    device = os.fstat(cursor.fd).st_dev
    down: list[str] = []  # the names walked down through
    stuck: list[set[str]] = [set()]  # per level: what could not be deleted
    try:
        while True:
            below = None
            for name in os.listdir(cursor.fd):
                if name in stuck[-1]:
                    continue
                try:
                    st = os.lstat(name, dir_fd=cursor.fd)
                    if stat.S_ISDIR(st.st_mode) and st.st_dev == device:
                        below = name
                        break
                    if stat.S_ISDIR(st.st_mode):  # a mount point
                        stuck[-1].add(name)
                    else:
                        os.unlink(name, dir_fd=cursor.fd)
                except FileNotFoundError:
                    pass
                except OSError:
                    stuck[-1].add(name)
            if below is not None:
                try:
                    cursor.down(below)
                except OSError:
                    stuck[-1].add(below)
                    continue
                down.append(below)
                stuck.append(set())
                continue
            if not down:
                break
            name = down.pop()
            stuck.pop()
            cursor.up()
            try:
                os.rmdir(name, dir_fd=cursor.fd)
            except OSError:
                stuck[-1].add(name)
    except TreeChangedError:
        pass  # left for the reaper
    finally:
        cursor.close()
    try:
        os.rmdir(path)
    except OSError:
        pass


def _copy_meta(src: str, dst: str, st: os.stat_result) -> None:
    for attr in _xattrs(src):
        try:
            os.setxattr(dst, attr, os.getxattr(src, attr, follow_symlinks=False), follow_symlinks=False)
        except OSError:
            pass
    try:
        os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    except OSError:
        pass
    if not stat.S_ISLNK(st.st_mode):
        mode = stat.S_IMODE(st.st_mode) & ~stat.S_ISUID
        if not stat.S_ISDIR(st.st_mode):  # on a directory, set-group-ID only says who owns new files
            mode &= ~stat.S_ISGID
        os.chmod(dst, mode)


def _xattrs(path: str) -> list[str]:
    try:
        return os.listxattr(path, follow_symlinks=False)
    except OSError:
        return []
