"""Environments: the userland a sandbox's commands run in, and OCI images as environments.

An `Environment` names a root filesystem directory. A sandbox whose
`SandboxConfig.environment` is that directory binds its /usr, /bin, /sbin,
/lib*, /etc and /opt read-only in place of the host's (bwrap.py); `HOST`, no
directory, is the host's own userland, the default. `import_image` makes an
environment from an OCI image: an `oci-layout` directory, a tarball of one, or
a `docker save` tarball. No registry is ever contacted.

The store (`default_store_dir()`; `CODEFLEET_ENV_DIR` or the `store_dir`
argument to change it) is content-addressed:

    layers/sha256-<diff id>/           one layer, unpacked once; whiteouts kept as `.wh.` files
    images/sha256-<config digest>/     image.json and rootfs/, the image's layers merged

A layer is keyed by the digest of its uncompressed tar (its "diff id"), so the
same layer shipped gzip'd in one image and plain in another is stored once. A
rootfs is made of hard links to its layers' files (only its directories and
symlinks are its own), so file contents shared by many images are stored once
on disk, and a sandbox needs no mount for its environment: bwrap binds
directories of the rootfs, and nothing is left mounted when it exits.
Whiteouts are applied while merging, as overlayfs applies them: `.wh.NAME`
removes NAME of the layers below, `.wh..wh..opq` hides everything the layers
below hold in its directory. An image is keyed by its config's digest, which
names its layers: the same image imported from either kind of archive is one
rootfs.

An image is hostile input. oci.py reads the archive, oci_layer.py unpacks each layer,
refusing what would land outside the root; here every blob is checked
against its sha256 digest and every layer against its diff id, and a refused
import leaves nothing in the store: each layer and each rootfs is made in a
temporary directory and renamed into place whole. Nothing here follows a
symlink of the image on the host: the merge walks only directories it made.
"""

from __future__ import annotations

import errno
import gzip
import json
import os
import shutil
import stat
import tarfile
import tempfile
import zlib
from dataclasses import dataclass

from codefleet.sandbox.layers import remove_tree
from codefleet.sandbox.oci import Archive, ImageError, open_archive
from codefleet.sandbox.oci_layer import unpack_layer

_WHITEOUT = ".wh."
_OPAQUE = ".wh..wh..opq"


@dataclass(frozen=True)
class Environment:
    """A userland for sandboxes: `rootfs`, a root filesystem directory, or None for the host's."""

    name: str
    rootfs: str | None = None


HOST = Environment("host")


def default_store_dir() -> str:
    """Where imported images live: `CODEFLEET_ENV_DIR`, else /var/cache/codefleet/environments for root
    (the sandbox user must be able to walk to it; root's ~/.cache it may not enter), else
    $XDG_CACHE_HOME/codefleet/environments (~/.cache/...)."""
    if os.environ.get("CODEFLEET_ENV_DIR"):
        return os.environ["CODEFLEET_ENV_DIR"]
    if os.geteuid() == 0:
        return "/var/cache/codefleet/environments"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "codefleet", "environments")


def import_image(archive: str, store_dir: str | None = None) -> Environment:
    """The environment of the OCI image in `archive` (an oci-layout directory, a tarball of one, or a
    `docker save` tarball), importing it into the store unless it is there already."""
    archive = os.path.abspath(archive)
    store = os.path.abspath(store_dir or default_store_dir())
    for sub in ("", "layers", "images"):  # others may walk through (bwrap as the sandbox user), not list
        os.makedirs(os.path.join(store, sub), mode=0o711, exist_ok=True)
    try:
        with open_archive(archive) as source:
            config_hex, layers = source.image()
            image_dir = os.path.join(store, "images", f"sha256-{config_hex}")
            if not os.path.isdir(image_dir):
                layer_dirs = [_store_layer(store, source, *layer) for layer in layers]
                _store_image(image_dir, config_hex, layer_dirs, archive)
    except ImageError:
        raise
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, ValueError, KeyError, TypeError) as e:
        detail = " ".join(str(e).split())[:200]
        raise ImageError(
            f"cannot import {archive}: it is corrupt, truncated or not an OCI image ({type(e).__name__}: {detail})"
        ) from None
    except OSError as e:
        raise ImageError(f"cannot import {archive}: {e}") from None
    return Environment(f"sha256:{config_hex}", os.path.join(image_dir, "rootfs"))


def resolve_inside(rootfs: str, path: str) -> str | None:
    """The host path of `path` as a process whose root is `rootfs` finds it (symlinks followed as
    inside: an absolute target starts again at `rootfs`, `..` stops there); None if it is missing.
    The result is never a symlink and never outside `rootfs`."""
    done: list[str] = []
    todo = path.split("/")[::-1]
    links = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if done:
                done.pop()
            continue
        candidate = os.path.join(rootfs, *done, part)
        try:
            st = os.lstat(candidate)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not stat.S_ISLNK(st.st_mode):
            done.append(part)
            continue
        links += 1
        if links > 40:  # as the kernel's ELOOP
            return None
        target = os.readlink(candidate)
        if target.startswith("/"):
            done = []
        todo += target.split("/")[::-1]
    return os.path.join(rootfs, *done)


# -- the store -----------------------------------------------------------------------------


def _store_layer(store: str, source: Archive, name: str, blob_hex: str | None, diff_hex: str) -> str:
    """layers/sha256-<diff_hex>, unpacked from the archive's `name` unless already there."""
    final = os.path.join(store, "layers", f"sha256-{diff_hex}")
    if os.path.isdir(final):
        return final
    if not source.has(name):
        raise source.refuse(f"it has no {name} (layer sha256:{diff_hex})")
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.join(store, "layers"))
    try:
        got_blob, got_diff = unpack_layer(source, name, tmp)
        if blob_hex is not None and got_blob != blob_hex:
            raise source.refuse(f"{name} does not match its digest sha256:{blob_hex} (it is sha256:{got_blob})")
        if got_diff != diff_hex:
            raise source.refuse(
                f"the layer in {name} does not match its diff id sha256:{diff_hex} (it is sha256:{got_diff})"
            )
        os.chmod(tmp, 0o555)
        _rename_into_place(tmp, final)
    except BaseException:
        _remove_tree(tmp)
        raise
    return final


def _store_image(image_dir: str, config_hex: str, layer_dirs: list[str], archive: str) -> None:
    """images/sha256-<config_hex>/rootfs: the layers merged, bottom first, as hard links to their files."""
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(image_dir))
    try:
        rootfs = os.path.join(tmp, "rootfs")
        merge_layers(layer_dirs, rootfs)
        os.chmod(rootfs, 0o555)
        with open(os.path.join(tmp, "image.json"), "w") as f:
            json.dump(
                {
                    "config": f"sha256:{config_hex}",
                    "source": archive,
                    "layers": [os.path.basename(d).replace("-", ":", 1) for d in layer_dirs],
                },
                f,
                indent=1,
            )
        os.chmod(tmp, 0o711)
        _rename_into_place(tmp, image_dir)
    except BaseException:
        _remove_tree(tmp)
        raise


def merge_layers(layer_dirs: list[str], rootfs: str) -> None:
    """Make `rootfs` (it must not exist) the layers merged, bottom first: hard links to their files, their
    directories' owners, modes and times."""
    os.mkdir(rootfs, 0o700)
    modes: dict[str, os.stat_result] = {}
    for layer in layer_dirs:
        _merge(layer, rootfs, modes)
    for rel in sorted(modes, key=lambda r: r.count("/"), reverse=True):
        path = os.path.join(rootfs, rel)
        if _is_dir(path):  # not removed by a layer above since
            if (modes[rel].st_uid, modes[rel].st_gid) != (os.geteuid(), os.getegid()):  # a build step's owner
                os.chown(path, modes[rel].st_uid, modes[rel].st_gid)
            os.chmod(path, stat.S_IMODE(modes[rel].st_mode))
            os.utime(path, ns=(modes[rel].st_mtime_ns, modes[rel].st_mtime_ns))
    os.chmod(rootfs, 0o755)


def store_image(image_dir: str, key_hex: str, layer_dirs: list[str], source: str) -> None:
    """images/sha256-<key_hex>: the layers merged (`codefleet env build`'s images; an import's are the same)."""
    _store_image(image_dir, key_hex, layer_dirs, source)


def remove_store_tree(path: str) -> None:
    _remove_tree(path)


def _merge(layer: str, rootfs: str, modes: dict[str, os.stat_result]) -> None:
    """Apply one unpacked layer to `rootfs`: its whiteouts first, then its entries (the upper one wins;
    a directory of the layer replaces a file or symlink below it, as in overlayfs). Every directory of
    `rootfs` walked here was made by this function, so no path below crosses a symlink."""
    pending = [""]
    while pending:
        rel = pending.pop()
        entries = sorted(os.scandir(os.path.join(layer, rel)), key=lambda e: e.name)
        here = os.path.join(rootfs, rel)
        if any(e.name == _OPAQUE for e in entries):
            for name in os.listdir(here):
                _remove_entry(os.path.join(here, name))
        for entry in entries:
            hidden = entry.name[len(_WHITEOUT) :] if entry.name.startswith(_WHITEOUT) else ""
            if entry.name != _OPAQUE and hidden not in ("", ".", ".."):
                _remove_entry(os.path.join(here, hidden))
        for entry in entries:
            if entry.name.startswith(_WHITEOUT):
                continue
            dst, sub = os.path.join(here, entry.name), os.path.join(rel, entry.name)
            if entry.is_dir(follow_symlinks=False):
                if not _is_dir(dst):
                    _remove_entry(dst)
                    os.mkdir(dst, 0o700)
                modes[sub] = entry.stat(follow_symlinks=False)
                pending.append(sub)
                continue
            _remove_entry(dst)
            if entry.is_symlink():
                os.symlink(os.readlink(entry.path), dst)
            else:
                try:
                    os.link(entry.path, dst, follow_symlinks=False)
                except OSError as e:  # a file linked from more images than the filesystem allows: a copy
                    if e.errno != errno.EMLINK:
                        raise
                    shutil.copy2(entry.path, dst, follow_symlinks=False)


def _is_dir(path: str) -> bool:
    """Whether `path` itself is a directory (a symlink to one is not; nothing is followed)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _remove_entry(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):  # a directory of the rootfs being made: ours, still writable
        remove_tree(path)
    else:
        os.unlink(path)


def _rename_into_place(tmp: str, final: str) -> None:
    """Rename a finished directory to its content address; if another import got there first, keep theirs."""
    try:
        os.rename(tmp, final)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not os.path.isdir(final):
            raise
        _remove_tree(tmp)


def _remove_tree(path: str) -> None:
    """Delete a (possibly sealed, read-only) directory of the store."""
    if os.geteuid() != 0:  # others need write permission on the directories to empty them
        pending = [path] if _is_dir(path) else []
        while pending:
            here = pending.pop()
            try:
                os.chmod(here, 0o700)
                pending += [e.path for e in os.scandir(here) if e.is_dir(follow_symlinks=False)]
            except OSError:
                pass
    remove_tree(path)


_rootfs_by_archive: dict[tuple[str, int, int], str] = {}  # (path, mtime, size) -> rootfs, per process


def rootfs_of(spec: str) -> str:
    """The root filesystem `SandboxConfig.environment` names: a root filesystem directory as it is, an image in
    the store by id (`sha256:...`, 4 or more digits), or an image archive (an oci-layout directory or a
    tarball), imported into this node's store the first time (`import_image`)."""
    if spec.startswith("sha256:"):
        return find_image(spec).rootfs
    path = os.path.abspath(spec)
    try:
        st = os.stat(path)
    except OSError:
        raise ImageError(
            f"SandboxConfig.environment names {spec!r}, which does not exist here; give a root "
            "filesystem, an image archive or the id of an imported image (codefleet env ls)"
        ) from None
    if stat.S_ISDIR(st.st_mode) and not os.path.exists(os.path.join(path, "oci-layout")):
        return path
    key = (path, st.st_mtime_ns, st.st_size)
    if key not in _rootfs_by_archive:
        _rootfs_by_archive[key] = import_image(path).rootfs
    return _rootfs_by_archive[key]


# ---- the store: what is in it, and taking things out -------------------------------------------------


@dataclass(frozen=True)
class StoredImage:
    id: str  # sha256:<config digest>
    rootfs: str
    layers: tuple[str, ...]  # their diff ids, bottom first
    source: str  # the archive it was first imported from, as given then ("" if not recorded)


def list_images(store_dir: str | None = None) -> list[StoredImage]:
    """Every image in the store, oldest import first."""
    images_dir = os.path.join(store_dir or default_store_dir(), "images")
    found = []
    for name in sorted(os.listdir(images_dir)) if os.path.isdir(images_dir) else []:
        meta = os.path.join(images_dir, name, "image.json")
        if not name.startswith("sha256-") or not os.path.isfile(meta):
            continue  # a temporary directory of an import under way, or debris of one that was killed
        with open(meta) as f:
            info = json.load(f)
        found.append(
            (
                os.path.getmtime(meta),
                StoredImage(
                    info["config"],
                    os.path.join(images_dir, name, "rootfs"),
                    tuple(info["layers"]),
                    info.get("source", ""),
                ),
            )
        )
    return [image for _, image in sorted(found, key=lambda pair: pair[0])]


def find_image(ref: str, store_dir: str | None = None) -> StoredImage:
    """The stored image whose id (or its hex digits) starts with `ref` (at least 4 of them); ImageError if none
    or several."""
    hex_ref = ref.removeprefix("sha256:")
    matches = [i for i in list_images(store_dir) if len(hex_ref) >= 4 and i.id[7:].startswith(hex_ref)]
    if len(matches) != 1:
        which = f"{len(matches)} stored images match" if matches else "no stored image matches"
        raise ImageError(f"{which} {ref!r}; `codefleet env ls` lists them (give 4 or more digits of an id)")
    return matches[0]


def remove_image(ref: str, store_dir: str | None = None) -> StoredImage:
    """Take an image out of the store (its layers stay until `gc`). A sandbox still running in it loses its
    userland: close those first."""
    image = find_image(ref, store_dir)
    _remove_tree(os.path.dirname(image.rootfs))
    return image


def gc(store_dir: str | None = None) -> list[str]:
    """Remove the layers no stored image uses, and debris of imports that were killed; what was removed."""
    store = store_dir or default_store_dir()
    used = {f"sha256-{layer.removeprefix('sha256:')}" for image in list_images(store) for layer in image.layers}
    removed = []
    for sub in ("layers", "images"):
        here = os.path.join(store, sub)
        for name in sorted(os.listdir(here)) if os.path.isdir(here) else []:
            debris = name.startswith(".tmp-")
            if debris or (sub == "layers" and name not in used):
                _remove_tree(os.path.join(here, name))
                removed.append(f"{sub}/{name}")
    return removed
