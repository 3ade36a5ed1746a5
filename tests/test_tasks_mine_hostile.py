"""`codefleet tasks mine` against what an attacker brings: an sdist on a package index whose setup.py or build
backend writes a file on the host, archives that expand past any disk or climb out of their directory, a
folder with a symlink to the host's files. Nothing of the package may run on the host, and every refusal is
one sentence that says which rule or cap and how to raise it."""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import http.server
import io
import json
import os
import pathlib
import tarfile
import tempfile
import threading
import zipfile

import pytest
from test_tasks_mine import STATS, TESTS

from codefleet.sandbox import SandboxConfig
from codefleet.tasks.cli import main
from codefleet.tasks.fetch import FetchError, fetch_sdist
from codefleet.tasks.mine import MineError, mine_library
from codefleet.tasks.unpack import UnpackError, UnpackLimits, unpack_source

# -- a package index on 127.0.0.1 ------------------------------------------------------


class Index:
    """A PEP 691 (JSON) or PEP 503 (HTML) simple index over `projects` ({name: {filename: bytes}})."""

    def __init__(self, style: str):
        self.style = style
        self.projects: dict[str, dict[str, bytes]] = {}
        self.hashes: dict[str, str] = {}  # filename -> sha256 the index states (default: the true one)
        self.links: dict[str, str] = {}  # filename -> href the index gives (default: its own /files/ URL)
        index = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[0] == "files" and len(parts) == 2:
                    body = next((f[parts[1]] for f in index.projects.values() if parts[1] in f), None)
                    return self.answer(body, "application/octet-stream")
                if parts[0] == "simple" and len(parts) == 2 and parts[1] in index.projects:
                    return self.answer(*index.page(parts[1]))
                return self.answer(None, "")

            def answer(self, body, content_type):
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def add(self, name: str, filename: str, data: bytes) -> None:
        self.projects.setdefault(name, {})[filename] = data

    def page(self, name: str) -> tuple[bytes, str]:
        files = []
        for filename, data in sorted(self.projects[name].items()):
            digest = self.hashes.get(filename, hashlib.sha256(data).hexdigest())
            files.append((filename, self.links.get(filename, f"../../files/{filename}"), digest))
        if self.style == "json":
            body = {
                "meta": {"api-version": "1.1"},
                "name": name,
                "files": [{"filename": f, "url": u, "hashes": {"sha256": d} if d else {}} for f, u, d in files],
            }
            return json.dumps(body).encode(), "application/vnd.pypi.simple.v1+json"
        links = "".join(f'<a href="{u}{"#sha256=" + d if d else ""}">{f}</a>\n' for f, u, d in files)
        return f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode(), "text/html"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(params=["json", "html"])
def index(request):
    served = Index(request.param)
    yield served
    served.close()


def tar_gz(
    members: dict[str, bytes | str],
    links: dict[str, tuple[bytes, str]] | None = None,
    after: dict[str, bytes | str] | None = None,
) -> bytes:
    """A .tar.gz of `members` ({name: content}), then `links` ({name: (tar type, target)}), then `after`."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for files in (members, None, after or {}):
            for name, content in (files or {}).items():
                data = content.encode() if isinstance(content, str) else content
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
            for name, (kind, target) in (links or {}).items() if files is None else ():
                info = tarfile.TarInfo(name)
                info.type, info.linkname = kind, target
                tar.addfile(info)
    return buffer.getvalue()


def library(name: str, version: str, extra: dict[str, str]) -> dict[str, str]:
    """minilib's code and tests (test_tasks_mine) as the sdist `name-version/`, with `extra` files."""
    files = {
        "PKG-INFO": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        "minilib/__init__.py": "",
        "minilib/stats.py": STATS,
        "tests/test_stats.py": TESTS,
        **extra,
    }
    return {f"{name}-{version}/{rel}": content for rel, content in files.items()}


def hostile_files(variant: str, canary: str) -> dict[str, str]:
    """What an attacker puts in an sdist so that preparing it, importing it or running its tests writes
    `canary` on the machine that does so."""
    write = f"open({canary!r}, 'a').write('ran\\n')"
    files = {
        "tests/conftest.py": f"try:\n    {write}\nexcept OSError:\n    pass\n",  # runs with the tests
        "minilib/__init__.py": f"try:\n    {write}\nexcept OSError:\n    pass\n",
    }  # runs on import
    if variant == "setup.py":
        files["setup.py"] = f"{write}\nfrom setuptools import setup\nsetup(name='hostile', version='1.0')\n"
    else:  # a PEP 517 backend of its own, run by whoever prepares the package's metadata
        files["pyproject.toml"] = (
            '[build-system]\nrequires = []\nbuild-backend = "evil_backend"\nbackend-path = ["."]\n'
        )
        files["evil_backend.py"] = (
            f"{write}\n\ndef get_requires_for_build_wheel(config_settings=None):\n    return []\n"
        )
    return files


def mine_config(state_dir: str) -> SandboxConfig:
    return dataclasses.replace(SandboxConfig(), state_dir=state_dir)


# -- NAME==VERSION from an index ------------------------------------------------------


@pytest.mark.parametrize("index, variant", [("json", "setup.py"), ("html", "build-backend")], indirect=["index"])
def test_a_package_from_an_index_never_runs_on_the_host_and_still_mines(
    variant, index, tmp_path, state_dir, monkeypatch
):
    canary = tmp_path / "canary"
    index.add("hostile", "hostile-1.0.tar.gz", tar_gz(library("hostile", "1.0", hostile_files(variant, str(canary)))))
    monkeypatch.setenv("PIP_INDEX_URL", index.url)  # the index pip (and so codefleet) is configured with
    monkeypatch.setenv("PIP_NO_BUILD_ISOLATION", "0")  # pip then prepares setup.py with the host's setuptools
    try:
        report = mine_library(
            "hostile==1.0",
            str(tmp_path / "out"),
            seed=0,
            max_tasks=1,
            check=False,
            cache_dir=str(tmp_path / "cache"),
            config=mine_config(state_dir),
        )
    except MineError as e:
        report = e
    assert not canary.exists(), f"the package ran on the host: {canary.read_text()!r}"
    assert not isinstance(report, MineError), report
    assert len(report.tasks) == 1 and report.library == "hostile" and report.version == "1.0"
    (cached,) = os.listdir(tmp_path / "cache" / "hostile-1.0")
    assert cached == "hostile-1.0.tar.gz"


def test_the_sdist_must_have_the_sha256_of_the_index_and_of_the_pin(index, tmp_path):
    good = tar_gz(library("minilib", "0.1.0", {}))
    index.add("minilib", "minilib-0.1.0.tar.gz", good)
    index.add("minilib", "minilib-0.1.0-py3-none-any.whl", b"a wheel is never taken")
    truth = hashlib.sha256(good).hexdigest()
    cache = str(tmp_path / "cache")
    with pytest.raises(FetchError, match="not the one minilib==0.1.0 is pinned to"):
        fetch_sdist(f"minilib==0.1.0 --hash=sha256:{'0' * 64}", cache, [index.url])
    index.hashes["minilib-0.1.0.tar.gz"] = "1" * 64  # the index states a hash the file does not have
    with pytest.raises(FetchError, match="tampered"):
        fetch_sdist("minilib==0.1.0", cache, [index.url])
    assert os.listdir(os.path.join(cache, "minilib-0.1.0")) == []  # no partial or unchecked file is kept
    index.hashes["minilib-0.1.0.tar.gz"] = ""  # an index that states no hash
    with pytest.raises(FetchError, match="gives no sha256"):
        fetch_sdist("minilib==0.1.0", cache, [index.url])
    del index.hashes["minilib-0.1.0.tar.gz"]
    path = fetch_sdist(f"minilib==0.1.0 --hash=sha256:{truth}", cache, [index.url])
    assert pathlib.Path(path).read_bytes() == good and path.endswith("minilib-0.1.0.tar.gz")
    pathlib.Path(path).write_bytes(b"changed in the cache")
    with pytest.raises(FetchError, match="cached"):
        fetch_sdist(f"minilib==0.1.0 --hash=sha256:{truth}", cache, [index.url])
    with pytest.raises(FetchError, match="no source distribution"):
        fetch_sdist("minilib==0.2.0", cache, [index.url])


def test_an_index_cannot_point_the_download_at_the_hosts_files_or_past_the_cap(index, tmp_path):
    secret = tmp_path / "secret-1.0.tar.gz"
    secret.write_bytes(b"the host's own file")
    index.add("secret", "secret-1.0.tar.gz", b"")
    index.links["secret-1.0.tar.gz"] = secret.as_uri()
    with pytest.raises(FetchError, match="not http"):
        fetch_sdist("secret==1.0", str(tmp_path / "cache"), [index.url])
    index.add("big", "big-1.0.tar.gz", b"x" * (3 << 20))
    with pytest.raises(FetchError, match="cap of 2 MiB"):
        fetch_sdist("big==1.0", str(tmp_path / "cache"), [index.url], max_bytes=2 << 20)


# -- archives and folders -------------------------------------------------------------


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """tempfile's directory for this test alone: what mining leaves there, it left."""
    path = tmp_path / "tmp"
    path.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    return path


def zip_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def mine_cli(source: str, tmp_path: pathlib.Path, *flags: str) -> int:
    return main(["tasks", "mine", source, "--out", str(tmp_path / "out"), *flags])


def gzip_bomb(name: str, size_mib: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    """A .tar.gz of one member of `size_mib` MiB of zeros, made as an attacker makes it: gzip members of 1 MiB
    of zeros, concatenated (one gzip stream to a reader), ~1 KB each."""
    header = tarfile.TarInfo(name)
    header.size, header.type = size_mib << 20, kind
    mib = gzip.compress(bytes(1 << 20), 9)
    return gzip.compress(header.tobuf(format=tarfile.GNU_FORMAT)) + mib * size_mib + gzip.compress(bytes(1024))


@pytest.mark.parametrize("kind", ["tar.gz", "pax-header", "zip"])
def test_an_archive_bomb_is_refused_at_the_cap_and_leaves_nothing(kind, tmp_path, private_tmp, capsys):
    if kind == "tar.gz":  # 300 MiB past the default cap of 256 MiB, from 300 KB
        data, flags, cap = gzip_bomb("bomb-1.0/minilib/zeros.bin", 300), [], "256 MiB"
    elif kind == "pax-header":  # no file at all: a header record that tarfile would read into memory whole
        data, flags, cap = gzip_bomb("bomb-1.0/x", 64, tarfile.XHDTYPE), ["--max-unpacked-mb", "8"], "8 MiB"
        kind = "tar.gz"
    else:
        data, flags, cap = (
            zip_bytes({"bomb-1.0/minilib/zeros.bin": bytes(48 << 20)}),
            ["--max-unpacked-mb", "8"],
            "8 MiB",
        )
    assert len(data) < 1 << 20
    source = tmp_path / f"bomb-1.0.{kind}"
    source.write_bytes(data)
    assert mine_cli(str(source), tmp_path, *flags) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("codefleet tasks mine: ") and len(err.splitlines()) == 1, err
    assert f"unpacks to more than {cap}" in err and "--max-unpacked-mb" in err, err
    assert os.listdir(private_tmp) == [] and not (tmp_path / "out").exists()


def test_an_archive_of_too_many_files_is_refused_at_the_cap(tmp_path, private_tmp, capsys):
    members = {**library("many", "1.0", {}), **{f"many-1.0/junk/{i}": "" for i in range(300)}}
    source = tmp_path / "many-1.0.tar.gz"
    source.write_bytes(tar_gz(members))
    assert mine_cli(str(source), tmp_path, "--max-files", "100") == 2
    err = capsys.readouterr().err
    assert "more than 100 files, directories and links" in err and "--max-files" in err, err
    assert os.listdir(private_tmp) == []


@pytest.mark.parametrize(
    "case",
    [
        "dot-dot",
        "absolute",
        "absolute-symlink",
        "climbing-symlink",
        "symlink-chain",
        "hard-link-out",
        "device",
        "fifo",
        "under-a-symlink",
    ],
)
def test_an_archive_member_that_leaves_the_tree_is_refused(case, tmp_path, private_tmp, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    members: dict[str, bytes | str] = library("evil", "1.0", {})
    links: dict[str, tuple[bytes, str]] = {}
    after: dict[str, bytes | str] = {}
    if case == "dot-dot":
        members["evil-1.0/../../outside/owned.py"] = "x = 1\n"
    elif case == "absolute":
        members[str(outside / "owned.py")] = "x = 1\n"
    elif case == "absolute-symlink":
        links["evil-1.0/minilib/host.py"] = (tarfile.SYMTYPE, str(outside / "secret.py"))
    elif case == "climbing-symlink":
        links["evil-1.0/minilib/host.py"] = (tarfile.SYMTYPE, "../../../outside/secret.py")
    elif case == "symlink-chain":  # each link looks inside on its own; followed, the second climbs out
        links["evil-1.0/minilib/up"] = (tarfile.SYMTYPE, "../..")
        links["evil-1.0/minilib/out"] = (tarfile.SYMTYPE, "up/..")
    elif case == "hard-link-out":
        links["evil-1.0/minilib/host.py"] = (tarfile.LNKTYPE, "../outside/secret.py")
    elif case == "device":
        links["evil-1.0/minilib/disk"] = (tarfile.BLKTYPE, "")
    elif case == "fifo":
        links["evil-1.0/minilib/pipe"] = (tarfile.FIFOTYPE, "")
    else:  # a file written through a symlink to a directory (inside, so the link itself is allowed)
        links["evil-1.0/minilib/dir"] = (tarfile.SYMTYPE, "../tests")
        after["evil-1.0/minilib/dir/owned.py"] = "x = 1\n"
    source = tmp_path / "evil-1.0.tar.gz"
    source.write_bytes(tar_gz(members, links, after))
    assert mine_cli(str(source), tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("codefleet tasks mine: ") and "--out" not in err, err
    expected = {
        "device": "device file",
        "fifo": "device file",
        "under-a-symlink": "not a directory",
        "hard-link-out": "outside the tree",
    }.get(case, "outside the tree")
    assert expected in err, err
    assert os.listdir(outside) == [] and os.listdir(private_tmp) == []


def test_a_folder_with_a_symlink_out_of_it_is_refused_and_not_followed(tmp_path, private_tmp, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.py").write_text("def secret(a, b):\n    return a + b\n")
    folder = tmp_path / "lib"
    for name, content in library("lib", "1.0", {}).items():
        path = folder / name.split("/", 1)[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    (folder / "minilib" / "secret.py").symlink_to(outside / "secret.py")
    assert mine_cli(str(folder), tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("codefleet tasks mine: ") and "--out" not in err, err
    assert "minilib/secret.py" in err and "points outside the tree" in err, err
    (folder / "minilib" / "secret.py").unlink()
    (folder / "minilib" / "gone.py").symlink_to(tmp_path / "nowhere" / "gone.py")  # dangling, outside
    assert mine_cli(str(folder), tmp_path) == 2
    err = capsys.readouterr().err
    assert "minilib/gone.py" in err and "points outside the tree" in err and "--out" not in err, err
    assert (outside / "secret.py").read_text().startswith("def secret") and os.listdir(private_tmp) == []


def test_unpacking_keeps_what_is_safe(tmp_path):
    """A relative symlink inside the tree is kept (sdists have them); a hard link becomes a copy; modes lose
    set-ID and write bits for others; __pycache__ is left out."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, data, mode in [("p-1/a.py", b"x = 1\n", 0o4777), ("p-1/__pycache__/a.pyc", b"\0", 0o644)]:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), mode
            tar.addfile(info, io.BytesIO(data))
        for name, kind, target in [
            ("p-1/docs/a.py", tarfile.SYMTYPE, "../a.py"),
            ("p-1/b.py", tarfile.LNKTYPE, "p-1/a.py"),
        ]:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)
    source = tmp_path / "p-1.tar.gz"
    source.write_bytes(buffer.getvalue())
    dest = tmp_path / "dest"
    unpack_source(str(source), str(dest), UnpackLimits(max_bytes=1 << 20, max_files=10))
    assert os.readlink(dest / "p-1" / "docs" / "a.py") == "../a.py"
    assert (dest / "p-1" / "b.py").read_bytes() == b"x = 1\n" and not os.path.samefile(
        dest / "p-1" / "b.py", dest / "p-1" / "a.py"
    )
    assert oct((dest / "p-1" / "a.py").stat().st_mode & 0o7777) == oct(0o755)
    assert not (dest / "p-1" / "__pycache__").exists()
    with pytest.raises(UnpackError, match="more than 4 files"):
        unpack_source(str(source), str(tmp_path / "again"), UnpackLimits(max_bytes=1 << 20, max_files=4))


def test_a_requirement_that_is_not_on_the_index_is_one_clear_error(index, tmp_path):
    index.add("minilib", "minilib-0.1.0.tar.gz", tar_gz(library("minilib", "0.1.0", {})))
    with pytest.raises(MineError, match="no source distribution .* of minilib==9.9"):
        mine_library("minilib==9.9", str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"), index_urls=[index.url])


def test_mining_refuses_a_backend_that_does_not_isolate(tmp_path):
    """The library's tests are the attacker's code: with the `local` backend they would run on this machine."""
    canary = tmp_path / "canary"
    folder = tmp_path / "lib"
    for name, content in library("lib", "1.0", hostile_files("setup.py", str(canary))).items():
        path = folder / name.split("/", 1)[1]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    with pytest.raises(MineError, match="needs a sandbox that isolates"):
        mine_library(
            str(folder),
            str(tmp_path / "out"),
            max_tasks=1,
            check=False,
            config=SandboxConfig(backend="local", state_dir=str(tmp_path / "state")),
        )
    assert not canary.exists()
