"""Reading OCI image archives: an `oci-layout` directory, a tarball of one, a `docker save` tarball.

`open_archive(path).image()` names an image's config digest and its layers (bottom first) with
their digests; oci_layer.py unpacks each layer blob. environments.py stores and merges the results.

An archive is hostile input. Reading it follows nothing out of it: a file of an oci-layout directory
is opened without following a symlink (one there, a FIFO or a device is refused by what it is, and
nothing of what it points at is read or hashed), a link in a tarball resolves to a file of that
tarball or is refused, a tarball of more than 100,000 members is refused before they fill memory, and
so is a tar header (pax, GNU long name) over 1 MB. JSON is read only up to 16 MB (by its size, before
reading it) and 32 levels deep, and must have the shape the specification gives.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import stat
import tarfile
from typing import Self

from codefleet.sandbox.base import SandboxError

_DIGEST = re.compile(r"sha256:([0-9a-f]{64})")
_MAX_JSON_BYTES = 16 << 20
_MAX_JSON_DEPTH = 32  # an OCI manifest or config nests 5 deep
_MAX_MEMBERS = 100_000  # of an archive tarball (an image has a few per layer)
_MAX_HEADER_BYTES = 1 << 20  # a pax or GNU long-name header of a tar, read whole into memory
_MAX_LINK_HOPS = 8
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


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

    def open_sized(self, name: str) -> tuple[io.BufferedIOBase, int]:
        """The archive's regular file `name` and its size; refused if it is anything else."""
        raise NotImplementedError

    def open(self, name: str) -> io.BufferedIOBase:
        return self.open_sized(name)[0]

    def refuse(self, what: str) -> ImageError:
        return ImageError(f"cannot import {self.archive}: {what}")

    def read(self, name: str, digest_hex: str | None = None) -> bytes:
        """A small file of the archive, checked against `digest_hex` when given."""
        if not self.has(name):
            raise self.refuse(f"it has no {name}")
        f, size = self.open_sized(name)
        with f:
            if size > _MAX_JSON_BYTES:
                raise self.refuse(f"{name} is larger than {_MAX_JSON_BYTES >> 20} MB")
            data = f.read(_MAX_JSON_BYTES + 1)
        if len(data) > _MAX_JSON_BYTES:
            raise self.refuse(f"{name} is larger than {_MAX_JSON_BYTES >> 20} MB")
        if digest_hex is not None and hashlib.sha256(data).hexdigest() != digest_hex:
            raise self.refuse(f"{name} does not match its digest sha256:{digest_hex}")
        return data

    def read_json(self, name: str, digest_hex: str | None = None, kind: type = dict):
        """A JSON file of the archive, a `kind` (dict or list), at most _MAX_JSON_DEPTH deep."""
        try:
            value = json.loads(self.read(name, digest_hex))
        except RecursionError:
            value = None
        except ValueError:  # not JSON, or not UTF-8/16/32
            raise self.refuse(f"{name} is not valid JSON") from None
        if value is None or _json_depth(value) > _MAX_JSON_DEPTH:
            raise self.refuse(f"{name} is nested deeper than {_MAX_JSON_DEPTH} levels")
        if not isinstance(value, kind):
            raise self.refuse(f"{name} is not a JSON {'object' if kind is dict else 'array'}")
        return value

    def objects(self, value: object, what: str) -> list[dict]:
        """`value`, which the spec says is a list of objects; refused if it is not."""
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise self.refuse(f"{what} is not a list of objects")
        return value

    def blob(self, descriptor: dict) -> tuple[str, str]:
        """(the archive's name for the blob a descriptor points at, its digest's hex)."""
        digest_hex = _digest_hex(descriptor.get("digest"), self)
        return f"blobs/sha256/{digest_hex}", digest_hex

    def image(self) -> tuple[str, list[tuple[str, str | None, str]]]:
        """(config digest hex, [(blob name, blob digest hex or None, diff id hex)] bottom layer first)."""
        if self.has("index.json"):
            manifest_desc = self._pick_manifest(self.read_json("index.json"), "index.json", 0)
            manifest_name, manifest_hex = self.blob(manifest_desc)
            manifest = self.read_json(manifest_name, manifest_hex)
            config_desc = manifest.get("config")
            if not isinstance(config_desc, dict):
                raise self.refuse(f"{manifest_name}'s config is not an object")
            config_name, config_hex = self.blob(config_desc)
            blobs = [
                (*self.blob(d), d.get("mediaType", ""))
                for d in self.objects(manifest.get("layers"), f"{manifest_name}'s layers")
            ]
        elif self.has("manifest.json"):
            entries = self.read_json("manifest.json", kind=list)
            if len(entries) != 1 or not isinstance(entries[0], dict):
                raise self.refuse(f"its manifest.json lists {len(entries)} images; save exactly one image per archive")
            layer_names = entries[0].get("Layers")
            if not isinstance(layer_names, list):
                raise self.refuse("its manifest.json's Layers is not a list")
            config_name = _archive_path(entries[0].get("Config"), self)
            config_hex = hashlib.sha256(self.read(config_name)).hexdigest()
            named = _named_digest(config_name)
            if named is not None and named != config_hex:
                raise self.refuse(f"{config_name} does not match its digest sha256:{named}")
            blobs = [(_archive_path(n, self), _named_digest(n), "") for n in layer_names]
        else:
            raise self.refuse("it has neither index.json (an OCI image layout) nor manifest.json (docker save)")
        rootfs = self.read_json(config_name, config_hex).get("rootfs")
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        if not isinstance(diff_ids, list):
            raise self.refuse(f"{config_name}'s rootfs.diff_ids is not a list")
        diff_ids = [_digest_hex(d, self) for d in diff_ids]
        if len(diff_ids) != len(blobs):
            raise self.refuse(f"its config names {len(diff_ids)} layers and its manifest {len(blobs)}")
        return config_hex, [(name, blob_hex, diff) for (name, blob_hex, _), diff in zip(blobs, diff_ids)]

    def _pick_manifest(self, index: dict, name: str, depth: int) -> dict:
        """The descriptor of the one image manifest for this machine's platform."""
        wanted = {"x86_64": "amd64", "aarch64": "arm64"}.get(os.uname().machine, os.uname().machine)
        manifests = self.objects(index.get("manifests"), f"{name}'s manifests")
        platforms = [d.get("platform") if isinstance(d.get("platform"), dict) else {} for d in manifests]
        found = [
            d
            for d, platform in zip(manifests, platforms)
            if platform.get("architecture", wanted) == wanted and platform.get("os", "linux") == "linux"
        ]
        if len(found) != 1:
            raise self.refuse(f"its index lists {len(found)} images for linux/{wanted}; it must list exactly one")
        if found[0].get("mediaType") in _INDEX_TYPES:
            if depth >= 4:
                raise self.refuse("its indexes nest more than 4 deep")
            nested_name, nested_hex = self.blob(found[0])
            return self._pick_manifest(self.read_json(nested_name, nested_hex), nested_name, depth + 1)
        return found[0]


def _json_depth(value: object) -> int:
    """How deep lists and objects nest in `value` (a scalar is 0), without recursion."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        here, depth = todo.pop()
        children = here.values() if isinstance(here, dict) else here if isinstance(here, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            if depth <= _MAX_JSON_DEPTH:  # past it, the answer is already "too deep"
                todo += [(child, depth + 1) for child in children]
    return deepest


class _DirArchive(Archive):
    """An oci-layout directory. Its files are opened below it one name at a time, following no symlink."""

    def has(self, name: str) -> bool:
        return os.path.lexists(os.path.join(self.archive, name))

    def open_sized(self, name: str) -> tuple[io.BufferedIOBase, int]:
        parts = name.split("/")
        fd = os.open(self.archive, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_NONBLOCK if last else os.O_DIRECTORY)
                try:
                    child = os.open(part, flags, dir_fd=fd)
                except OSError as e:
                    st = os.lstat(part, dir_fd=fd) if e.errno in (errno.ELOOP, errno.ENOTDIR) else None
                    if st is None:
                        raise
                    raise self.refuse(
                        f"{'/'.join(parts[: i + 1])} is {_kind(st.st_mode)}, not "
                        f"{'a regular file' if last else 'a directory'}"
                    ) from None
                os.close(fd)
                fd = child
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO opened without waiting, a device
                raise self.refuse(f"{name} is {_kind(st.st_mode)}, not a regular file")
            os.set_blocking(fd, True)
            f = os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        return f, st.st_size


def _kind(mode: int) -> str:
    return {
        stat.S_IFLNK: "a symlink",
        stat.S_IFIFO: "a FIFO",
        stat.S_IFSOCK: "a socket",
        stat.S_IFCHR: "a device",
        stat.S_IFBLK: "a device",
        stat.S_IFDIR: "a directory",
        stat.S_IFREG: "a regular file",
    }.get(stat.S_IFMT(mode), "not a file")


class CappedTarInfo(tarfile.TarInfo):
    """A tar header whose extended headers (pax, GNU long names), which tarfile reads whole into memory, are
    refused past _MAX_HEADER_BYTES: a few kB of gzip could otherwise ask for gigabytes."""

    def _proc_member(self, tarfile_):
        if (
            self.type in tarfile.GNU_TYPES + (tarfile.XHDTYPE, tarfile.XGLTYPE, tarfile.SOLARIS_XHDTYPE)
            and self.type != tarfile.GNUTYPE_SPARSE
            and self.size > _MAX_HEADER_BYTES
        ):
            raise HeaderTooLarge(f"has a tar header of {self.size} bytes (more than {_MAX_HEADER_BYTES >> 20} MB)")
        return super()._proc_member(tarfile_)


class HeaderTooLarge(ValueError):
    """A tar header past _MAX_HEADER_BYTES (the caller names the archive or layer)."""


class _TarArchive(Archive):
    def __init__(self, archive: str):
        super().__init__(archive)
        try:
            self.tar = tarfile.open(archive, "r:*", tarinfo=CappedTarInfo)
        except tarfile.ReadError:
            raise self.refuse("it is not a readable tar archive (corrupt, truncated, or of another format)") from None
        except HeaderTooLarge as e:
            raise self.refuse(f"it {e}") from None
        try:
            self.members: dict[str, tarfile.TarInfo] = {}
            for member in self.tar:
                if len(self.members) >= _MAX_MEMBERS:
                    raise self.refuse(f"it has more than {_MAX_MEMBERS} members; an image archive has a few per layer")
                self.members[os.path.normpath(member.name.lstrip("/"))] = member
        except HeaderTooLarge as e:
            self.tar.close()
            raise self.refuse(f"it {e}") from None
        except BaseException:
            self.tar.close()
            raise

    def close(self) -> None:
        self.tar.close()

    def has(self, name: str) -> bool:
        member = self.members.get(name)
        return member is not None and (member.isfile() or member.islnk() or member.issym())

    def open_sized(self, name: str) -> tuple[io.BufferedIOBase, int]:
        """A link resolves to a member of this archive (docker save links a layer two images share), never
        further than _MAX_LINK_HOPS and never out of it."""
        member = first = self.members.get(name)
        for _ in range(_MAX_LINK_HOPS):
            if member is None or not (member.issym() or member.islnk()):
                break
            target = member.linkname if member.islnk() else os.path.join(os.path.dirname(member.name), member.linkname)
            member = self.members.get(os.path.normpath(target.lstrip("/")))
        if member is None or not member.isfile():
            linked = first is not None and (first.issym() or first.islnk())
            raise self.refuse(
                f"{name} is a link that does not end at a file of the archive"
                if linked
                else f"{name} is not a regular file"
            )
        f = self.tar.extractfile(member)
        if f is None:
            raise self.refuse(f"{name} is not a file")
        return f, member.size


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
