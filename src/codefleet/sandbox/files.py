"""The file API, confined to the workspace.

Paths are resolved the way the sandbox would see them — the workspace is
`/workspace`, absolute symlinks are read relative to the sandbox root — but
walked on the host one component at a time with directory file descriptors
and O_NOFOLLOW, so a process inside the sandbox cannot race a symlink in
between the check and the use. Anything that would leave the workspace
(`..` above it, an absolute path elsewhere, a symlink pointing out) raises
PathEscapeError naming the path.
"""

from __future__ import annotations

import errno
import os
import stat

from codefleet.sandbox.base import WORKSPACE, PathEscapeError
from codefleet.types import FileEntry

_MAX_LINKS = 40
MAX_READ_BYTES = 8 * 1024 * 1024


class FileTooLargeError(ValueError):
    """A whole file asked for is larger than MAX_READ_BYTES: read a line range of it instead."""


def _relative_parts(path: str) -> list[str]:
    """Split a user path into workspace-relative components; refuse other absolute paths."""
    if "\x00" in path:
        raise PathEscapeError(f"path {path!r} contains a NUL byte")
    if path.startswith("/"):
        if path != WORKSPACE and not path.startswith(WORKSPACE + "/"):
            raise PathEscapeError(f"path {path!r} is outside the workspace {WORKSPACE}; use a relative path")
        path = path[len(WORKSPACE) :]
    return [p for p in path.split("/") if p not in ("", ".")]


class WorkspaceFiles:
    """File operations on a workspace directory `root` (a host path)."""

    def __init__(self, root: str, owner: tuple[int, int] | None = None):
        self.root = root
        self.owner = owner  # (uid, gid) given to what we create, where the sandbox runs as another host user

    # -- resolution ------------------------------------------------------------

    def _walk(self, path: str, create_parents: bool = False) -> tuple[int, str]:
        """Return (fd of the parent directory, final name) for `path`, following
        symlinks only while they stay inside the workspace. Caller closes the fd."""
        todo = _relative_parts(path)
        stack = [os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)]  # fds from the root down
        links = 0
        try:
            if not todo:
                return os.dup(stack[-1]), "."
            while todo:
                part = todo.pop(0)
                if part == "..":
                    if len(stack) == 1:
                        raise PathEscapeError(f"path {path!r} climbs out of the workspace with '..'")
                    os.close(stack.pop())
                    continue
                if not todo:  # the final component: the caller opens it
                    return os.dup(stack[-1]), part
                try:
                    target = os.readlink(part, dir_fd=stack[-1])
                except OSError as e:
                    if e.errno == errno.ENOENT and create_parents:
                        os.mkdir(part, 0o755, dir_fd=stack[-1])
                        if self.owner:
                            os.chown(part, *self.owner, dir_fd=stack[-1], follow_symlinks=False)
                    elif e.errno not in (errno.EINVAL, errno.ENOENT):
                        raise
                else:
                    links += 1
                    if links > _MAX_LINKS:
                        raise PathEscapeError(f"path {path!r} has too many levels of symlinks")
                    if target.startswith("/"):
                        todo = _relative_parts(target) + todo
                        while len(stack) > 1:
                            os.close(stack.pop())
                    else:
                        todo = [p for p in target.split("/") if p not in ("", ".")] + todo
                    continue
                stack.append(
                    os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=stack[-1])
                )
            return os.dup(stack[-1]), "."  # the path ended in '..'
        finally:
            for fd in stack:
                os.close(fd)

    def _open(self, path: str, flags: int, mode: int = 0o644, create_parents: bool = False) -> int:
        """Open `path` inside the workspace, resolving a final symlink safely."""
        try:
            return self._open_resolved(path, flags, mode, create_parents)
        except PathEscapeError as e:
            if repr(path) in str(e):
                raise
            raise PathEscapeError(f"path {path!r} leads outside the workspace through a symlink ({e})") from None

    def _open_resolved(self, path: str, flags: int, mode: int, create_parents: bool) -> int:
        for _ in range(_MAX_LINKS):
            dir_fd, name = self._walk(path, create_parents)
            try:
                if name == ".":
                    return os.open(".", flags | os.O_CLOEXEC, dir_fd=dir_fd)
                try:
                    target = os.readlink(name, dir_fd=dir_fd)
                except OSError:
                    return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
            finally:
                os.close(dir_fd)
            # The last component is a symlink: resolve it relative to its directory.
            parent = "/".join(_relative_parts(path)[:-1])
            path = target if target.startswith("/") else (parent + "/" + target if parent else target)
        raise PathEscapeError(f"path {path!r} has too many levels of symlinks")

    def resolve_dir(self, path: str) -> int:
        return self._open(path, os.O_RDONLY | os.O_DIRECTORY)

    def _relpath_of(self, fd: int) -> str:
        """Workspace-relative path of an open fd (symlinks and '..' resolved)."""
        real = os.readlink(f"/proc/self/fd/{fd}")
        rel = os.path.relpath(real, os.path.realpath(self.root))
        if rel == ".." or rel.startswith("../"):  # cannot happen: _open refuses it
            raise PathEscapeError(f"{real!r} is outside the workspace")
        return rel

    def real_relpath(self, path: str) -> str:
        """The canonical workspace-relative path of an existing `path` ('.' for the root);
        raises PathEscapeError if it leads outside the workspace."""
        fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK)  # O_NONBLOCK: a FIFO must not hang us
        try:
            return self._relpath_of(fd)
        finally:
            os.close(fd)

    # -- operations ------------------------------------------------------------

    def _open_regular(self, path: str) -> int:
        """A read-only fd of the regular file `path`; a directory or anything else is refused."""
        fd = self._open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO must not hang us
        try:
            mode = os.fstat(fd).st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, f"{path!r} is a directory; use list_dir")
            if not stat.S_ISREG(mode):
                raise ValueError(f"{path!r} is not a regular file")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def read_bytes(self, path: str, max_bytes: int = MAX_READ_BYTES) -> bytes:
        fd = self._open_regular(path)
        try:
            data = os.read(fd, max_bytes + 1)
            chunks = [data]
            while data and sum(map(len, chunks)) <= max_bytes:
                data = os.read(fd, max_bytes + 1)
                chunks.append(data)
            blob = b"".join(chunks)
            if len(blob) > max_bytes:
                raise FileTooLargeError(f"{path!r} is larger than {max_bytes} bytes; read it by line range or with run")
            return blob
        finally:
            os.close(fd)

    def read_text(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        """Text of `path`, or lines start_line..end_line (1-based, inclusive; lines end at \\n, as for sed).

        A whole file is read only up to MAX_READ_BYTES; a line range is read line by line, so it may come
        from a file of any size, as long as the lines asked for hold no more than MAX_READ_BYTES."""
        if start_line is None and end_line is None:
            return self.read_bytes(path).decode("utf-8", "replace")
        start = max(start_line or 1, 1)
        with os.fdopen(self._open_regular(path), "rb") as f:
            number = 1
            while number < start:  # skipped in pieces: a line may be longer than memory allows
                piece = f.readline(1 << 16)
                if not piece:
                    return ""
                if piece.endswith(b"\n"):
                    number += 1
            chunks: list[bytes] = []
            size = 0
            while end_line is None or number <= end_line:
                piece = f.readline(MAX_READ_BYTES + 1 - size)
                if not piece:
                    break
                chunks.append(piece)
                size += len(piece)
                if size > MAX_READ_BYTES:
                    last = "the end" if end_line is None else end_line
                    raise ValueError(
                        f"lines {start} to {last} of {path!r} are larger than {MAX_READ_BYTES} bytes; "
                        "read fewer lines, or use run"
                    )
                if piece.endswith(b"\n"):
                    number += 1
        return b"".join(chunks).decode("utf-8", "replace")

    def write(self, path: str, content: str | bytes) -> None:
        """Create or replace the regular file `path`, creating missing parent directories."""
        data = content.encode() if isinstance(content, str) else content
        try:  # O_NONBLOCK and no O_TRUNC until we know it is a regular file: a FIFO must not hang us
            fd = self._open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK, 0o644, create_parents=True)
        except OSError as e:
            if e.errno == errno.ENXIO:  # a FIFO nobody reads
                raise ValueError(f"{path!r} is not a regular file") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"{path!r} is not a regular file")
            if self.owner and st.st_uid == os.geteuid():  # just created by us: the sandbox user's
                os.fchown(fd, *self.owner)
            os.set_blocking(fd, True)
            os.ftruncate(fd, 0)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def list(self, path: str = ".", recursive: bool = False, max_entries: int = 10_000) -> list[FileEntry]:
        """The entries of the directory `path`, sorted by name; with `recursive`, depth first (a directory's
        entries right after it; .git is not entered); at most `max_entries`. A name that is not UTF-8 keeps
        its bytes as surrogates (as os.listdir gives it), so a path listed can be given back to every call.

        A loop, not recursion: a tree may be thousands of directories deep. One directory is open at a time
        (the way back up is its '..', checked to be the directory we came down from), so depth costs no fds."""
        out: list[FileEntry] = []
        fd = self.resolve_dir(path)
        try:
            here = os.fstat(fd)
            # one frame per directory on the way down: (its path, its names not listed yet, last first, its identity)
            frames = [(self._relpath_of(fd), sorted(os.listdir(fd), reverse=True), (here.st_dev, here.st_ino))]
            while len(out) < max_entries:
                prefix, names, _ = frames[-1]
                if not names:
                    frames.pop()
                    if not frames:
                        break
                    fd = self._move(fd, "..", frames[-1][2], path)
                    continue
                name = names.pop()
                st = os.lstat(name, dir_fd=fd)
                kind = (
                    "dir"
                    if stat.S_ISDIR(st.st_mode)
                    else "file"
                    if stat.S_ISREG(st.st_mode)
                    else "symlink"
                    if stat.S_ISLNK(st.st_mode)
                    else "other"
                )
                rel = name if prefix in ("", ".") else f"{prefix}/{name}"
                out.append(FileEntry(rel, kind, st.st_size))
                if recursive and kind == "dir" and name != ".git":
                    fd = self._move(fd, name, (st.st_dev, st.st_ino), path)
                    frames.append((rel, sorted(os.listdir(fd), reverse=True), (st.st_dev, st.st_ino)))
        finally:
            os.close(fd)
        return out

    @staticmethod
    def _move(fd: int, name: str, expected: tuple[int, int], listed: str) -> int:
        """An fd of the directory `name` (a child, or '..') of the directory `fd`, and `fd` closed; the new
        one must be the directory `expected` (st_dev, st_ino) names, or the tree changed under the listing."""
        new = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
        st = os.fstat(new)
        if (st.st_dev, st.st_ino) != expected:
            os.close(new)
            raise ValueError(
                f"{listed!r} changed while it was being listed (a directory in it was moved); list it again"
            )
        os.close(fd)
        return new
