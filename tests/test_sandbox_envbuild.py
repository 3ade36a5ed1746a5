"""`codefleet env build` (sandbox.envbuild): steps run over the layers below them and become cached layers of
their own, deletions and replaced directories included; a rebuild is a no-op; a failed step keeps nothing.
A step's root is an unprivileged range of host uids: a hostile base image cannot reach the host, yet a step
may chown and set set-ID bits, and the owners it sets survive into its layer and the steps above."""

from __future__ import annotations

import ctypes
import grp
import json
import os
import pwd
import subprocess
import sys
import tempfile

import pytest
from test_sandbox_environments import image_layers, oci_tarball

from codefleet.bench.image_fixture import HOST_PYTHON, host_userland_layer, libraries
from codefleet.sandbox import SandboxConfig, create_sandbox
from codefleet.sandbox.buildns import HostIds, store_ids
from codefleet.sandbox.envbuild import build, load_spec
from codefleet.sandbox.layers import mounts_under
from codefleet.sandbox.oci import ImageError

STEPS = [
    "echo built > /etc/built",
    "rm /etc/image-release",
    "rm -rf /opt/data && mkdir /opt/data && echo new > /opt/data/only",
]


@pytest.fixture
def work():
    if os.geteuid() != 0:
        pytest.skip("codefleet env build needs root (test_an_unprivileged_user_is_refused_in_one_sentence)")
    with tempfile.TemporaryDirectory(prefix="codefleet-test-build-", dir="/var/tmp") as d:
        os.chmod(d, 0o755)
        with open(os.path.join(d, "base.tar"), "wb") as f:
            f.write(oci_tarball(image_layers()))
        yield d


def _spec(work: str, run: list, base: str = "base.tar") -> str:
    path = os.path.join(work, "env.yaml")
    with open(path, "w") as f:
        json.dump({"base": base, "run": run}, f)  # JSON is YAML
    return path


def _image(work: str, name: str, layer) -> str:
    with open(os.path.join(work, name), "wb") as f:
        f.write(oci_tarball([layer.bytes()]))
    return name


def _interfaces(proc_net_dev: str) -> list[str]:
    return sorted(line.split(":")[0].strip() for line in proc_net_dev.splitlines()[2:])


def test_steps_become_cached_layers_and_the_image_runs_in_a_sandbox(work, state_dir):
    store = os.path.join(work, "store")
    log: list[str] = []
    env = build(load_spec(_spec(work, STEPS)), store, log.append)
    assert [line.split()[0] for line in log] == ["build"] * 3
    rootfs = env.rootfs
    assert open(os.path.join(rootfs, "etc", "built")).read() == "built\n"
    assert not os.path.exists(os.path.join(rootfs, "etc", "image-release"))  # a deletion is a whiteout
    assert os.listdir(os.path.join(rootfs, "opt", "data")) == ["only"]  # a replaced directory is opaque
    log.clear()
    assert build(load_spec(_spec(work, STEPS)), store, log.append) == env and all(
        line.startswith("cached") for line in log
    )  # nothing changed: nothing runs
    log.clear()
    changed = build(load_spec(_spec(work, STEPS[:2] + ["echo other > /opt/other"])), store, log.append)
    assert [line.split()[0] for line in log] == ["cached", "cached", "build"] and changed != env
    with create_sandbox(None, SandboxConfig(state_dir=state_dir, environment=changed.rootfs)) as sb:
        assert sb.exec("cat /etc/built /opt/other").output == "built\nother\n"
    assert mounts_under(work) == []


def test_a_failed_step_keeps_nothing_and_says_which(work):
    store = os.path.join(work, "store")
    build(load_spec(_spec(work, STEPS[:1])), store, lambda line: None)
    layers = sorted(os.listdir(os.path.join(store, "layers")))
    with pytest.raises(ImageError, match=r"the build step `run echo half > /etc/half; exit 3` failed \(exit 3\)"):
        build(load_spec(_spec(work, STEPS[:1] + ["echo half > /etc/half; exit 3"])), store, lambda line: None)
    assert sorted(os.listdir(os.path.join(store, "layers"))) == layers  # the step below stays, nothing else
    assert mounts_under(work) == [] and not [n for n in os.listdir(store) if n.startswith(".tmp")]
    with pytest.raises(ImageError, match="unknown key 'from'"):
        with open(os.path.join(work, "bad.yaml"), "w") as f:
            f.write("from: base.tar\n")
        load_spec(os.path.join(work, "bad.yaml"))


@pytest.mark.parametrize(
    "text, match",
    [
        ("run: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests too deep to read"),
        ("base: base.tar\nrun:\n" + "  - echo x\n" * 200_000, "longer than 1048576 characters"),
        ("base: base.tar\nrun: [{command: ls, network: yes please}]\n", "run: a list of commands"),
    ],
)
def test_a_hostile_build_spec_is_refused_in_one_sentence(tmp_path, text, match):
    path = str(tmp_path / "bad.yaml")
    with open(path, "w") as f:
        f.write(text)
    with pytest.raises(ImageError, match=match):
        load_spec(path)


# -- a build step is nobody on the host ------------------------------------------------------------------

TOOLS = (
    "/usr/bin/id",
    "/usr/bin/mknod",
    "/usr/bin/mount",
    "/usr/bin/stat",
    "/usr/bin/chown",
    "/usr/bin/chmod",
    "/usr/bin/touch",
    "/usr/bin/setpriv",
    "/usr/bin/ls",
)
_SH = os.path.join(os.path.realpath("/bin"), "sh").lstrip("/")  # usr/bin/sh where /bin is a symlink


def _host_handle(path: str) -> tuple[int, bytes]:
    """(type, bytes) of the kernel's file handle for `path`: what open_by_handle_at takes to reopen it."""

    class FileHandle(ctypes.Structure):
        _fields_ = [("size", ctypes.c_uint), ("type", ctypes.c_int), ("bytes", ctypes.c_ubyte * 128)]

    handle, mount_id = FileHandle(128), ctypes.c_int()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.name_to_handle_at(-100, os.fsencode(path), ctypes.byref(handle), ctypes.byref(mount_id), 0) == 0
    return handle.type, bytes(handle.bytes[: handle.size])


def _with_ctypes(layer):
    """The host Python's ctypes in the layer (the hostile /bin/sh below is a Python program)."""
    code = (
        "import ctypes, sys; "
        "print('\\n'.join(m.__file__ for m in list(sys.modules.values()) if getattr(m, '__file__', None)))"
    )
    for path in subprocess.run([HOST_PYTHON, "-c", code], capture_output=True, text=True, check=True).stdout.split():
        layer.host(path)
        if path.endswith(".so"):
            for lib in libraries(path):
                layer.host(lib)
    return layer


HOSTILE_SH = """#!/usr/bin/python3
import ctypes, os, stat, sys

report = open("/report", "a")
report.write(f"uid {{os.getuid()}}\\n")
report.write("uid_map " + " ".join(open("/proc/self/uid_map").read().split()) + "\\n")
nets = sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:])
report.write("net " + " ".join(nets) + "\\n")
try:  # a node for the host's disk
    os.mknod("/tmp/disk", stat.S_IFBLK | 0o600, {disk})
    report.write("mknod made the disk's node\\n")
except OSError as e:
    report.write(f"mknod refused: {{e}}\\n")
try:  # "shocker": reopen a host directory by its file handle, through any host file this step can see
    class FileHandle(ctypes.Structure):
        _fields_ = [("size", ctypes.c_uint), ("type", ctypes.c_int), ("bytes", ctypes.c_ubyte * 128)]
    raw = bytes.fromhex("{handle_hex}")
    handle = FileHandle(len(raw), {handle_type}, (ctypes.c_ubyte * 128)(*raw))
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount(b"none", b"/etc/resolv.conf", None, 32 | 4096, None)  # MS_REMOUNT | MS_BIND: read-write
    host_file = os.open("/etc/resolv.conf", os.O_RDONLY)
    fd = libc.open_by_handle_at(host_file, ctypes.byref(handle), os.O_RDONLY | os.O_DIRECTORY)
    if fd < 0:
        raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
    with open(os.open("canary", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "w") as f:
        f.write("pwned\\n")
    report.write("wrote the host's file\\n")
except OSError as e:
    report.write(f"open_by_handle_at refused: {{e}}\\n")
report.close()
os.execv("/bin/bash", ["/bin/bash"] + sys.argv[1:])
"""


def test_a_hostile_base_image_gets_no_root_on_the_host(work):
    """The base image's /bin/sh, which runs every step, tries what a real root could: make a node for the
    host's disk, and reopen a directory of the host by its file handle through a host file the step sees
    (/etc/resolv.conf, in a step with the network; remounted read-write) to write this test's canary there.
    Then it runs the step as if nothing happened. It is root inside, but on the host an unprivileged uid of a
    range no user has, with no capability there, and without the network unless the step asks: the canary is
    never written."""
    canary = os.path.join(work, "canary")
    handle_type, handle = _host_handle(work)
    hostile = _with_ctypes(host_userland_layer(extra=TOOLS))
    hostile.add(
        _SH,
        mode=0o755,
        data=HOSTILE_SH.format(disk=os.stat(work).st_dev, handle_type=handle_type, handle_hex=handle.hex()).encode(),
    )
    steps = ["echo built > /etc/built", {"command": "echo online > /etc/online", "network": True}]
    env = build(
        load_spec(_spec(work, steps, _image(work, "hostile.tar", hostile))),
        os.path.join(work, "store"),
        lambda line: None,
    )
    assert not os.path.exists(canary)
    with open(os.path.join(env.rootfs, "report")) as f:
        report = [line.split(" ", 1) for line in f.read().splitlines()]
    assert [what for what, _ in report] == ["uid", "uid_map", "net", "mknod", "open_by_handle_at"] * 2, report
    for what, value in report:
        if what == "uid":
            assert value == "0"  # root inside
        elif what == "uid_map":  # ... and on the host a range of uids that no user has
            inside, outside, count = map(int, value.split())
            assert (inside, count) == (0, 65536) and outside > 0
            assert not [p.pw_name for p in pwd.getpwall() if outside <= p.pw_uid < outside + count]
        elif what == "mknod":
            assert value.startswith("refused: [Errno 1] Operation not permitted"), value
    shocker = [value for what, value in report if what == "open_by_handle_at"]
    assert shocker[0].startswith("refused: [Errno 2] No such file or directory: '/etc/resolv.conf'")  # no host file
    # One in a step with the network, but no capability to reopen the host's directory through it (EPERM; since
    # Linux 6.10 the handle is also checked against the mount it is opened through: ESTALE)
    assert shocker[1].startswith(("refused: [Errno 1] Operation not permitted", "refused: [Errno 116] Stale file"))
    with open("/proc/net/dev") as f:
        host_net = " ".join(_interfaces(f.read()))
    assert [value for what, value in report if what == "net"] == ["lo", host_net]  # only where asked
    assert open(os.path.join(env.rootfs, "etc", "online")).read() == "online\n"
    assert mounts_under(work) == []


def test_only_a_step_that_declares_it_gets_the_network(work):
    base = _image(work, "tools.tar", host_userland_layer(extra=TOOLS))
    steps = ["cat /proc/net/dev > /net-off", {"command": "cat /proc/net/dev > /net-on", "network": True}]
    env = build(load_spec(_spec(work, steps, base)), os.path.join(work, "store"), lambda line: None)
    with open("/proc/net/dev") as f:
        host = _interfaces(f.read())
    with open(os.path.join(env.rootfs, "net-off")) as off, open(os.path.join(env.rootfs, "net-on")) as on:
        assert _interfaces(off.read()) == ["lo"] and _interfaces(on.read()) == host


def test_a_step_chowns_and_sets_set_id_bits_and_the_owners_survive_into_its_layer_and_the_next_step(work):
    """As apt and dpkg do: a file given to a user with its set-user-ID bit, and a 0700 directory of a system
    user (apt's _apt, uid 42) that a process of that user writes into. The next step sees the owners (only
    uid 42 may list that directory), and so does the stored layer, in host ids that no user of this host has;
    set-ID and write bits are sealed off there, as an import seals them."""
    base = _image(work, "tools.tar", host_userland_layer(extra=TOOLS))
    as_apt = "setpriv --reuid 42 --regid 0 --clear-groups"
    steps = [
        "mkdir -p /home/app /var/lib/apt-like && echo hi > /home/app/tool && chown -R 1000:1000 /home/app && "
        "chmod 4755 /home/app/tool && chown 42:0 /var/lib/apt-like && chmod 700 /var/lib/apt-like && "
        f"{as_apt} touch /var/lib/apt-like/partial && stat -c '%u %g %a' /home/app/tool > /seen-in-step",
        f"{as_apt} ls /var/lib/apt-like > /listed-by-apt && "
        "stat -c '%u %g' /home/app /home/app/tool /var/lib/apt-like/partial > /seen-next-step",
    ]
    env = build(load_spec(_spec(work, steps, base)), os.path.join(work, "store"), lambda line: None)
    rootfs = env.rootfs
    assert open(os.path.join(rootfs, "seen-in-step")).read() == "1000 1000 4755\n"
    assert open(os.path.join(rootfs, "listed-by-apt")).read() == "partial\n"
    assert open(os.path.join(rootfs, "seen-next-step")).read() == "1000 1000\n1000 1000\n42 0\n"
    # On the host's disk: root is the host's root, inside id k > 0 the host id base+k that no user has
    ids = store_ids(os.path.join(work, "store"))
    owners = {
        path: (st.st_uid, st.st_gid)
        for path in ("home/app", "home/app/tool", "var/lib/apt-like", "var/lib/apt-like/partial", "seen-in-step")
        for st in [os.lstat(os.path.join(rootfs, path))]
    }
    assert owners == {
        "home/app": (ids.uid + 1000, ids.gid + 1000),
        "home/app/tool": (ids.uid + 1000, ids.gid + 1000),
        "var/lib/apt-like": (ids.uid + 42, 0),
        "var/lib/apt-like/partial": (ids.uid + 42, 0),
        "seen-in-step": (0, 0),
    }
    assert not [p.pw_name for p in pwd.getpwall() if ids.uid <= p.pw_uid < ids.uid + 65536]
    assert not os.lstat(os.path.join(rootfs, "home/app/tool")).st_mode & 0o6222


def test_without_user_namespaces_a_build_is_refused_and_never_runs_as_root(work):
    """In a user namespace whose limit of nested user namespaces is 0 (the kernel's own switch, set for this
    child only), a build says what to enable and runs nothing."""
    marker = os.path.join(work, "ran")
    code = (
        "import sys\nfrom codefleet.sandbox.envbuild import build, load_spec\nfrom codefleet.sandbox.oci import "
        "ImageError\ntry:\n    build(load_spec(sys.argv[1]), sys.argv[2], print)\nexcept ImageError as e:\n"
        "    print(e, file=sys.stderr)\n    sys.exit(2)\n"
    )
    done = subprocess.run(
        [
            "unshare",
            "--user",
            "--map-root-user",
            "sh",
            "-c",
            'echo 0 > /proc/sys/user/max_user_namespaces && exec "$@"',
            "-",
            sys.executable,
            "-c",
            code,
            _spec(work, [f"touch {marker}"]),
            os.path.join(work, "store"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "user namespace" in done.stderr and "user.max_user_namespaces" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not os.path.exists(marker)


def test_the_store_keeps_a_block_of_host_ids_no_one_has_and_refuses_when_someone_takes_it(tmp_path):
    """Root's subordinate range if it has one; else the first free block of 65536 from 100000 on, past every
    user, group and subordinate range; recorded in the store, and refused once another's range overlaps it."""
    subuid, subgid, store = tmp_path / "subuid", tmp_path / "subgid", tmp_path / "store"
    store.mkdir()
    subuid.write_text("alice:100000:65536\nbob:165536:65536\n")
    subgid.write_text("alice:100000:65536\n")
    ids = store_ids(str(store), str(subuid), str(subgid))
    taken = {p.pw_uid for p in pwd.getpwall()} | {g.gr_gid for g in grp.getgrall()}
    assert ids.uid == ids.gid >= 231072 and not taken & set(range(ids.uid, ids.uid + 65536))
    assert (store / "build-ids").read_text() == f"{ids.uid} {ids.gid}\n"
    subuid.write_text("")
    assert store_ids(str(store), str(subuid), str(subgid)) == ids  # recorded: kept, though 100000 is free now
    subuid.write_text(f"dave:{ids.uid + 10}:5\n")
    with pytest.raises(ImageError, match=f"host ids {ids.uid}.. .* which the subordinate range of dave"):
        store_ids(str(store), str(subuid), str(subgid))
    other = tmp_path / "other"
    other.mkdir()
    subuid.write_text("root:300000:65536\n")
    subgid.write_text("root:400000:65536\n")
    assert store_ids(str(other), str(subuid), str(subgid)) == HostIds(300000, 400000)


@pytest.mark.skipif(os.geteuid() == 0, reason="what a user who is not root is told")
def test_an_unprivileged_user_is_refused_in_one_sentence(tmp_path):
    (tmp_path / "base.tar").write_bytes(oci_tarball(image_layers()))
    spec = _spec(str(tmp_path), ["true"])
    with pytest.raises(ImageError, match="codefleet env build needs root.*run it as root"):
        build(load_spec(spec), str(tmp_path / "store"))
