"""What a user brings to `tasks mine`, unpacked with caps: an sdist (a tar, plain or gzip/bz2/xz, or a zip) or a
source folder, copied into a fresh directory.

    unpack_source("attrs-23.1.0.tar.gz", dest, UnpackLimits(max_bytes=256 << 20, max_files=20_000))

The source is hostile: a 1 MiB gzip of zeros is 1 GiB on disk, a member may be named `../../etc/x`, a symlink
may point at the host's files. So:

- at most `max_bytes` of file content and `max_files` entries (files, directories, links) are written. Bytes
  are counted as they are written, never taken from a header, and the decompressed archive stream itself is
  cut off a little past `max_bytes` (a tar header can hold a huge pax record); a zip or tar larger on disk
  than `max_bytes` is not opened.
- a name must be relative, without `..` or NUL, at most 1,024 characters and 64 levels deep.
- every file is created anew (O_EXCL | O_NOFOLLOW) under a directory this unpacking made, so nothing is
  written outside `dest` or through a symlink; modes are 0644 or 0755 (no set-ID bits), owners are not kept.
- a symlink is kept only if it is relative and resolves inside the tree (checked as written, and again once
  every member is out, since symlinks can chain); a hard link becomes a copy of a file unpacked before it;
  device files, FIFOs and sockets are refused.
- a folder is read the same way: each entry is opened relative to its directory's descriptor with O_NOFOLLOW,
  so a symlink in the folder is never followed (one pointing out of it is refused).
- `__pycache__` and `*.pyc` are left out (and a folder's `.git`).

The first breach is one `UnpackError` that names the source, the member and the rule or cap, and how to
raise a cap; the caller removes `dest` (mine.py unpacks into a temporary directory).
"""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import stat
import tarfile
import zipfile
import zlib
from dataclasses import dataclass

_MAX_NAME_CHARS = 1024
_MAX_DEPTH = 64
_MAX_LINK_CHARS = 4096
_HEADER_SLACK_BYTES = 1536  # per entry, what a tar's headers may add to the stream beyond the file data
_CHUNK = 1 << 20
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tar.xz", ".tar", ".zip")


@dataclass(frozen=True)
class UnpackLimits:
    """Caps on what one source may unpack to (`tasks mine --max-unpacked-mb / --max-files`)."""

    max_bytes: int = 256 << 20  # file content in all; also the most an archive may weigh, or a download
    max_files: int = 20_000  # files, directories and links


class UnpackError(RuntimeError):
    """A source that breaks a rule or a cap while it is unpacked; the message says which and what to do."""


class _Tree:
    """The tree being written under `dest`: only what this object made is ever written into."""

    def __init__(self, source: str, dest: str, limits: UnpackLimits):
        self.source, self.dest, self.limits = source, dest, limits
        self.dirs: set[str] = {""}
        self.files: set[str] = set()
        self.links: set[str] = set()
        self.bytes_left = limits.max_bytes
        self.entries_left = limits.max_files
        os.mkdir(dest, 0o755)

    def refuse(self, what: str) -> UnpackError:
        return UnpackError(f"{self.source!r} {what}")

    def too_big(self, name: str) -> UnpackError:
        mib = self.limits.max_bytes / (1 << 20)
        return self.refuse(
            f"unpacks to more than {mib:g} MiB (at {name[:200]!r}); if it is genuine, raise the "
            "cap with --max-unpacked-mb (UnpackLimits.max_bytes)"
        )

    def rel(self, name: str) -> str:
        """A member name as a path relative to the tree ('' for the tree itself), or refused."""
        if "\0" in name or len(name) > _MAX_NAME_CHARS:
            raise self.refuse(
                f"has a member whose name is longer than {_MAX_NAME_CHARS} characters or holds a "
                f"NUL ({name[:100]!r}...); it is not a source distribution to mine"
            )
        if name.startswith("/") or ".." in name.split("/"):
            raise self.refuse(f"has the member {name[:200]!r}, which points outside the tree; refusing to unpack it")
        rel = os.path.normpath(name)
        rel = "" if rel == "." else rel
        if rel.count("/") >= _MAX_DEPTH:
            raise self.refuse(f"has the member {name[:100]!r}..., nested more than {_MAX_DEPTH} deep")
        return rel

    def entry(self, rel: str, name: str) -> str:
        """Count one new entry at `rel`, make its parent directories; its absolute path."""
        if rel in self.dirs or rel in self.files or rel in self.links:
            raise self.refuse(f"lists {name[:200]!r} twice; refusing to unpack it")
        self.entries_left -= 1
        if self.entries_left < 0:
            raise self.refuse(
                f"has more than {self.limits.max_files} files, directories and links (at "
                f"{name[:200]!r}); if it is genuine, raise the cap with --max-files "
                "(UnpackLimits.max_files)"
            )
        self.parent(os.path.dirname(rel), name)
        return os.path.join(self.dest, rel)

    def parent(self, rel: str, name: str) -> None:
        if rel in self.dirs:
            return
        if rel in self.files or rel in self.links:
            raise self.refuse(
                f"has the member {name[:200]!r} under {rel!r}, which is not a directory "
                f"({'a symlink' if rel in self.links else 'a file'}); refusing to unpack it"
            )
        self.parent(os.path.dirname(rel), name)
        self.mkdir(rel, name)

    def mkdir(self, rel: str, name: str) -> None:
        if not rel or rel in self.dirs:
            return  # a directory may be listed after the files in it
        path = self.entry(rel, name)
        os.mkdir(path, 0o755)
        self.dirs.add(rel)

    def write(self, rel: str, name: str, data: io.BufferedIOBase, mode: int, size_hint: int = 0) -> None:
        """A regular file from `data`, counted as it is written."""
        if size_hint > self.bytes_left:
            raise self.too_big(name)
        path = self.entry(rel, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as out:
            while chunk := data.read(min(_CHUNK, self.bytes_left + 1)):
                self.bytes_left -= len(chunk)
                if self.bytes_left < 0:
                    raise self.too_big(name)
                out.write(chunk)
            os.fchmod(out.fileno(), 0o755 if mode & 0o111 else 0o644)
        self.files.add(rel)

    def symlink(self, rel: str, name: str, target: str) -> None:
        climbs = os.path.normpath(os.path.join(os.path.dirname(rel), target)).split("/")[0] == ".."
        if not target or "\0" in target or len(target) > _MAX_LINK_CHARS or target.startswith("/") or climbs:
            raise self.refuse(
                f"has the symlink {name[:200]!r} -> {target[:200]!r}, which points outside the tree; "
                "refusing to unpack it (remove the link, or make it relative and inside the tree)"
            )
        os.symlink(target, self.entry(rel, name))
        self.links.add(rel)

    def copy(self, rel: str, name: str, target_name: str) -> None:
        """A hard link, as a copy of a regular file this tree already holds."""
        target = self.rel(target_name)
        if target not in self.files:
            raise self.refuse(
                f"has the hard link {name[:200]!r} -> {target_name[:200]!r}, which is not a file "
                "unpacked before it; refusing to unpack it"
            )
        src = os.path.join(self.dest, target)
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            self.write(rel, name, f, os.fstat(fd).st_mode, os.fstat(fd).st_size)

    def finish(self) -> None:
        """Every symlink, now that all are written, resolves inside the tree (one may lead through another)."""
        top = os.path.realpath(self.dest)
        for rel in sorted(self.links):
            real = os.path.realpath(os.path.join(self.dest, rel))
            if real != top and not real.startswith(top + "/"):
                target = os.readlink(os.path.join(self.dest, rel))
                raise self.refuse(
                    f"has the symlink {rel!r} -> {target!r}, which leads outside the tree through "
                    "other symlinks; refusing to unpack it"
                )


class _Capped(io.RawIOBase):
    """A reader that refuses to go past `limit` bytes (a decompressed archive stream)."""

    def __init__(self, f, limit: int, tree: _Tree):
        self.f, self.left, self.tree = f, limit, tree

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.f.read(min(len(buffer), self.left + 1))
        self.left -= len(data)
        if self.left < 0:
            raise self.tree.too_big("the archive's stream")
        buffer[: len(data)] = data
        return len(data)


def _skipped(rel: str) -> bool:
    return rel.endswith(".pyc") or "__pycache__" in rel.split("/")


def _decompressed(f: io.BufferedReader):
    magic = f.peek(6)[:6]
    if magic[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f, mode="rb")
    if magic[:3] == b"BZh":
        return bz2.BZ2File(f)
    if magic == b"\xfd7zXZ\x00":
        return lzma.LZMAFile(f)
    return f


def _unpack_tar(tree: _Tree, f: io.BufferedReader) -> None:
    limit = tree.limits.max_bytes + tree.limits.max_files * _HEADER_SLACK_BYTES + _CHUNK
    stream = io.BufferedReader(_Capped(_decompressed(f), limit, tree), _CHUNK)
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            rel = tree.rel(member.name)
            if _skipped(rel):
                continue
            if member.isdir():
                tree.mkdir(rel, member.name)
            elif not rel:
                raise tree.refuse(f"has a non-directory member at its root ({member.name!r}); refusing to unpack it")
            elif member.isreg():
                tree.write(rel, member.name, tar.extractfile(member), member.mode, member.size)
            elif member.issym():
                tree.symlink(rel, member.name, member.linkname)
            elif member.islnk():
                tree.copy(rel, member.name, member.linkname)
            else:
                raise tree.refuse(
                    f"has the member {member.name[:200]!r}, a device file, FIFO or other special "
                    "file; refusing to unpack it"
                )


def _unpack_zip(tree: _Tree, f: io.BufferedReader) -> None:
    with zipfile.ZipFile(f) as archive:
        for info in archive.infolist():
            rel = tree.rel(info.filename)
            if _skipped(rel):
                continue
            kind = stat.S_IFMT(info.external_attr >> 16)
            if info.is_dir() or kind == stat.S_IFDIR:
                tree.mkdir(rel, info.filename)
            elif not rel:
                raise tree.refuse(f"has a non-directory member at its root ({info.filename!r})")
            elif kind == stat.S_IFLNK:
                with archive.open(info) as link:
                    tree.symlink(rel, info.filename, link.read(_MAX_LINK_CHARS + 1).decode("utf-8", "replace"))
            elif kind in (0, stat.S_IFREG):
                with archive.open(info) as data:
                    tree.write(rel, info.filename, data, info.external_attr >> 16, info.file_size)
            else:
                raise tree.refuse(
                    f"has the member {info.filename[:200]!r}, a device file, FIFO or other special "
                    "file; refusing to unpack it"
                )


def _copy_folder(tree: _Tree, dir_fd: int, rel: str) -> None:
    with os.scandir(dir_fd) as it:
        names = sorted(entry.name for entry in it)
    for name in names:
        if name == ".git" or _skipped(name):
            continue
        child = os.path.join(rel, name)
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            tree.mkdir(tree.rel(child), child)
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                _copy_folder(tree, fd, child)
            finally:
                os.close(fd)
        elif stat.S_ISREG(st.st_mode):
            # O_NONBLOCK: were the file swapped for a FIFO since the stat, opening it does not hang
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise tree.refuse(f"changed while it was copied (at {child!r}); try again")
                tree.write(tree.rel(child), child, f, st.st_mode, st.st_size)
        elif stat.S_ISLNK(st.st_mode):
            tree.symlink(tree.rel(child), child, os.readlink(name, dir_fd=dir_fd))
        else:
            raise tree.refuse(
                f"holds {child!r}, a device file, FIFO or socket; remove it, or mine a copy of the folder without it"
            )


def unpack_source(source: str, dest: str, limits: UnpackLimits | None = None) -> None:
    """Unpack the archive or copy the folder `source` into `dest` (which must not exist yet), within `limits`
    and the rules of the module docstring; UnpackError at the first breach."""
    tree = _Tree(source, dest, limits or UnpackLimits())
    if os.path.isdir(source):
        try:
            top = os.open(source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the folder the user named
        except OSError as e:
            raise tree.refuse(f"cannot be read ({e.strerror or e}); check the path") from None
        try:
            _copy_folder(tree, top, "")
        except OSError as e:
            raise tree.refuse(
                f"could not be copied into {dest!r} ({e}); check that you may read all of it and "
                "that the temporary directory (TMPDIR) has room"
            ) from None
        finally:
            os.close(top)
        tree.finish()
        return
    try:
        size = os.path.getsize(source)
    except OSError as e:
        raise tree.refuse(f"cannot be read ({e.strerror or e}); check the path") from None
    if size > tree.limits.max_bytes:
        raise tree.too_big(os.path.basename(source))
    kind = "zip archive" if source.endswith(".zip") else "tarball"
    try:
        with open(source, "rb") as raw:
            f = io.BufferedReader(raw, _CHUNK)
            if f.peek(4)[:4] in (b"PK\x03\x04", b"PK\x05\x06"):
                kind = "zip archive"
                _unpack_zip(tree, f)
            else:
                _unpack_tar(tree, f)
    except (
        tarfile.TarError,
        zipfile.BadZipFile,
        gzip.BadGzipFile,
        EOFError,
        zlib.error,
        lzma.LZMAError,
        NotImplementedError,
    ) as e:
        raise tree.refuse(f"is not a readable {kind} ({e}); download the sdist again") from None
    except OSError as e:
        raise tree.refuse(
            f"could not be unpacked into {dest!r} ({e}); check that the temporary directory (TMPDIR) has room"
        ) from None
    except RuntimeError as e:
        if isinstance(e, UnpackError):
            raise
        raise tree.refuse(f"is not a readable {kind} ({e}); an encrypted zip cannot be mined") from None
    tree.finish()
