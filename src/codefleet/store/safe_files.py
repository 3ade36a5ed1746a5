"""Writing under a run or output directory without ever following a symlink inside it.

    fd = safe_files.open_beneath(run, "analysis/ray.log", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    safe_files.write_file_beneath(run, "analysis/report.html", html.encode())   # atomic
    safe_files.remove_beneath(run, "analysis/rollouts/old.html")

A run directory (`train --out`, `eval --out`, `analyze RUN_DIR`, `chaos --out`) is storage that someone else
may have prepared, and codefleet often runs as root: a link planted at `RUN/analysis/rollouts -> /etc` must not
turn "remove the stale pages" into "empty /etc". So every function here takes the directory the user named
(`root`, which may itself be a link: the user chose it) and a path beneath it (relative to `root`, or
`os.path.join(root, ...)`), and walks the components one by one from a descriptor of `root`: each directory is
opened with O_NOFOLLOW | O_DIRECTORY relative to the one before (openat), the final file with O_NOFOLLOW. There is no
check-then-open: a component that is a link when it is walked fails the open itself, however late it was
planted. A link on the way, or as the file to write, raises `LinkRefused`, one sentence naming it; nothing
else is touched. Removing an entry that is itself a link removes the link (unlink never follows), and a tree
is removed by `shutil.rmtree` relative to its parent's descriptor, which never descends through a link.

What writes by path in another library (Ray Data's write_parquet, TensorBoard) cannot be held this way: its
callers make the directory through here and remove what was in the way first (see docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from typing import BinaryIO

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class LinkRefused(OSError):
    """A path under a run directory is (or passes through) a symlink; the message says which."""


def refusal(shown: str) -> LinkRefused:
    return LinkRefused(
        errno.ELOOP,
        f"refusing to write {shown}: it is a symlink; a run directory's contents are "
        "never reached through links (docs/security.md)",
    )


def _parts(root: str, path: str) -> list[str]:
    """The components of `path` below `root`: `path` is os.path.join(root, ...) or an absolute path beneath
    `root`, else relative to `root`."""
    norm_root, norm = os.path.normpath(root), os.path.normpath(path)
    if norm == norm_root or norm.startswith(norm_root.rstrip(os.sep) + os.sep) or os.path.isabs(path):
        rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    else:
        rel = norm
    parts = [p for p in rel.split(os.sep) if p not in ("", ".")]
    if ".." in parts:
        raise ValueError(f"{path} is not beneath {root}")
    return parts


def _shown(root: str, parts: list[str]) -> str:
    return os.path.join(root, *parts)


def _open_at(dir_fd: int, name: str, flags: int, shown: str, mode: int = 0o644) -> int:
    """os.open(name, flags | O_NOFOLLOW, dir_fd): LinkRefused when `name` is a symlink."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST) and _is_link(dir_fd, name):
            raise refusal(shown) from None
        raise


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def open_dir(root: str, path: str = "", create: bool = False) -> int:
    """A descriptor of the directory `path` beneath `root` (the caller closes it), reached without following any
    link below `root`; `create`: make the missing directories (and `root` itself) on the way."""
    parts = _parts(root, path)
    if create:
        os.makedirs(root, exist_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the user's own choice: may be a link
    try:
        for i, name in enumerate(parts):
            shown = _shown(root, parts[: i + 1])
            try:
                below = _open_at(fd, name, _DIR_FLAGS, shown)
            except FileNotFoundError:
                if not create:
                    raise FileNotFoundError(errno.ENOENT, "No such file or directory", shown) from None
                with contextlib.suppress(FileExistsError):  # made meanwhile (or a link: the open refuses it)
                    os.mkdir(name, 0o755, dir_fd=fd)
                below = _open_at(fd, name, _DIR_FLAGS, shown)
            os.close(fd)
            fd = below
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _parent(root: str, path: str, create: bool):
    """(descriptor of the parent directory, final name, shown path) of `path` beneath `root`."""
    parts = _parts(root, path)
    if not parts:
        raise ValueError(f"{path} names {root} itself, not a file beneath it")
    fd = open_dir(root, os.path.join(*parts[:-1]) if len(parts) > 1 else "", create=create)
    try:
        yield fd, parts[-1], _shown(root, parts)
    finally:
        os.close(fd)


def makedirs_beneath(root: str, path: str) -> None:
    """The directory `path` beneath `root` and every one on the way, none of them reached through a link."""
    os.close(open_dir(root, path, create=True))


def open_beneath(root: str, path: str, flags: int, mode: int = 0o644) -> int:
    """os.open of `path` beneath `root`, no link followed on the way or as the file itself; with O_CREAT the
    missing directories on the way are made. The caller closes the descriptor."""
    with _parent(root, path, create=bool(flags & os.O_CREAT)) as (fd, name, shown):
        return _open_at(fd, name, flags, shown, mode)


def append_beneath(root: str, path: str) -> BinaryIO:
    """`path` beneath `root` opened to append (made if missing), as a binary file."""
    return os.fdopen(open_beneath(root, path, os.O_WRONLY | os.O_APPEND | os.O_CREAT), "ab")


def write_file_beneath(
    root: str, path: str, data: bytes | str | Callable[[BinaryIO], None], mode: int = 0o600, fsync: bool = False
) -> None:
    """`data` (bytes, text as UTF-8, or a function writing into the binary file it is given) as the file `path`
    beneath `root`, atomically: written under a temporary name in the same directory, then renamed onto
    `path`, so a reader sees the old file or the whole new one. A link at `path` is refused, not replaced."""
    with _parent(root, path, create=True) as (fd, name, shown):
        if _is_link(fd, name):
            raise refusal(shown)
        tmp = f".{name[:100]}.{uuid.uuid4().hex[:12]}.tmp"
        f = os.fdopen(_open_at(fd, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, shown, mode), "wb")
        try:
            with f:
                if callable(data):
                    data(f)
                else:
                    f.write(data.encode() if isinstance(data, str) else data)
                f.flush()
                if fsync:
                    os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=fd)
            raise


def listdir_beneath(root: str, path: str = "") -> list[str]:
    """The names in the directory `path` beneath `root`; FileNotFoundError when there is none."""
    fd = open_dir(root, path)
    try:
        return os.listdir(fd)
    finally:
        os.close(fd)


def remove_beneath(root: str, path: str, ignore_errors: bool = False) -> None:
    """Remove the file, link (the link itself) or directory tree `path` beneath `root`; nothing there is fine.
    A tree is removed without descending through any link in it (`ignore_errors`: what cannot be removed in it
    stays, silently; a link on the way to `path` is refused all the same). `path` equal to `root` removes
    `root`'s tree (a directory the user named and codefleet made)."""
    if not _parts(root, path):
        if os.path.isdir(root) and not os.path.islink(root):
            shutil.rmtree(root, ignore_errors=ignore_errors)
        return
    try:
        with _parent(root, path, create=False) as (fd, name, _):
            try:
                st = os.lstat(name, dir_fd=fd)
            except FileNotFoundError:
                return
            if stat.S_ISDIR(st.st_mode):
                shutil.rmtree(name, ignore_errors=ignore_errors, dir_fd=fd)  # fd-based: never follows a link
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=fd)
    except FileNotFoundError:  # a directory on the way is missing: nothing to remove
        return


def replace_beneath(root: str, src: str, dst: str) -> None:
    """os.replace of `src` by `dst`, both beneath `root`, their directories reached without following links
    (renaming moves a link itself, never what it points to)."""
    with (
        _parent(root, src, create=False) as (src_fd, src_name, _),
        _parent(root, dst, create=True) as (dst_fd, dst_name, _),
    ):
        os.replace(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def lexists_beneath(root: str, path: str) -> bool:
    """Whether `path` beneath `root` exists (a link counts), its directories reached without following links."""
    try:
        with _parent(root, path, create=False) as (fd, name, _):
            os.lstat(name, dir_fd=fd)
            return True
    except FileNotFoundError:
        return False


__all__ = [
    "LinkRefused",
    "append_beneath",
    "lexists_beneath",
    "listdir_beneath",
    "makedirs_beneath",
    "open_beneath",
    "open_dir",
    "remove_beneath",
    "replace_beneath",
    "write_file_beneath",
]
