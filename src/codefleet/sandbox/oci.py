"""Reading OCI image archives: an `oci-layout` directory, a tarball of one, a `docker save` tarball.

`open_archive(path).image()` names an image's config digest and its layers (bottom first) with
their digests; `unpack_layer` unpacks one layer tar (plain or gzip'd) into a directory, checking
as it goes, and returns the sha256 of the blob and of the tar in it for the caller to compare with
what the manifest and config say. environments.py stores and merges the results.

An archive is hostile input. Whatever it holds is written only below the layer's directory, never
through a symlink: a member that is absolute, has `..` or lies under a symlink of its layer, a hard
link to anything but a regular file of its own layer, a relative symlink climbing above the root
are refused with one sentence naming the archive and the file; device nodes and FIFOs are dropped,
set-user-ID, set-group-ID and write bits cleared, owners not kept. Absolute symlinks are kept: they
resolve inside a sandbox. Whiteout files (`.wh.NAME`) are unpacked as they are, for the merge.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import stat
import tarfile
from typing import Self

from codefleet.sandbox.base import SandboxError

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_MAX_JSON_BYTES = 16 << 20
_MAX_DEPTH = 512  # path components of one member
DISK_RESERVE_BYTES = 1 << 30  # what an import leaves free on the store's disk
DISK_RESERVE_INODES = 10_000
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json",
                "application/vnd.docker.distribution.manifest.list.v2+json")


class ImageError(SandboxError):
    """An image archive was refused; nothing of it was stored."""


class Archive:
    """An image archive's files by name, and the image they describe."""

    def __init__(self, archive: str):
        self.archive = archive

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        pass

    def has(self, name: str) -> bool:
        raise NotImplementedError

    def open(self, name: str) -> io.BufferedIOBase:
        raise NotImplementedError

    def refuse(self, what: str) -> ImageError:
        return ImageError(f"cannot import {self.archive}: {what}")

    def read(self, name: str, digest_hex: str | None = None) -> bytes:
        """A small file of the archive, checked against `digest_hex` when given."""
        if not self.has(name):
            raise self.refuse(f"it has no {name}")
        with self.open(name) as f:
            data = f.read(_MAX_JSON_BYTES + 1)
        if len(data) > _MAX_JSON_BYTES:
            raise self.refuse(f"{name} is larger than {_MAX_JSON_BYTES >> 20} MB")
        if digest_hex is not None and hashlib.sha256(data).hexdigest() != digest_hex:
            raise self.refuse(f"{name} does not match its digest sha256:{digest_hex}")
        return data

    def blob(self, descriptor: dict) -> tuple[str, str]:
        """(the archive's name for the blob a descriptor points at, its digest's hex)."""
        digest_hex = _digest_hex(descriptor.get("digest"), self)
        return f"blobs/sha256/{digest_hex}", digest_hex

    def image(self) -> tuple[str, list[tuple[str, str | None, str]]]:
        """(config digest hex, [(blob name, blob digest hex or None, diff id hex)] bottom layer first)."""
        if self.has("index.json"):
            manifest_desc = self._pick_manifest(json.loads(self.read("index.json")), 0)
            manifest = json.loads(self.read(*self.blob(manifest_desc)))
            config_name, config_hex = self.blob(manifest["config"])
            blobs = [(*self.blob(d), d.get("mediaType", "")) for d in manifest["layers"]]
        elif self.has("manifest.json"):
            entries = json.loads(self.read("manifest.json"))
            if not isinstance(entries, list) or len(entries) != 1:
                raise self.refuse(f"its manifest.json lists {len(entries) if isinstance(entries, list) else 'no'} "
                                  "images; save exactly one image per archive")
            config_name = _archive_path(entries[0]["Config"], self)
            config_hex = hashlib.sha256(self.read(config_name)).hexdigest()
            named = _named_digest(config_name)
            if named is not None and named != config_hex:
                raise self.refuse(f"{config_name} does not match its digest sha256:{named}")
            blobs = [(_archive_path(n, self), _named_digest(n), "") for n in entries[0]["Layers"]]
        else:
            raise self.refuse("it has neither index.json (an OCI image layout) nor manifest.json (docker save)")
        config = json.loads(self.read(config_name, config_hex))
        diff_ids = [_digest_hex(d, self) for d in config["rootfs"]["diff_ids"]]
        if len(diff_ids) != len(blobs):
            raise self.refuse(f"its config names {len(diff_ids)} layers and its manifest {len(blobs)}")
        return config_hex, [(name, blob_hex, diff) for (name, blob_hex, _), diff in zip(blobs, diff_ids)]

    def _pick_manifest(self, index: dict, depth: int) -> dict:
        """The descriptor of the one image manifest for this machine's platform."""
        wanted = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
        found = [d for d in index.get("manifests", [])
                 if d.get("platform", {}).get("architecture", wanted) == wanted
                 and d.get("platform", {}).get("os", "linux") == "linux"]
        if len(found) != 1:
            raise self.refuse(f"its index lists {len(found)} images for linux/{wanted}; it must list exactly one")
        if found[0].get("mediaType") in _INDEX_TYPES:
            if depth >= 4:
                raise self.refuse("its indexes nest more than 4 deep")
            return self._pick_manifest(json.loads(self.read(*self.blob(found[0]))), depth + 1)
        return found[0]


class _DirArchive(Archive):
    def has(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.archive, name))

    def open(self, name: str) -> io.BufferedIOBase:
        return open(os.path.join(self.archive, name), "rb")


class _TarArchive(Archive):
    def __init__(self, archive: str):
        super().__init__(archive)
        try:
            self.tar = tarfile.open(archive, "r:*")
        except tarfile.ReadError:
            raise self.refuse("it is not a readable tar archive (corrupt, truncated, or of another format)") from None
        try:
            self.members = {os.path.normpath(m.name.lstrip("/")): m for m in self.tar.getmembers()}
        except BaseException:
            self.tar.close()
            raise

    def close(self) -> None:
        self.tar.close()

    def has(self, name: str) -> bool:
        member = self.members.get(name)
        return member is not None and (member.isfile() or member.islnk() or member.issym())

    def open(self, name: str) -> io.BufferedIOBase:
        f = self.tar.extractfile(self.members[name])
        if f is None:
            raise self.refuse(f"{name} is not a file")
        return f


def open_archive(archive: str) -> Archive:
    if os.path.isdir(archive):
        return _DirArchive(archive)
    if not os.path.isfile(archive):
        raise ImageError(f"cannot import {archive}: no such file or directory")
    return _TarArchive(archive)


def _digest_hex(digest: object, source: Archive) -> str:
    match = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if match is None:
        raise source.refuse(f"it names the digest {digest!r}; only sha256:<64 hex digits> is supported")
    return match.group(1)


def _named_digest(name: str) -> str | None:
    """The digest a docker-save file name carries (`blobs/sha256/<hex>`, `<hex>.json`), if any."""
    match = re.fullmatch(r"(?:blobs/sha256/)?([0-9a-f]{64})(?:\.json)?", name)
    return match.group(1) if match else None


def _archive_path(name: object, source: Archive) -> str:
    if not isinstance(name, str) or name.startswith("/") or ".." in name.split("/"):
        raise source.refuse(f"its manifest.json names the file {name!r}, outside the archive")
    return os.path.normpath(name)


class _Hashing(io.RawIOBase):
    """A reader that hashes what passes through it."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.f.read(len(buffer))
        buffer[:len(data)] = data
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
            raise self.refuse("is compressed with zstd, which this codefleet cannot read; save the image with "
                              "gzip or uncompressed layers (docker save, or skopeo copy without --dest-compress)")
        stream = gzip.GzipFile(fileobj=blob_buf, mode="rb") if magic[:2] == b"\x1f\x8b" else blob_buf
        tar_hash = _Hashing(stream)
        tar_buf = io.BufferedReader(tar_hash, 1 << 20)
        with tarfile.open(fileobj=tar_buf, mode="r|") as tar:
            for member in tar:
                self.extract(tar, member)
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
        raise self.refuse(f"has the member {name!r} under {parent!r}, which is not a directory "
                          f"({'a symlink' if stat.S_ISLNK(st.st_mode) else 'a file'})")

    def extract(self, tar: tarfile.TarFile, member: tarfile.TarInfo) -> None:
        rel = self.path(member.name)
        if not rel:
            return  # the root itself: its mode is the store's
        if member.ischr() or member.isblk() or member.isfifo():
            return  # device nodes and FIFOs are dropped
        self.bytes_left -= member.size if member.isreg() else 0
        self.inodes_left -= 1
        if self.bytes_left < 0 or self.inodes_left < 0:
            raise self.refuse(f"does not fit on the disk of {self.dest!r} with {DISK_RESERVE_BYTES >> 30} GB and "
                              f"{DISK_RESERVE_INODES} inodes to spare (at {member.name!r}); free some space")
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
                raise self.refuse(f"has the symlink {member.name!r} -> {target!r}, which points outside the "
                                  "image's root")
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
                raise self.refuse(f"has the hard link {member.name!r} -> {member.linkname!r}, which is not a "
                                  "regular file of the same layer")
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
