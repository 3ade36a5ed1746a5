"""Unpacking one layer of an OCI image: a tar, plain or gzip'd, into a directory of the store.

`unpack_layer` checks as it goes and returns the sha256 of the blob and of the tar in it, for
environments.py to compare with what the manifest and config say.

A layer is hostile input. Whatever it holds is written only below the layer's directory, never
through a symlink: a member that is absolute, has `..` or lies under a symlink of its layer, a hard
link to anything but a regular file of its own layer, a relative symlink climbing above the root
are refused with one sentence naming the archive and the file; device nodes and FIFOs are dropped,
set-user-ID, set-group-ID and write bits cleared, owners not kept; a tar header over 1 MB is refused
(oci.CappedTarInfo), and so is what would leave less than 1 GB or 10,000 inodes free on the store's
disk. Absolute symlinks are kept: they resolve inside a sandbox. Whiteout files (`.wh.NAME`) are
unpacked as they are, for the merge.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import shutil
import stat
import tarfile

from codefleet.sandbox.oci import Archive, CappedTarInfo, HeaderTooLarge, ImageError

_MAX_DEPTH = 512  # path components of one member
DISK_RESERVE_BYTES = 1 << 30  # what an import leaves free on the store's disk
DISK_RESERVE_INODES = 10_000


class _Hashing(io.RawIOBase):
    """A reader that hashes what passes through it."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.f.read(len(buffer))
        buffer[: len(data)] = data
        self.sha.update(data)
        return len(data)


class _Layer:
    """One layer tar unpacked into `dest`, never through a symlink, nothing outside `dest`, and never past the
    disk's free space or inodes less a reserve (a small archive can expand to fill a disk)."""

    def __init__(self, dest: str, source: Archive, name: str):
        self.dest, self.source, self.name = dest, source, name
        self.dirs: dict[str, tuple[int, int]] = {"": (0o755, 0)}  # real directories made: (mode, mtime)
        disk = os.statvfs(dest)
        self.bytes_left = disk.f_bavail * disk.f_frsize - DISK_RESERVE_BYTES
        self.inodes_left = disk.f_favail - DISK_RESERVE_INODES if disk.f_files else 1 << 62  # 0 files: no limit

    def unpack(self, raw) -> tuple[str, str]:
        """Unpack; (sha256 of the blob, sha256 of the tar in it)."""
        blob = _Hashing(raw)
        blob_buf = io.BufferedReader(blob, 1 << 20)
        magic = blob_buf.peek(4)[:4]
        if magic == b"\x28\xb5\x2f\xfd":
            raise self.refuse(
                "is compressed with zstd, which this codefleet cannot read; save the image with "
                "gzip or uncompressed layers (docker save, or skopeo copy without --dest-compress)"
            )
        stream = gzip.GzipFile(fileobj=blob_buf, mode="rb") if magic[:2] == b"\x1f\x8b" else blob_buf
        tar_hash = _Hashing(stream)
        tar_buf = io.BufferedReader(tar_hash, 1 << 20)
        try:
            with tarfile.open(fileobj=tar_buf, mode="r|", tarinfo=CappedTarInfo) as tar:
                for member in tar:
                    self.extract(tar, member)
        except HeaderTooLarge as e:
            raise self.refuse(str(e)) from None
        while tar_buf.read(1 << 20):  # the tar's padding, then the compressed stream's end: all of it is hashed
            pass
        while blob_buf.read(1 << 20):
            pass
        self.seal()
        return blob.sha.hexdigest(), tar_hash.sha.hexdigest()

    def refuse(self, what: str) -> ImageError:
        return self.source.refuse(f"its layer {self.name} {what}")

    def path(self, name: str, what: str = "member") -> str:
        """A member name as a path relative to the root ('' for the root itself), or refused."""
        if name.startswith("/") or ".." in name.split("/"):
            raise self.refuse(f"has the {what} {name!r}, which points outside the image's root")
        rel = os.path.normpath(name)
        rel = "" if rel == "." else rel
        if rel.count("/") >= _MAX_DEPTH:
            raise self.refuse(f"has the {what} {name[:100]!r}..., nested more than {_MAX_DEPTH} deep")
        return rel

    def parent_dir(self, rel: str, name: str) -> None:
        """Make sure every directory above `rel` is a real directory of this layer (made if missing)."""
        parent = os.path.dirname(rel)
        if parent in self.dirs:
            return
        self.parent_dir(parent, name)
        path = os.path.join(self.dest, parent)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            os.mkdir(path, 0o700)
            self.dirs[parent] = (0o755, 0)
            return
        raise self.refuse(
            f"has the member {name!r} under {parent!r}, which is not a directory "
            f"({'a symlink' if stat.S_ISLNK(st.st_mode) else 'a file'})"
        )

    def extract(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        rel = self.path(member.name)
        if not rel:
            return  # the root itself: its mode is the store's
        if member.ischr() or member.isblk() or member.isfifo():
            return  # device nodes and FIFOs are dropped
        self.bytes_left -= member.size if member.isreg() else 0
        self.inodes_left -= 1
        if self.bytes_left < 0 or self.inodes_left < 0:
            raise self.refuse(
                f"does not fit on the disk of {self.dest!r} with {DISK_RESERVE_BYTES >> 30} GB and "
                f"{DISK_RESERVE_INODES} inodes to spare (at {member.name!r}); free some space"
            )
        self.parent_dir(rel, member.name)
        path = os.path.join(self.dest, rel)
        try:
            existing = os.lstat(path)
        except FileNotFoundError:
            existing = None
        if member.isdir():
            if existing is not None and not stat.S_ISDIR(existing.st_mode):
                os.unlink(path)
                existing = None
            if existing is None:
                os.mkdir(path, 0o700)
            self.dirs[rel] = (member.mode, int(member.mtime))
            return
        if existing is not None and stat.S_ISDIR(existing.st_mode):
            raise self.refuse(f"replaces its own directory {member.name!r} with a file")
        if existing is not None:
            os.unlink(path)
        if member.isreg():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                shutil.copyfileobj(tar.extractfile(member), out, 1 << 20)
                out.flush()
                os.fchmod(fd, member.mode & 0o555)  # no set-ID bits, no write bits
                os.utime(fd, (member.mtime, member.mtime))
        elif member.issym():
            target = member.linkname
            climbs = os.path.normpath(os.path.join(os.path.dirname(rel), target)).split("/")[0] == ".."
            if not target or (not target.startswith("/") and climbs):
                raise self.refuse(
                    f"has the symlink {member.name!r} -> {target!r}, which points outside the image's root"
                )
            os.symlink(target, path)
        elif member.islnk():
            target = self.path(member.linkname, "hard link target")
            st = None
            if os.path.dirname(target) in self.dirs:  # under real directories of this layer only
                try:
                    st = os.lstat(os.path.join(self.dest, target))
                except FileNotFoundError:
                    pass
            if st is None or not stat.S_ISREG(st.st_mode):
                raise self.refuse(
                    f"has the hard link {member.name!r} -> {member.linkname!r}, which is not a "
                    "regular file of the same layer"
                )
            os.link(os.path.join(self.dest, target), path, follow_symlinks=False)
        else:
            raise self.refuse(f"has the member {member.name!r} of an unsupported type {member.type!r}")

    def seal(self) -> None:
        """Directories take their modes (no set-ID or write bits) and times, deepest first."""
        for rel in sorted(self.dirs, key=lambda r: r.count("/"), reverse=True):
            if rel:
                mode, mtime = self.dirs[rel]
                path = os.path.join(self.dest, rel)
                os.chmod(path, (mode & 0o1555) | 0o500)  # the importer may still walk and link it
                os.utime(path, (mtime, mtime), follow_symlinks=False)


def unpack_layer(archive: Archive, name: str, dest: str) -> tuple[str, str]:
    """Unpack the layer blob `name` of `archive` into the empty directory `dest`;
    (sha256 of the blob, sha256 of the tar in it)."""
    with archive.open(name) as raw:
        return _Layer(dest, archive, name).unpack(raw)
