"""Sandboxes that start from an OCI image: an image this test builds itself (no registry), imported
from an oci-layout tarball and from a `docker save` tarball, run with its own Python, forked and torn
down with nothing left mounted; and the archives an import must refuse, leaving nothing behind."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import stat
import tarfile
import tempfile

import pytest

from codefleet.bench.image_fixture import (
    HOST_PYTHON,
    Layer,
    docker_save_tarball,
    host_userland_layer,
    oci_tarball,
    python_stdlib_dir,
    tar_of,
)
from codefleet.bench.image_fixture import sha256_hex as _sha
from codefleet.sandbox import SandboxConfig, SandboxUnavailableError, create_sandbox
from codefleet.sandbox.environments import HOST, ImageError, import_image, resolve_inside
from codefleet.sandbox.layers import mounts_under
from codefleet.sandbox.local import LocalSandbox

pytestmark = pytest.mark.skipif(
    not os.path.exists(HOST_PYTHON) or not os.path.exists("/bin/bash"),
    reason="builds its image from the host's /usr/bin/python3 and /bin/bash",
)


# -- building images ---------------------------------------------------------------------


def image_layers() -> list[bytes]:
    """Layer 1: the host's python3, bash and git with what they load, cat, /etc/passwd and /etc/group, a file
    that layer 2 whites out and a directory it makes opaque. Layer 2: /etc/image-release, a module."""
    base = host_userland_layer()
    base.add("etc/doomed", data=b"layer 1\n")
    base.add("opt", tarfile.DIRTYPE, mode=0o755).add("opt/data", tarfile.DIRTYPE, mode=0o755)
    base.add("opt/data/old.txt", data=b"layer 1\n").add("opt/data/sub", tarfile.DIRTYPE, mode=0o755)
    base.add("opt/data/sub/deep.txt", data=b"layer 1\n")
    base.add("usr/share/doc/link-to-release", tarfile.SYMTYPE, link="/etc/image-release")  # absolute: fine
    base.add("usr/share/doc/suid-tool", data=b"#!/bin/sh\n", mode=0o4755)
    base.add("usr/share/doc/null", tarfile.CHRTYPE)
    top = Layer()
    top.add("etc", tarfile.DIRTYPE, mode=0o755)
    top.add("etc/image-release", data=b"codefleet-test-image 1\n")
    top.add("etc/.wh.doomed")
    top.add("opt/data", tarfile.DIRTYPE, mode=0o755).add("opt/data/.wh..wh..opq")
    top.add("opt/data/new.txt", data=b"layer 2\n")
    stdlib = python_stdlib_dir()
    top.add(f"{stdlib.lstrip('/')}/imagemod.py", data=b"WHERE = 'from the image'\n")
    return [base.bytes(), top.bytes()]


@pytest.fixture(scope="module")
def open_dir():
    """A directory the sandbox user may walk into (not root's 0700 /tmp/pytest-of-root)."""
    with tempfile.TemporaryDirectory(prefix="codefleet-test-env-", dir="/var/tmp") as d:
        os.chmod(d, 0o755)
        yield d


@pytest.fixture(scope="module")
def image(open_dir):
    """The built image: its layers, its two archives, and its environment imported from the OCI one."""
    layers = image_layers()
    oci, docker = os.path.join(open_dir, "image.oci.tar"), os.path.join(open_dir, "image.docker.tar")
    with open(oci, "wb") as f:
        f.write(oci_tarball(layers))
    with open(docker, "wb") as f:
        f.write(docker_save_tarball(layers))
    store = os.path.join(open_dir, "store")
    return {"layers": layers, "oci": oci, "docker": docker, "store": store, "env": import_image(oci, store)}


@pytest.fixture
def env_config(image, state_dir):
    return SandboxConfig(state_dir=state_dir, timeout_s=30, backend="namespace", environment=image["env"].rootfs)


# -- importing ---------------------------------------------------------------------------


def test_both_archive_kinds_and_a_layout_directory_import_to_one_rootfs_with_shared_layers(image, open_dir):
    store = image["store"]
    again = import_image(image["docker"], store)
    assert again == image["env"]  # the same image (config digest), whichever archive brought it
    layout = os.path.join(open_dir, "layout")
    os.makedirs(layout)
    with tarfile.open(image["oci"]) as tar:
        tar.extractall(layout, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))  # 3.11.4+
    assert import_image(layout, store) == image["env"]
    # Each layer once, keyed by its diff id; the rootfs's files are the layers' own inodes.
    diff_ids = sorted(f"sha256-{_sha(t)}" for t in image["layers"])
    assert sorted(os.listdir(os.path.join(store, "layers"))) == diff_ids
    assert len(os.listdir(os.path.join(store, "images"))) == 1
    rootfs = image["env"].rootfs
    layer2 = os.path.join(store, "layers", f"sha256-{_sha(image['layers'][1])}")
    assert (
        os.stat(os.path.join(rootfs, "etc/image-release")).st_ino
        == os.stat(os.path.join(layer2, "etc/image-release")).st_ino
    )
    assert image["env"].name.startswith("sha256:") and HOST.rootfs is None


def test_whiteouts_opaque_directories_devices_and_setuid_bits_are_honoured(image):
    rootfs = image["env"].rootfs
    assert not os.path.lexists(os.path.join(rootfs, "etc/doomed"))
    assert sorted(os.listdir(os.path.join(rootfs, "opt/data"))) == ["new.txt"]
    assert not os.path.lexists(os.path.join(rootfs, "usr/share/doc/null"))  # device nodes are dropped
    mode = os.stat(os.path.join(rootfs, "usr/share/doc/suid-tool")).st_mode
    assert not mode & (stat.S_ISUID | stat.S_ISGID | 0o222) and mode & 0o111
    assert os.readlink(os.path.join(rootfs, "usr/share/doc/link-to-release")) == "/etc/image-release"
    assert resolve_inside(rootfs, "/usr/share/doc/link-to-release") == os.path.join(rootfs, "etc/image-release")
    assert not any(".wh." in name for _, dirs, files in os.walk(rootfs) for name in dirs + files)


# -- sandboxes ---------------------------------------------------------------------------


def test_a_sandbox_runs_the_images_python_sees_none_of_the_host_and_forks(image, env_config, repo):
    # A file only the host's /usr has (where this user may write one; /etc/hostname and apt-get below else).
    marker = f"/usr/local/share/codefleet-host-only-{os.getpid()}"
    if os.access(os.path.dirname(marker), os.W_OK):
        with open(marker, "w") as f:
            f.write("host\n")
    try:
        sb = create_sandbox(repo, env_config)
        try:
            # the workspace's mounts, which must be gone after close (an unprivileged user's workspace is a copy)
            assert mounts_under(sb.dir) or os.geteuid() != 0
            result = sb.exec('python3 -c "import sys, imagemod; print(sys.prefix, imagemod.WHERE)"')
            assert result.ok and result.output == "/usr from the image\n", result.output
            assert sb.exec("cat /etc/image-release").output == "codefleet-test-image 1\n"
            assert sb.exec("cat /usr/share/doc/link-to-release").output == "codefleet-test-image 1\n"
            assert sb.exec("test -e /etc/doomed").exit_code == 1
            assert sb.exec("echo /opt/data/*").output == "/opt/data/new.txt\n"
            # Nothing of the host's userland: not its /usr, not its /etc, not its other Python modules.
            assert sb.exec(f"test -e {marker}").exit_code == 1
            assert sb.exec("test -e /etc/hostname || test -e /usr/bin/apt-get").exit_code == 1
            assert sb.exec('python3 -c "import sqlite3"').exit_code != 0
            assert sb.exec(f"test -e {image['store']} || test -e {os.path.dirname(image['store'])}").exit_code == 1
            # The image is read-only, the identity codefleet's own.
            for target in ("/usr/bin/python3", "/etc/image-release", "/etc/new", "/opt/data/new.txt"):
                assert not sb.exec(f"echo hostile > {target}").ok, target
            assert sb.exec("echo $UID; cat /etc/passwd").output.startswith("1000\n")
            assert "agent:x:1000" in sb.exec("cat /etc/passwd").output
            assert sb.exec("cat README.md").output == "# demo\n"  # the workspace is as ever
            # (the image has no mkdir: its own Python makes the directory)
            assert sb.exec(
                "echo from-parent > made.txt && python3 -c 'import os; os.mkdir(\"sub\")' && cd sub && export SEEN=yes"
            ).ok
            (child,) = sb.fork(1)
            try:
                assert child.exec('pwd; echo "$SEEN"; cat ../made.txt').output == "/workspace/sub\nyes\nfrom-parent\n"
                assert child.exec("python3 -c 'import imagemod'").ok
                assert child.exec("cat /etc/image-release").ok
            finally:
                child.close()
            dirs = [sb.dir, child.dir]
        finally:
            sb.close()
        with create_sandbox(repo, dataclasses.replace(env_config, environment=None)) as host_sb:  # the checks
            assert host_sb.exec("test -e /etc/hostname || test -e /usr/bin/apt-get").ok  # can fail
            assert host_sb.exec(f"test -e {marker}").ok == os.path.exists(marker)
    finally:
        if os.path.exists(marker):
            os.unlink(marker)
    for d in dirs + [image["store"]]:
        assert mounts_under(d) == []
        assert not os.path.exists(d) or d == image["store"]


def test_an_environment_without_bash_or_etc_is_refused_in_one_sentence(image, env_config, repo, open_dir):
    bare = os.path.join(open_dir, "bare-rootfs")
    os.makedirs(os.path.join(bare, "etc"))
    for name in ("passwd", "group"):
        with open(os.path.join(bare, "etc", name), "w") as f:
            f.write("root:x:0:\n")
    with pytest.raises(SandboxUnavailableError, match="has no /bin/bash"):
        create_sandbox(repo, dataclasses.replace(env_config, environment=bare))
    with pytest.raises(ImageError, match="which does not exist here"):
        create_sandbox(repo, dataclasses.replace(env_config, environment=os.path.join(open_dir, "missing")))
    with pytest.raises(ValueError, match="backend 'local' runs the host's own: use backend 'namespace'"):
        create_sandbox(repo, SandboxConfig(backend="local", environment=bare))  # its `environments` flag is off
    # Backend 'auto' where namespaces cannot work: refused, never the host's userland instead.
    with pytest.raises(SandboxUnavailableError, match="needs namespace sandboxes"):
        LocalSandbox(repo, dataclasses.replace(env_config, backend="auto"))


# -- bad archives ------------------------------------------------------------------------


def _refused(tmp_path, data: bytes, match: str) -> None:
    """Importing `data` fails with one sentence naming the archive and `match`; the store stays empty."""
    archive = tmp_path / "bad.tar"
    archive.write_bytes(data)
    store = tmp_path / "store"
    with pytest.raises(ImageError, match=match) as caught:
        import_image(str(archive), str(store))
    message = str(caught.value)
    assert str(archive) in message and "\n" not in message
    leftovers = [os.path.join(d, n) for d, dirs, files in os.walk(store) for n in dirs + files]
    assert sorted(leftovers) == [str(store / "images"), str(store / "layers")]


def _small_layer(*members) -> bytes:
    layer = Layer()
    layer.add("etc", tarfile.DIRTYPE, mode=0o755).add("etc/passwd", data=b"root:x:0:0::/:/bin/sh\n")
    for member in members:
        layer.add(*member[:2], **member[2] if len(member) > 2 else {})
    return layer.bytes()


def test_a_truncated_archive_is_refused(tmp_path, image):
    with open(image["oci"], "rb") as f:
        data = f.read()
    _refused(tmp_path, data[: len(data) // 2], "corrupt, truncated|it has no")


def test_a_truncated_layer_is_refused(tmp_path):
    good = oci_tarball([_small_layer(("etc/big", tarfile.REGTYPE, {"data": os.urandom(200_000)}))])
    with tarfile.open(fileobj=io.BytesIO(good)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    blob = max(files, key=lambda n: len(files[n]))
    layout = tmp_path / "layout"
    for name, data in files.items():
        (layout / name).parent.mkdir(parents=True, exist_ok=True)
        (layout / name).write_bytes(data[: len(data) // 2] if name == blob else data)
    store = tmp_path / "store"
    with pytest.raises(ImageError, match="corrupt, truncated"):
        import_image(str(layout), str(store))
    assert os.listdir(store / "layers") == [] and os.listdir(store / "images") == []


def test_a_layer_that_does_not_match_its_digest_is_refused(tmp_path):
    _refused(
        tmp_path,
        oci_tarball([_small_layer()], blob_digest_of=lambda i, blob: _sha(blob + b"x")),
        "does not match its digest",
    )


def test_a_config_whose_diff_ids_lie_is_refused(tmp_path):
    layer = _small_layer()
    data = docker_save_tarball([layer])
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
    files[f"{_sha(layer)}/layer.tar"] = _small_layer(("etc/extra", tarfile.REGTYPE))
    _refused(tmp_path, tar_of(files), "does not match its diff id")


@pytest.mark.parametrize(
    "member, match",
    [
        (("../escaped", tarfile.REGTYPE), "outside the image's root"),
        (("/etc/absolute", tarfile.REGTYPE), "outside the image's root"),
        (("etc/up", tarfile.SYMTYPE, {"link": "../../../etc/shadow"}), "symlink 'etc/up'"),
        (("etc/hard", tarfile.LNKTYPE, {"link": "../../etc/shadow"}), "outside the image's root"),
    ],
)
def test_a_member_escaping_the_root_is_refused(tmp_path, member, match):
    _refused(tmp_path, oci_tarball([_small_layer(member)]), match)


def test_a_hard_link_through_a_symlink_is_refused(tmp_path):
    """The symlink is legal (absolute, it resolves inside a sandbox); a hard link made through it on the
    host would link the host's file."""
    out = ("etc/out", tarfile.SYMTYPE, {"link": "/etc"})
    _refused(
        tmp_path,
        oci_tarball([_small_layer(out, ("etc/h", tarfile.LNKTYPE, {"link": "etc/out/shadow"}))]),
        "hard link 'etc/h'",
    )
    _refused(
        tmp_path,
        oci_tarball([_small_layer(out, ("etc/h", tarfile.LNKTYPE, {"link": "etc/out"}))]),
        "not a regular file of the same layer",
    )
    _refused(
        tmp_path,
        oci_tarball([_small_layer(out, ("etc/out/passwd", tarfile.REGTYPE))]),
        "which is not a directory \\(a symlink\\)",
    )


def test_a_zstd_layer_is_refused_with_what_to_do(tmp_path):
    blob = b"\x28\xb5\x2f\xfd" + b"\0" * 64
    data = oci_tarball([blob], compress=False)
    _refused(tmp_path, data, "zstd")


def test_whiteouts_naming_dot_or_dot_dot_hide_nothing(tmp_path):
    top = Layer()
    for name in ("etc/.wh..", "etc/.wh...", ".wh..", ".wh..."):
        top.add(name)
    env = import_image(_write(tmp_path, oci_tarball([_small_layer(), top.bytes()])), str(tmp_path / "store"))
    assert os.listdir(env.rootfs) == ["etc"] and os.listdir(os.path.join(env.rootfs, "etc")) == ["passwd"]


def _write(tmp_path, data: bytes) -> str:
    (tmp_path / "image.tar").write_bytes(data)
    return str(tmp_path / "image.tar")


def test_a_layer_that_would_fill_the_disk_is_refused(tmp_path, monkeypatch):
    """A few kB of gzip can expand to gigabytes: an import stops short of the disk's free space less a
    reserve (here the reserve is set to leave only 1 MB of room)."""
    from codefleet.sandbox import oci_layer

    disk = os.statvfs(tmp_path)
    monkeypatch.setattr(oci_layer, "DISK_RESERVE_BYTES", disk.f_bavail * disk.f_frsize - (1 << 20))
    bomb = ("etc/zeros", tarfile.REGTYPE, {"data": b"\0" * (32 << 20)})  # 32 MB of zeros: ~32 kB gzipped
    _refused(tmp_path, oci_tarball([_small_layer(bomb)]), "does not fit on the disk")


def test_codefleet_env_imports_lists_removes_and_collects_garbage(tmp_path, capsys):
    from codefleet.cli import main

    store = str(tmp_path / "store")
    base, top = _small_layer(), Layer().add("etc/extra", data=b"x\n").bytes()
    first, second = _write(tmp_path, oci_tarball([base])), str(tmp_path / "second.tar")
    (tmp_path / "second.tar").write_bytes(docker_save_tarball([base, top]))  # shares the first's layer
    for archive in (first, second):
        assert main(["env", "import", archive, "--store", store]) == 0
    ids = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert main(["env", "ls", "--store", store]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == [i[:19] for i in ids] and first in listed[0]
    assert main(["env", "rm", ids[1][7:13], "--store", store]) == 0
    assert main(["env", "gc", "--store", store]) == 0  # the top layer goes, the shared one stays
    assert "removed layers/sha256-" in capsys.readouterr().out and len(os.listdir(f"{store}/layers")) == 1
    assert main(["env", "rm", "sha256:ffff", "--store", store]) == 2
    assert "no stored image matches 'sha256:ffff'" in capsys.readouterr().err
    assert main(["env", "rm", ids[0], "--store", store]) == 0 and main(["env", "gc", "--store", store]) == 0
    assert os.listdir(f"{store}/layers") == [] and os.listdir(f"{store}/images") == []


def test_a_task_runs_in_its_environment_named_relative_to_its_file_or_by_id(image, open_dir, state_dir, monkeypatch):
    """task.json's `environment`: an archive beside it (imported on first use into the node's store, here the
    fixture's) or an imported image's id; prepare_sandbox runs the setup commands and the git baseline there."""
    from codefleet.tasks import load_task, prepare_sandbox, save_task, workspace_diff
    from codefleet.types import HiddenChecks, Task

    monkeypatch.setenv("CODEFLEET_ENV_DIR", image["store"])
    repo = os.path.join(open_dir, "task-repo")
    os.makedirs(repo, exist_ok=True)
    with open(os.path.join(repo, "app.py"), "w") as f:
        f.write("X = 1\n")
    tasks = os.path.join(open_dir, "tasks")
    os.makedirs(os.path.join(tasks, "t1"), exist_ok=True)
    shutil.copy(image["oci"], os.path.join(tasks, "t1", "image.tar"))
    for environment in (os.path.join(tasks, "t1", "image.tar"), image["env"].name[:12]):
        task = Task(
            id="t1",
            repo=repo,
            instruction="Print where.",
            environment=environment,
            checks=HiddenChecks(command="python3 {tests}", fail_to_pass=["-c pass"]),
            setup_commands=["python3 -c 'import imagemod; print(imagemod.WHERE)' > where.txt"],
        )
        loaded = load_task(save_task(task, tasks))
        with open(os.path.join(tasks, "t1", "task.json")) as f:
            stored = json.load(f)["environment"]
        assert stored == ("image.tar" if environment.endswith(".tar") else environment)  # moves with its directory
        with prepare_sandbox(loaded, SandboxConfig(state_dir=state_dir, timeout_s=30)) as sb:
            assert sb.read_file("where.txt") == "from the image\n"
            assert sb.exec("cat /etc/image-release").output == "codefleet-test-image 1\n"
            sb.write_file("app.py", "X = 2\n")
            assert "+X = 2" in workspace_diff(sb)


def test_a_hostile_command_cannot_change_the_image_or_the_store_behind_it(image, env_config, repo):
    """The rootfs is hard links to the store's layer files, shared by every image and sandbox that uses them:
    a sandboxed command must not be able to change one, nor the store through them."""
    release = os.path.join(image["env"].rootfs, "etc", "image-release")
    before = open(release, "rb").read()
    py = "python3 -c "  # the image's own tools: every attempt runs, none fails for want of a binary
    attempts = {
        "chmod": py + "'import os; os.chmod(\"/etc/image-release\", 0o666)'",
        "append": "echo pwned >> /etc/image-release",
        "replace": "cp /etc/passwd /etc/image-release",
        "hard link into the workspace, then write": py + '\'import os; os.link("/etc/image-release", "link"); '
        'open("link", "a").write("pwned")\'',
        "remount read-write": py + "'import ctypes; libc = ctypes.CDLL(None, use_errno=True); "
        'assert libc.mount(None, b"/etc", None, 32 | 4096, None) == 0\'',
        "delete": "rm /etc/image-release",
        "rename it away": py + '\'import os; os.rename("/etc/image-release", "/tmp/x")\'',
        "a new file beside it": "echo x > /etc/new-file",
    }
    with create_sandbox(repo, env_config) as sb:
        assert sb.exec(py + "'import os; print(os.getuid())'").output.strip() != "0"
        for what, command in attempts.items():
            result = sb.exec(command + " 2>&1; echo status=$?")
            assert "command not found" not in result.output, (what, result.output)
            assert not result.output.strip().endswith("status=0"), (what, result.output)
        assert sb.exec("cat /etc/image-release").output == before.decode()
    assert open(release, "rb").read() == before and os.stat(release).st_mode & 0o222 == 0
