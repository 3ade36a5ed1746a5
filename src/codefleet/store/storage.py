"""Where a run's durable records live: a local path, or an fsspec URL (s3://, gs://, az://, file://, memory://).

    storage.put_file_atomic("s3://bucket/run/checkpoints/LATEST", b"rl-step-000003")
    path = storage.local_copy("s3://bucket/run/checkpoints/rl-step-000003")   # downloaded once per node
    with storage.staged_dir("s3://bucket/run/checkpoints/sft") as local:      # written here, uploaded after
        trainer.save(local)

On a cluster the driver, the trainer workers, the engines and the rollout workers may sit on nodes that share
nothing but this storage, so every function here takes either a plain path or a URL (`is_url`: the text has
a scheme such as `s3://`). A plain path keeps the code paths of a local filesystem exactly (os, shutil, an
atomic temporary + rename); a URL goes through fsspec (`pip install s3fs` / `gcsfs` / `adlfs` for the cloud
ones, credentials from the environment as those packages read them).

Atomicity. Readers must see a whole file or none. An object store's single PUT is atomic (the object
appears once the upload, multipart or not, completes), so `put_file_atomic` and `upload_file` PUT once; on
a local filesystem (a path or `file://`) they write a temporary file beside the target and rename it.
A *directory* is never atomic on an object store: its completeness is said by a record written after it
(the run's `checkpoints/LATEST`, `sft.done`, a checkpoint's `config.json` uploaded last, see `upload_dir`).

Reading a directory (`local_copy`). A checkpoint is read by every process that starts from it, on its own
node: `local_copy(url)` downloads it into a per-node cache (`$CODEFLEET_CACHE`, default
`~/.cache/codefleet`, under `storage/`) once and returns the local directory. The cache entry is named by
the URL and a signature of the listing (every file's name, size and version: ETag, generation or mtime),
so a directory rewritten at the same URL (a checkpoint redone after a crash, a run started again at the
same place) is a new entry, never a stale one. An entry is downloaded under a temporary name, gets its
complete-marker (`COMPLETE`) last and is renamed into place; callers on one node wait for each other on
a lock file (flock), so a checkpoint is downloaded once per node however many workers start from it.
Old entries are not removed: delete the cache directory when it grows too big.

Writing a directory (`staged_dir`). A writer gets a local directory: the path itself for a plain path
(it writes as it always did), a temporary directory for a URL, uploaded when the block ends without an
error (the old contents at the URL removed first when `replace`).

The fsspec instances are cached per process and some (s3fs) cache listings: every listing here
invalidates that cache first, so a file another process wrote is seen.

Links. A run directory may have been prepared by someone else (docs/security.md). The writers here
(`put_file_atomic`, `upload_file`, `upload_dir`, `remove`, `makedirs`) take `root`, the directory the user
named (a run directory); on a local filesystem (a path or `file://`) nothing below `root` is followed when it
is a symlink (codefleet.store.safe_files: a link on the way, or as the file written, is refused; removing a link
removes the link). Without `root` that holds from the target's own directory down. Object stores (s3://,
gs://, az://, memory://) have no symlinks: a key is a name, so there is nothing to follow there.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import uuid
from collections.abc import Iterator

import fsspec

from codefleet.store import safe_files

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.\-]*://")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
COMPLETE = ".codefleet-complete"  # a local_copy entry's last file: the download finished
# the fields of an fsspec listing that change when a file is written again, in order of preference
_VERSION_KEYS = ("ETag", "etag", "md5Hash", "generation", "version_id", "LastModified", "mtime", "created")


class StorageError(OSError):
    """The storage cannot be reached or read; the message says what to do."""


def is_url(path: str) -> bool:
    """Whether `path` names a location by URL (`s3://bucket/run`, `file:///data/run`, `memory://run`)."""
    return bool(_SCHEME.match(path or ""))


def _fs(url: str):
    """(fsspec filesystem, path within it) for `url`."""
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # fsspec's own sentence names the package ("Install s3fs to access S3")
        raise StorageError(f"{url}: {e}; install it beside codefleet on every node (e.g. `pip install s3fs`)") from None
    except ValueError as e:  # an unknown protocol
        raise StorageError(
            f"{url} is not a URL fsspec can open ({e}); give a path or an s3://, gs://, file:// URL"
        ) from None


def _is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,))


def _local_path(path: str) -> str | None:
    """The local path of a plain path or a file:// URL; None for a URL of an object store (no links there)."""
    if not is_url(path):
        return path
    fs, p = _fs(path)
    return p if _is_local(fs) else None


def _local_root(root: str | None, local: str) -> str:
    """The directory below which nothing is followed for the local path `local`: `root`'s local path, else
    `local`'s own directory."""
    found = _local_path(root) if root else None
    return found or os.path.dirname(local) or "."


def join(base: str, *parts: str) -> str:
    """`base` / parts, for a path or a URL (a URL always joins with '/')."""
    if not is_url(base):
        return os.path.join(base, *parts)
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts if p)])


def parent(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[0] if is_url(path) else os.path.dirname(path)


def basename(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1] if is_url(path) else os.path.basename(path)


def absolute(path: str) -> str:
    """An absolute path, or the URL as it is (without a trailing '/')."""
    return path.rstrip("/") if is_url(path) else os.path.abspath(path)


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, p = _fs(path)
    fs.invalidate_cache(p)
    return fs.exists(p)


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    fs, p = _fs(path)
    fs.invalidate_cache(p)
    return fs.isdir(p)


def listdir(path: str) -> list[str]:
    """The names directly in directory `path`, sorted; [] when it does not exist."""
    if not is_url(path):
        return sorted(os.listdir(path)) if os.path.isdir(path) else []
    fs, p = _fs(path)
    fs.invalidate_cache(p)
    try:
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in fs.ls(p, detail=False)} - {""})
    except FileNotFoundError:
        return []


def read_bytes(path: str) -> bytes:
    """The whole file; FileNotFoundError when there is none."""
    if not is_url(path):
        with open(path, "rb") as f:
            return f.read()
    fs, p = _fs(path)
    return fs.cat_file(p)


def makedirs(path: str, root: str | None = None) -> None:
    """The directory `path` (an object store has no directories: nothing to do there); with `root`, none of the
    directories below `root` is reached through a link."""
    local = _local_path(path)
    if local is not None:
        if root:
            safe_files.makedirs_beneath(_local_root(root, local), local)
        else:
            os.makedirs(local, exist_ok=True)
        return
    fs, p = _fs(path)
    fs.makedirs(p, exist_ok=True)


def remove(path: str, root: str | None = None) -> None:
    """Remove the file or directory tree `path`; nothing there is fine. Locally, nothing below `root` (default:
    `path`'s directory) is followed: a link is removed itself, a tree never descended through one."""
    local = _local_path(path)
    if local is not None:
        safe_files.remove_beneath(_local_root(root, local), local, ignore_errors=True)
        return
    fs, p = _fs(path)
    fs.invalidate_cache(p)
    with contextlib.suppress(FileNotFoundError):
        fs.rm(p, recursive=True)


def _local_atomic(path: str, write, root: str | None = None) -> None:
    """`write(file)` into a temporary file beside `path`, flushed to disk, then renamed onto `path`; no link
    below `root` (default: `path`'s directory) followed, a link at `path` refused (safe_files)."""
    safe_files.write_file_beneath(_local_root(root, path), path, write, fsync=True)


def put_file_atomic(path: str, data: bytes, root: str | None = None) -> None:
    """Write `data` as the file `path`: readers see the old file or the whole new one, never part of it. `root`:
    the run directory `path` is in (nothing below it is followed locally, see the module docstring)."""
    local = _local_path(path)
    if local is not None:
        _local_atomic(local, lambda f: f.write(data), root)
        return
    fs, p = _fs(path)
    fs.pipe_file(p, data)  # one PUT


def upload_file(local: str, path: str, root: str | None = None) -> None:
    """Copy the local file `local` to `path`, atomically as `put_file_atomic` (without reading it into memory)."""
    target = _local_path(path)
    if target is not None:
        _local_atomic(target, lambda f: _copy_into(local, f), root)
        return
    fs, p = _fs(path)
    fs.put_file(local, p)  # one (multipart) upload: the object appears when it completes


def _copy_into(local: str, f) -> None:
    with open(local, "rb") as src:
        shutil.copyfileobj(src, f, 1 << 20)


def _local_files(local: str) -> list[str]:
    """Every file under `local`, relative, '/'-separated, sorted."""
    out = []
    for directory, _, files in os.walk(local):
        out += [os.path.relpath(os.path.join(directory, f), local).replace(os.sep, "/") for f in files]
    return sorted(out)


def upload_dir(local: str, path: str, last: tuple[str, ...] = (), root: str | None = None) -> None:
    """Every file under the local directory `local` to the same names under `path` (files already there and
    not in `local` stay); the files named in `last` (relative names, e.g. "config.json") go after the rest,
    so a reader that waits for them sees the others whole. `root`: as for `put_file_atomic`."""
    files = _local_files(local)
    rooted = (root,) if root else ()
    for rel in sorted(files, key=lambda rel: (rel in last, rel)):
        upload_file(os.path.join(local, rel), join(path, rel), *rooted)


def _remote_files(path: str) -> dict[str, dict]:
    """{relative name: fsspec info} of every file under the URL `path` ({} when there is none)."""
    fs, p = _fs(path)
    fs.invalidate_cache(p)
    root = p.rstrip("/")
    try:
        found = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    return {
        name[len(root) :].lstrip("/"): info
        for name, info in found.items()
        if info.get("type", "file") == "file" and name.startswith(root + "/")
    }


def download_file(path: str, local: str) -> None:
    """Copy the file `path` to the local file `local` (atomically: a temporary name, then a rename)."""
    if not is_url(path):
        _local_atomic(local, lambda f: _copy_into(path, f))
        return
    fs, p = _fs(path)
    os.makedirs(os.path.dirname(local) or ".", exist_ok=True)
    tmp = f"{local}.tmp-{uuid.uuid4().hex}"
    try:
        fs.get_file(p, tmp)
        os.replace(tmp, local)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def download_dir(path: str, local: str, skip: tuple[str, ...] = ()) -> int:
    """Every file under `path` (but names ending in one of `skip`) into the local directory `local`; the
    number of files copied. FileNotFoundError when `path` holds no file."""
    if not is_url(path):
        files = [f for f in _local_files(path) if not f.endswith(skip)] if os.path.isdir(path) else []
    else:
        files = [f for f in _remote_files(path) if not f.endswith(skip)]
    if not files:
        raise FileNotFoundError(f"{path} holds no files")
    for rel in files:
        download_file(join(path, rel), os.path.join(local, *rel.split("/")))
    return len(files)


def cache_root() -> str:
    """This node's cache of downloaded directories and of the runs' local staging: `$CODEFLEET_CACHE`, else
    ~/.cache/codefleet."""
    return os.environ.get("CODEFLEET_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "codefleet")


def safe_name(text: str) -> str:
    return _UNSAFE.sub("_", text)[-60:] or "root"


def _signature(url: str, files: dict[str, dict], skip: tuple[str, ...]) -> str:
    listing = [
        (rel, info.get("size"), str(next((info[k] for k in _VERSION_KEYS if info.get(k) is not None), "")))
        for rel, info in sorted(files.items())
    ]
    return hashlib.sha256(json.dumps([url, sorted(skip), listing]).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _flock(path: str) -> Iterator[None]:
    """Hold an exclusive lock on the file `path` (every caller on this node, thread or process, waits)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def local_copy(path: str, skip: tuple[str, ...] = ()) -> str:
    """A local directory holding what the directory `path` holds: `path` itself when it is a path; for a URL a
    copy in this node's cache, downloaded once (see the module docstring). `skip`: file name endings left out
    (e.g. the weights, for a reader that needs only a checkpoint's tokenizer and config). The directory must
    not change while it is read: pass committed ones only (a checkpoint LATEST names, `sft` after sft.done)."""
    if not is_url(path):
        return path
    url = absolute(path)
    files = {rel: info for rel, info in _remote_files(url).items() if not rel.endswith(skip)}
    if not files:
        raise FileNotFoundError(
            f"{url} holds no files: it is not a committed directory (a checkpoint LATEST "
            "names); check the URL, or that this node's credentials can list it"
        )
    folder = os.path.join(cache_root(), "storage")
    target = os.path.join(folder, f"{safe_name(basename(url))}-{_signature(url, files, skip)}")
    if os.path.isfile(os.path.join(target, COMPLETE)):
        return target
    os.makedirs(folder, exist_ok=True)
    with _flock(target + ".lock"):
        if os.path.isfile(os.path.join(target, COMPLETE)):  # another caller downloaded it meanwhile
            return target
        tmp = f"{target}.tmp-{os.getpid()}-{threading.get_ident()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            for rel in files:
                download_file(join(url, rel), os.path.join(tmp, *rel.split("/")))
            with open(os.path.join(tmp, COMPLETE), "w") as f:
                f.write(url)
            shutil.rmtree(target, ignore_errors=True)  # an entry without its marker (a copy made by hand)
            os.replace(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _scratch(dest: str) -> str:
    folder = os.path.join(cache_root(), "tmp")
    os.makedirs(folder, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"{safe_name(basename(dest))}-", dir=folder)


@contextlib.contextmanager
def staged_dir(dest: str, replace: bool = True, last: tuple[str, ...] = ()) -> Iterator[str]:
    """A local directory to write the directory `dest` into (module docstring): `dest` itself for a path; for a
    URL a temporary one (not yet made), uploaded to `dest` when the block ends without an error, `last` files
    after the rest. `replace`: `dest`'s old contents are removed when the block starts (give False to all but
    one of several writers of one directory, who then must start writing only after that one has entered)."""
    if not is_url(dest):
        yield dest
        return
    if replace:
        remove(dest)
    scratch = _scratch(dest)
    try:
        local = os.path.join(scratch, "dir")
        yield local
        if os.path.isdir(local):
            upload_dir(local, dest, last, root=dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def editing(dest: str, fetch: tuple[str, ...] = ()) -> Iterator[str]:
    """A local directory to add or rewrite some files of the directory `dest` in: `dest` itself for a path; for a
    URL a temporary one holding the files named in `fetch` that `dest` has, every file in it uploaded over
    `dest` when the block ends without an error (the rest of `dest` stays)."""
    if not is_url(dest):
        yield dest
        return
    scratch = _scratch(dest)
    try:
        local = os.path.join(scratch, "dir")
        os.makedirs(local)
        for name in fetch:
            with contextlib.suppress(FileNotFoundError):
                download_file(join(dest, name), os.path.join(local, name))
        yield local
        upload_dir(local, dest, root=dest)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
