"""An image archive made the way an attacker would make one: oci-layout directories whose blobs, index or
blob directory are symlinks to host files or FIFOs, JSON nested 100,000 deep or of the wrong shape, tarballs
whose members link to themselves or number in the hundreds of thousands, and layers that would exhaust the
store's inodes. Each is refused in one sentence naming the archive, nothing of the host leaks into it, and
the store stays empty."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile

import pytest

from codefleet.bench.image_fixture import Layer, oci_tarball, sha256_hex, tar_of
from codefleet.sandbox.environments import ImageError, import_image
from codefleet.sandbox.layers import mount, mounts_under, umount

SECRET = b"root:$6$host-secret-hash:19000:0:99999:7:::\n"


def _small_layer(*names: str) -> bytes:
    layer = Layer()
    layer.add("etc", tarfile.DIRTYPE, mode=0o755).add("etc/passwd", data=b"root:x:0:0::/:/bin/sh\n")
    for name in names:
        layer.add(name, data=b"x\n")
    return layer.bytes()


def _layout(tmp_path, layers: list[bytes] | None = None) -> tuple[str, dict[str, bytes]]:
    """An oci-layout directory of a small image, and its files by name."""
    with tarfile.open(fileobj=io.BytesIO(oci_tarball(layers or [_small_layer()]))) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    root = tmp_path / "layout"
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return str(root), files


def _blob_of(files: dict[str, bytes], kind: str) -> str:
    """The name of the image's manifest, config or (first) layer blob."""
    index = json.loads(files["index.json"])
    manifest_name = "blobs/sha256/" + index["manifests"][0]["digest"][7:]
    if kind == "manifest":
        return manifest_name
    manifest = json.loads(files[manifest_name])
    return "blobs/sha256/" + (manifest["config"] if kind == "config" else manifest["layers"][0])["digest"][7:]


def _refused(archive: str, store: str, match: str) -> str:
    """Importing fails with one sentence naming the archive and `match`; the store stays empty; the message."""
    with pytest.raises(ImageError, match=match) as caught:
        import_image(archive, store)
    message = str(caught.value)
    assert archive in message and "\n" not in message
    leftovers = [os.path.join(d, n) for d, dirs, files in os.walk(store) for n in dirs + files]
    assert sorted(leftovers) == [os.path.join(store, "images"), os.path.join(store, "layers")]
    return message


# -- an oci-layout directory: nothing in it is followed to the host --------------------------------


@pytest.mark.parametrize("kind", ["layer", "manifest", "config"])
def test_a_blob_that_is_a_symlink_to_a_host_file_is_refused_and_nothing_of_that_file_leaks(tmp_path, kind):
    """The host file is a valid layer tar (so that, followed, it would unpack and be hashed): the refusal
    names the symlink, and neither the file's digest nor its content appears anywhere."""
    secret_tar = tar_of({"etc/shadow": SECRET})
    host_file = tmp_path / "host-secret.tar"
    host_file.write_bytes(secret_tar)
    layout, files = _layout(tmp_path)
    blob = os.path.join(layout, _blob_of(files, kind))
    os.unlink(blob)
    os.symlink(host_file, blob)
    message = _refused(layout, str(tmp_path / "store"), "is a symlink, not a regular file")
    for leaked in (sha256_hex(secret_tar), hashlib.sha256(SECRET).hexdigest(), "host-secret"):
        assert leaked not in message


def test_index_json_or_the_blob_directory_as_a_symlink_is_refused(tmp_path):
    layout, _ = _layout(tmp_path)
    store = str(tmp_path / "store")
    elsewhere = tmp_path / "elsewhere"
    os.rename(os.path.join(layout, "blobs", "sha256"), elsewhere)
    os.symlink(elsewhere, os.path.join(layout, "blobs", "sha256"))
    _refused(layout, store, "blobs/sha256 is a symlink")
    os.unlink(os.path.join(layout, "blobs", "sha256"))
    os.rename(elsewhere, os.path.join(layout, "blobs", "sha256"))
    os.rename(os.path.join(layout, "index.json"), tmp_path / "index.json")
    os.symlink(tmp_path / "index.json", os.path.join(layout, "index.json"))
    _refused(layout, store, "index.json is a symlink")


def test_a_blob_that_is_a_fifo_is_refused_without_waiting_on_it(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: the import must not hang on it."""
    layout, files = _layout(tmp_path)
    blob = os.path.join(layout, _blob_of(files, "layer"))
    os.unlink(blob)
    os.mkfifo(blob)
    code = (
        f"from codefleet.sandbox.environments import import_image, ImageError\n"
        f"try:\n    import_image({layout!r}, {str(tmp_path / 'store')!r})\n"
        f"except ImageError as e:\n    print(e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert "is a FIFO, not a regular file" in done.stdout, (done.stdout, done.stderr)


# -- JSON: bounded depth, the shapes the spec gives ---------------------------------------------


def _docker_save_with_manifest(manifest: bytes) -> bytes:
    layer = _small_layer()
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": [f"sha256:{sha256_hex(layer)}"]}}).encode()
    return tar_of(
        {f"{sha256_hex(config)}.json": config, f"{sha256_hex(layer)}/layer.tar": layer, "manifest.json": manifest}
    )


def test_json_nested_100000_deep_is_one_clear_error_not_a_recursion_traceback(tmp_path):
    deep = b"[" * 100_000 + b"]" * 100_000
    archive = tmp_path / "deep.tar"
    archive.write_bytes(_docker_save_with_manifest(deep))
    _refused(str(archive), str(tmp_path / "store"), "manifest.json is nested deeper than")
    layout, _ = _layout(tmp_path)
    with open(os.path.join(layout, "index.json"), "wb") as f:
        f.write(b'{"manifests": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    _refused(layout, str(tmp_path / "store2"), "index.json is nested deeper than")


@pytest.mark.parametrize(
    "index, match",
    [
        (b"[]", "index.json is not a JSON object"),
        (b'{"manifests": "no"}', "index.json's manifests is not a list of objects"),
        (b'{"manifests": ["sha256:00"]}', "index.json's manifests is not a list of objects"),
        (b"\xff\xfe not json", "index.json is not valid JSON"),
    ],
)
def test_json_of_the_wrong_shape_is_refused_in_one_sentence(tmp_path, index, match):
    layout, _ = _layout(tmp_path)
    with open(os.path.join(layout, "index.json"), "wb") as f:
        f.write(index)
    _refused(layout, str(tmp_path / "store"), match)


def test_a_huge_index_json_is_refused_from_its_size_without_reading_it(tmp_path):
    """A sparse 1 TB index.json: its size alone refuses it."""
    layout, _ = _layout(tmp_path)
    with open(os.path.join(layout, "index.json"), "r+b") as f:
        f.truncate(1 << 40)
    _refused(layout, str(tmp_path / "store"), "index.json is larger than 16 MB")


# -- a tarball: links resolve inside it, members are counted -------------------------------------


def _tar_with(members: list[tarfile.TarInfo], files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for member in members:
            tar.addfile(member)
    return buf.getvalue()


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, target
    return info


def test_a_tarball_whose_index_links_to_itself_is_refused(tmp_path):
    archive = tmp_path / "loop.tar"
    archive.write_bytes(
        _tar_with([_link("index.json", "index.json"), _link("a", "b"), _link("b", "a")], {"oci-layout": b"{}"})
    )
    _refused(str(archive), str(tmp_path / "store"), "index.json is a link that does not end at a file of")
    archive.write_bytes(_tar_with([_link("index.json", "a"), _link("a", "b"), _link("b", "a")], {"oci-layout": b"{}"}))
    _refused(str(archive), str(tmp_path / "store"), "index.json is a link that does not end at a file of")


def test_a_docker_save_layer_shared_by_a_symlink_still_imports(tmp_path):
    """docker save writes a layer two images share once, and a relative symlink to it: that resolves inside the
    archive."""
    layer = _small_layer()
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": [f"sha256:{sha256_hex(layer)}"] * 2}}).encode()
    manifest = json.dumps(
        [{"Config": f"{sha256_hex(config)}.json", "Layers": ["one/layer.tar", "two/layer.tar"]}]
    ).encode()
    archive = tmp_path / "shared.tar"
    archive.write_bytes(
        _tar_with(
            [_link("two/layer.tar", "../one/layer.tar")],
            {f"{sha256_hex(config)}.json": config, "one/layer.tar": layer, "manifest.json": manifest},
        )
    )
    env = import_image(str(archive), str(tmp_path / "store"))
    assert os.listdir(os.path.join(env.rootfs, "etc")) == ["passwd"]


def test_a_tarball_of_too_many_members_is_refused_before_it_fills_memory(tmp_path):
    archive = tmp_path / "many.tar"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("x")
        for i in range(100_001):
            info.name = f"m{i}"
            tar.addfile(info)
    _refused(str(archive), str(tmp_path / "store"), "more than 100000 members")


def _pax_bomb(size: int) -> bytes:
    """A tar whose first header is a pax extended header of `size` bytes (zeros), which tarfile reads whole."""
    header = tarfile.TarInfo("././@PaxHeader")
    header.type, header.size = tarfile.XHDTYPE, size
    buf = io.BytesIO()
    buf.write(header.tobuf(format=tarfile.USTAR_FORMAT))
    buf.write(b"\0" * (size + (-size % 512)))
    return buf.getvalue() + _small_layer()


def test_a_tar_header_of_64_mb_is_refused_before_it_is_read_into_memory(tmp_path):
    """A pax header is read whole into memory: gigabytes of zeros gzip to a few MB. Past 1 MB, in a layer or in
    the archive itself, it is refused."""
    bomb = _pax_bomb(64 << 20)
    archive = tmp_path / "layer-bomb.tar"
    archive.write_bytes(oci_tarball([bomb]))
    _refused(str(archive), str(tmp_path / "store"), "its layer .* has a tar header of 67108864 bytes")
    archive = tmp_path / "archive-bomb.tar.gz"
    archive.write_bytes(gzip.compress(_pax_bomb(64 << 20), compresslevel=1))
    _refused(str(archive), str(tmp_path / "store2"), "it has a tar header of 67108864 bytes")


# -- a layer: the store's inodes --------------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs for the store (root)")
def test_a_layer_of_more_files_than_the_store_has_inodes_is_refused():
    """A real filesystem with few inodes (a tmpfs, whose pages are used only when written): a layer of 500
    empty files, a few kB of gzip, would leave fewer than the reserve free."""
    with tempfile.TemporaryDirectory(prefix="codefleet-test-inodes-", dir="/var/tmp") as d:
        store = os.path.join(d, "store")
        os.mkdir(store)
        mount("tmpfs", store, "tmpfs", "size=2g,nr_inodes=10200")
        try:
            archive = os.path.join(d, "many.tar")
            with open(archive, "wb") as f:
                f.write(oci_tarball([_small_layer(*(f"etc/f{i}" for i in range(500)))]))
            _refused(archive, store, "does not fit on the disk .* inodes to spare")
        finally:
            umount(store)
        assert mounts_under(d) == []
