"""OCI images built on this machine, with no registry and no network: layer tars written member by
member, and the archives an import reads (an oci-layout tarball, a `docker save` tarball).

`host_userland_layer()` copies the host's own python3, bash, git and coreutils, with the libraries
`ldd` names and the files Python loads to start, into one layer: a small but real userland that
`codefleet bench env` and tests/test_sandbox_environments.py both run sandboxes in."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import stat
import subprocess
import tarfile

HOST_PYTHON = "/usr/bin/python3"
# What a task's baseline needs (git and the rest); `host_userland_layer(extra=...)` adds to it.
BASELINE_TOOLS = (
    HOST_PYTHON,
    "/bin/bash",
    "/bin/cat",
    "/usr/bin/git",
    "/bin/mkdir",
    "/bin/rm",
    "/bin/cp",
    "/usr/bin/mktemp",
)


class Layer:
    """A layer tar written member by member."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.tar = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)  # noqa: SIM115 (closed by tar())
        self.seen: set[str] = set()

    def add(
        self, name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", mode: int = 0o644, link: str = ""
    ) -> Layer:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.linkname, info.mtime = kind, mode, link, 1_700_000_000
        info.size = len(data) if kind == tarfile.REGTYPE else 0
        self.tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
        self.seen.add(name)
        return self

    def host(self, path: str) -> None:
        """Copy a host path into the layer as the host has it: each symlink on the way (as is, absolute
        targets too), then what it points to."""
        parts = path.strip("/").split("/")
        for i in range(len(parts)):
            here = "/".join(parts[: i + 1])
            st = os.lstat("/" + here)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink("/" + here)
                if here not in self.seen:
                    self.add(here, tarfile.SYMTYPE, link=target)
                start = target if target.startswith("/") else os.path.join("/", os.path.dirname(here), target)
                return self.host(os.path.normpath(os.path.join(start, *parts[i + 1 :])))
            if stat.S_ISDIR(st.st_mode):
                if here not in self.seen:
                    self.add(here, tarfile.DIRTYPE, mode=0o755)
            elif here not in self.seen:
                with open("/" + here, "rb") as f:
                    self.add(here, data=f.read(), mode=stat.S_IMODE(st.st_mode))

    def bytes(self) -> bytes:
        self.tar.close()
        return self.buf.getvalue()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tar_of(files: dict[str, bytes]) -> bytes:
    """A plain tar of these files, in this order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def oci_tarball(layers: list[bytes], *, compress: bool = True, blob_digest_of=None) -> bytes:
    """An oci-layout tarball of an image with these layer tars (gzip'd unless told otherwise);
    `blob_digest_of(i, blob)` may lie about a layer's digest."""
    blobs = {}
    descriptors = []
    for i, layer in enumerate(layers):
        blob = gzip.compress(layer, compresslevel=1, mtime=0) if compress else layer
        digest = blob_digest_of(i, blob) if blob_digest_of else sha256_hex(blob)
        blobs[digest] = blob
        descriptors.append(
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": f"sha256:{digest}",
                "size": len(blob),
            }
        )
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{sha256_hex(t)}" for t in layers]},
        }
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": {
                "mediaType": "application/vnd.oci.image.config.v1+json",
                "digest": f"sha256:{sha256_hex(config)}",
                "size": len(config),
            },
            "layers": descriptors,
        }
    ).encode()
    blobs[sha256_hex(config)], blobs[sha256_hex(manifest)] = config, manifest
    index = {
        "schemaVersion": 2,
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": f"sha256:{sha256_hex(manifest)}",
                "size": len(manifest),
            }
        ],
    }
    return tar_of(
        {
            "oci-layout": b'{"imageLayoutVersion": "1.0.0"}',
            "index.json": json.dumps(index).encode(),
            **{f"blobs/sha256/{d}": b for d, b in blobs.items()},
        }
    )


def docker_save_tarball(layers: list[bytes]) -> bytes:
    """What `docker save` writes for an image with these (uncompressed) layers."""
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{sha256_hex(t)}" for t in layers]},
        }
    ).encode()
    files = {f"{sha256_hex(t)}/layer.tar": t for t in layers}
    manifest = [{"Config": f"{sha256_hex(config)}.json", "RepoTags": ["codefleet-test:1"], "Layers": list(files)}]
    return tar_of({f"{sha256_hex(config)}.json": config, **files, "manifest.json": json.dumps(manifest).encode()})


def python_startup_files(python: str = HOST_PYTHON) -> list[str]:
    """The files `python` loads to start, and its lib-dynload directory."""
    code = (
        "import sys, json, sysconfig; print(json.dumps([m.__file__ for m in list(sys.modules.values()) "
        "if getattr(m, '__file__', None)] + [sysconfig.get_path('platstdlib') + '/lib-dynload']))"
    )
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, env={}, check=True).stdout
    return json.loads(out)


def python_stdlib_dir(python: str = HOST_PYTHON) -> str:
    """Where `python`'s standard library lies (a module put there imports in the image)."""
    out = subprocess.run(
        [python, "-c", "import os; print(os.__file__)"], capture_output=True, text=True, env={}, check=True
    ).stdout
    return os.path.dirname(out.strip())


def libraries(binary: str) -> list[str]:
    """The shared libraries `ldd` says `binary` loads (and its loader)."""
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    return [word for line in out.splitlines() for word in line.split() if word.startswith("/")]


def host_userland_layer(tools: tuple[str, ...] = BASELINE_TOOLS, extra: tuple[str, ...] = ()) -> Layer:
    """A layer (still open: add members, then `.bytes()`) holding the host's `tools` and `extra` with the
    libraries they load, the files the host's Python loads to start, and an /etc with passwd and group."""
    missing = [t for t in (HOST_PYTHON, "/bin/bash") if not os.path.exists(t)]
    if missing:
        raise FileNotFoundError(f"cannot build an image from the host's userland: {', '.join(missing)} is missing")
    layer = Layer()
    for binary in tools + extra:
        layer.host(binary)
        for lib in libraries(os.path.realpath(binary)):
            layer.host(lib)
    for path in python_startup_files():
        if os.path.exists(path):
            layer.host(path)
    layer.add("etc", tarfile.DIRTYPE, mode=0o755)
    layer.add("etc/passwd", data=b"root:x:0:0:root:/root:/bin/sh\n")
    layer.add("etc/group", data=b"root:x:0:\n")
    return layer
