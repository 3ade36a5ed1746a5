"""What a namespace sandbox can see and touch, checked from both sides.

Every test runs real commands in a real sandbox (bubblewrap + overlay +
cgroups) and compares what the sandbox reports with what the host knows:
namespace inodes, mount flags, files the test planted on the host, the
cgroup files of the sandbox. Faults and hostile commands are in
test_sandbox_faults.py. The two tests that hold for any sandbox run against
every backend; a vm's isolation is checked in test_sandbox_vm.py.
"""

from __future__ import annotations

import os
import secrets
import tempfile
import time

import pytest
from helpers import every_backend, needs_cgroup

from codefleet.sandbox import cgroups
from codefleet.sandbox.bwrap import SANDBOX_UID, unavailable_reason

UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"namespace sandbox unavailable: {UNAVAILABLE}"),
    pytest.mark.timeout(60),
]


def run_ok(sb, command: str) -> str:
    result = sb.exec(command, timeout_s=20)
    assert result.exit_code == 0, f"{command!r} failed ({result.exit_code}): {result.output}"
    return result.output


# -- namespaces --------------------------------------------------------------------


def test_own_mount_pid_ipc_uts_net_and_user_namespaces(make_sandbox):
    sb = make_sandbox()
    kinds = ["mnt", "pid", "ipc", "uts", "net", "user"]
    inside = run_ok(sb, "for ns in " + " ".join(kinds) + "; do readlink /proc/self/ns/$ns; done").split()
    host = [os.readlink(f"/proc/self/ns/{ns}") for ns in kinds]
    assert len(inside) == len(kinds)
    for kind, in_ns, host_ns in zip(kinds, inside, host):
        assert in_ns.startswith(f"{kind}:["), in_ns
        assert in_ns != host_ns, f"the sandbox shares the host's {kind} namespace ({host_ns})"
    assert run_ok(sb, "hostname") == "sandbox\n"


def test_pid_namespace_shows_only_the_sandbox(make_sandbox):
    sb = make_sandbox()
    pids = {int(p) for p in run_ok(sb, "ls /proc | grep -E '^[0-9]+$'").split()}
    # init, the shell, ls and grep, numbered from 1: nothing of the host.
    assert 1 in pids and len(pids) <= 5 and max(pids) < 100, f"processes visible inside: {sorted(pids)}"
    assert run_ok(sb, "cat /proc/1/cmdline | tr '\\0' ' '").startswith("bwrap")


@every_backend
def test_network_is_loopback_only_and_up(make_sandbox):
    sb = make_sandbox()
    assert run_ok(sb, "python3 -c 'import socket; print([n for _, n in socket.if_nameindex()])'") == "['lo']\n"
    # Loopback works inside: a server and a client, both in the sandbox.
    echo = (
        "import socket\n"
        "srv = socket.create_server(('127.0.0.1', 0))\n"
        "c = socket.create_connection(srv.getsockname(), timeout=5)\n"
        "conn, _ = srv.accept()\n"
        "c.sendall(b'ping'); print(conn.recv(4).decode())\n"
    )
    assert run_ok(sb, f'python3 -c "{echo}"') == "ping\n"
    out = sb.exec(
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), timeout=3)\"", timeout_s=20
    ).output
    assert "Network is unreachable" in out


def test_ipc_objects_are_private(make_sandbox):
    a, b = make_sandbox(), make_sandbox()
    run_ok(a, "ipcmk -M 4096")
    assert "0x" in run_ok(a, "ipcs -m")
    assert "0x" not in run_ok(b, "ipcs -m"), "a System V segment of one sandbox is visible in another"


# -- filesystem --------------------------------------------------------------------


def test_host_filesystem_is_read_only(make_sandbox):
    sb = make_sandbox()
    mounts = {}
    for line in run_ok(sb, "cat /proc/self/mounts").splitlines():
        _, point, _, opts = line.split()[:4]
        mounts[point] = opts.split(",")
    for point in ("/", "/usr", "/etc"):
        assert "ro" in mounts[point], f"{point} is mounted {mounts[point]} inside the sandbox"
    assert "rw" in mounts["/workspace"] and "rw" in mounts["/tmp"]
    name = "codefleet-probe-" + secrets.token_hex(4)
    for target in (f"/usr/{name}", f"/etc/{name}", f"/{name}", f"/usr/bin/{name}"):
        result = sb.exec(f"touch {target}", timeout_s=20)
        assert result.exit_code != 0 and "Read-only file system" in result.output, (target, result.output)
        assert not os.path.exists(target)


def test_host_home_tmp_and_state_are_invisible(make_sandbox, config, repo):
    sb = make_sandbox()
    with tempfile.NamedTemporaryFile("w", dir="/tmp", prefix="codefleet-secret-") as f:
        f.write("host-tmp-secret\n")
        f.flush()
        out = sb.exec(f"ls -a /root /home; cat {f.name}; ls -a /tmp; ls {config.state_dir} {repo}", timeout_s=20).output
    assert "host-tmp-secret" not in out
    assert "cannot access '/root'" in out and "cannot access '/home'" in out
    assert f"{f.name}: No such file or directory" in out
    assert f"cannot access '{config.state_dir}'" in out and f"cannot access '{repo}'" in out
    assert run_ok(sb, "ls -A /tmp") == "", "the sandbox's /tmp is not empty: it is not private"


def test_workspace_is_writable_and_copy_on_write(make_sandbox, repo):
    sb = make_sandbox()
    host_file = os.path.join(repo, "pkg", "calc.py")
    before = open(host_file).read()
    assert run_ok(sb, "pwd") == "/workspace\n"
    run_ok(sb, "echo changed > pkg/calc.py && mkdir -p new/dir && echo hi > new/dir/f && rm README.md")
    assert sb.read_file("pkg/calc.py") == "changed\n"
    assert sb.read_file("new/dir/f") == "hi\n"
    assert open(host_file).read() == before, "a write in the sandbox changed the host repository"
    assert os.path.exists(os.path.join(repo, "README.md"))


@every_backend
def test_each_sandbox_has_its_own_tmp(make_sandbox):
    a, b = make_sandbox(), make_sandbox()
    run_ok(a, "echo from-a > /tmp/shared && echo from-a > /var/tmp/shared && echo from-a > /dev/shm/shared")
    out = b.exec("cat /tmp/shared /var/tmp/shared /dev/shm/shared", timeout_s=20).output
    assert "from-a" not in out
    assert out.count("No such file or directory") == 3
    assert run_ok(a, "cat /tmp/shared") == "from-a\n"


# -- identity and limits -----------------------------------------------------------


def test_not_root_and_no_capabilities(make_sandbox):
    sb = make_sandbox()
    assert run_ok(sb, "id -u; id -g").split() == [str(SANDBOX_UID)] * 2
    caps = dict(line.split(":\t") for line in run_ok(sb, "grep ^Cap /proc/self/status").splitlines())
    assert set(caps) == {"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"}
    assert all(int(v, 16) == 0 for v in caps.values()), caps
    out = sb.exec("unshare -r id -u; mount -t tmpfs none /tmp", timeout_s=20).output
    assert "unshare failed" in out, f"a nested user namespace made the sandbox root: {out}"
    assert "must be superuser" in out


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _cgroup_of(pid: int) -> dict[str, str]:
    """The cgroup path of `pid` per controller ("" for the v2 hierarchy), as the host sees it."""
    paths = {}
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                paths[c] = path
    return paths


def test_limits_are_enforced_by_the_sandbox_cgroup(make_sandbox):
    sb = make_sandbox(memory_mb=300, max_processes=77, cpu_cores=0.5)
    needs_cgroup(sb)
    assert sb.info.limits["enforced_by"].startswith("cgroup"), sb.info.limits
    assert (sb.info.limits["memory_mb"], sb.info.limits["max_processes"]) == ("300", "77")
    cg = sb.cgroup
    marker = f"1000.{secrets.randbelow(10**6)}"
    run_ok(sb, f"sleep {marker} & sleep {marker} &")

    def read(controller: str, name: str) -> str:
        with open(os.path.join(cg.paths[controller], name)) as f:
            return f.read().strip()

    if cg.mode == "v1":
        assert read("memory", "memory.limit_in_bytes") == str(300 << 20)
        assert read("pids", "pids.max") == "77"
        assert int(read("cpu", "cpu.cfs_quota_us")) / int(read("cpu", "cpu.cfs_period_us")) == 0.5
    else:
        assert read("", "memory.max") == str(300 << 20)
        assert read("", "pids.max") == "77"
        quota, period = read("", "cpu.max").split()
        assert int(quota) / int(period) == 0.5

    deadline = time.monotonic() + 5  # until both forks have exec'd sleep
    while True:
        members = cg.procs()
        sleepers = [p for p in members if marker.encode() in _cmdline(p)]
        if len(sleepers) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert len(sleepers) == 2, f"the sandbox's sleeps are not in its cgroup {cg.paths}"
    assert len(members) >= 5  # bwrap, its init, the shell, two sleeps
    for pid in members:
        seen = _cgroup_of(pid)
        for controller, path in cg.paths.items():
            assert os.path.join(cgroups.ROOT, controller, seen[controller].lstrip("/")) == path, (pid, seen)


def test_seccomp_denies_kernel_keyrings_and_host_kernel_state(make_sandbox):
    """Inside, uid 1000 is the host user: the keyrings it shares with the host are
    unreachable (EPERM from keyctl), and /proc's host-wide files are masked."""
    sb = make_sandbox()
    assert sb.info.limits["seccomp"] == "on"
    probe = (
        "import ctypes, errno, os; libc = ctypes.CDLL(None, use_errno=True); "
        "rc = libc.syscall(250, 0, 0, 0, 0, 0); "  # keyctl on x86_64
        "print(rc, errno.errorcode[ctypes.get_errno()])"
    )
    assert sb.exec(f'python3 -c "{probe}"').output.split() == ["-1", "EPERM"]
    masked = sb.exec("cat /proc/keys /proc/timer_list; echo done").output
    assert "keyring" not in masked and "done" in masked
    # The filter leaves ordinary work alone: processes, files, pipes.
    assert sb.exec("echo hi | tr a-z A-Z > out.txt && cat out.txt").output == "HI\n"


def test_the_sandboxs_pid_1_does_not_hold_the_host_environment(make_sandbox, monkeypatch):
    """bwrap's own environment stays readable in /proc/1/environ (--clearenv clears only the
    command's): host secrets such as API keys must not be in it."""
    secret = "codefleet-secret-" + secrets.token_hex(6)
    monkeypatch.setenv("CODEFLEET_TEST_API_KEY", secret)
    sb = make_sandbox()
    seen = run_ok(
        sb,
        "cat /proc/1/environ /proc/self/environ | tr '\\0' '\\n'; cat /proc/[0-9]*/environ "
        "2>/dev/null | tr '\\0' '\\n'",
    )
    assert secret not in seen and "CODEFLEET_TEST_API_KEY" not in seen, seen
    assert "PATH=" in seen


# What a command reads about its own sandbox: bwrap's environment and command line (PID 1's), its own
# environment, and the mount table, which names each bind mount's source and an overlay's layers.
_WHAT_IT_READS = (
    "tr '\\0' '\\n' </proc/1/environ; env; tr '\\0' ' ' </proc/1/cmdline; echo; cat /proc/self/mountinfo /proc/mounts"
)


def _host_values(config, repo: str) -> set[str]:
    """Paths and values of the host that nothing in a sandbox has a use for: the state directory, the
    repository's path, home and working directories, the host PATH's entries outside the sandbox's own."""
    from codefleet.sandbox.bwrap import PATH as SANDBOX_PATH

    ours = set(SANDBOX_PATH.split(":")) | {"", "/", "/tmp", "/var/tmp", "/usr", "/bin", "/etc", "/workspace"}
    found = {os.path.abspath(config.state_dir), repo, os.path.expanduser("~"), os.getcwd()}
    found |= {entry.rstrip("/") for entry in os.environ.get("PATH", "").split(":")}
    return {value for value in found if value not in ours}


def _leaks(text: str, values: set[str], allowed: tuple[str, ...] = ()) -> list[str]:
    """The lines of `text` naming one of `values` once the paths in `allowed` are taken out."""
    lines = []
    for line in text.splitlines():
        rest = line
        for path in allowed:
            rest = rest.replace(path, "")
        if any(value in rest for value in values):
            lines.append(line)
    return lines


def _bound_by_path(sb) -> tuple[str, ...]:
    """Where a sandbox still names the host: made by another user than root, who cannot mount, it binds the
    owner's files by path (and the workspace too, where that is a copy, not a FUSE overlay)."""
    if os.geteuid() == 0:
        return ()
    return (os.path.join(sb.owner.dir, "files"),) + ((sb.dir,) if sb.workspace.strategy == "copy" else ())


def test_no_host_path_or_environment_value_shows_inside(make_sandbox, config, repo):
    """bwrap's environment is the sandbox's PATH, its options come through a memfd, and (as root) the owner's
    files are bound through an overlay named by file descriptors: none names the host."""
    sb = make_sandbox()
    seen = run_ok(sb, _WHAT_IT_READS)
    assert _leaks(seen, _host_values(config, repo), _bound_by_path(sb)) == []
    assert "PATH=/usr/local/sbin:" in seen and " /etc/passwd " in seen and " /run/codefleet/shell " in seen


def test_an_images_userland_names_no_host_path_either(make_sandbox, config, repo, open_tmp):
    """An environment's /usr, /etc, ... come from its root filesystem in the image store: as root through
    the same kind of view as the owner's files."""
    from codefleet.bench.image_fixture import HOST_PYTHON, host_userland_layer, oci_tarball
    from codefleet.sandbox.environments import import_image

    if not os.path.exists(HOST_PYTHON):
        pytest.skip(f"builds its image from the host's {HOST_PYTHON}")
    archive = open_tmp / "image.tar"
    archive.write_bytes(oci_tarball([host_userland_layer().bytes()]))
    rootfs = import_image(str(archive), str(open_tmp / "store")).rootfs
    sb = make_sandbox(environment=rootfs)
    seen = run_ok(sb, _WHAT_IT_READS)
    allowed = _bound_by_path(sb) + ((rootfs,) if os.geteuid() != 0 else ())
    assert _leaks(seen, _host_values(config, repo) | {str(open_tmp)}, allowed) == []
    assert " /usr " in seen and " /etc " in seen


def test_not_even_the_workspace_names_a_host_path(make_sandbox, config, repo):
    """The workspace is an overlay whose layers (the repository's view, a fork's frozen layers, the upper layer)
    are named by file descriptors, bwrap binds it through its memfd and runs under its owner's process name,
    and its cgroup namespace is rooted at its own cgroup: in the shell, in a one-off, and in a fork of a fork,
    nothing names the state directory or the owner (whose name holds codefleet's host pid)."""
    sb = make_sandbox()
    run_ok(sb, "echo one > first")
    child = sb.fork(1)[0]
    try:
        run_ok(child, "echo two > second")
        grandchild = child.fork(1)[0]
        try:
            assert run_ok(grandchild, "cat first second") == "one\ntwo\n"
            reads = _WHAT_IT_READS + "; echo '-- cgroup'; cat /proc/self/cgroup"
            seen = {
                "shell": (sb, run_ok(sb, reads)),
                "one-off": (sb, sb.run_oneoff(["sh", "-c", reads], timeout_s=20).output),
                "fork of a fork": (grandchild, run_ok(grandchild, reads)),
            }
        finally:
            grandchild.close()
    finally:
        child.close()
    values = _host_values(config, repo) | {sb.owner.name}
    for where, (box, text) in seen.items():
        assert _leaks(text, values, _bound_by_path(box)) == [], where
        assert text.count(" /workspace ") == 2, (where, text)  # in mountinfo and in /proc/mounts
        cgroups_seen = {line.split(":", 2)[2] for line in text.split("-- cgroup\n", 1)[1].splitlines()}
        assert cgroups_seen == {"/"}, (where, cgroups_seen)  # each hierarchy's path, from the sandbox's own cgroup
    if sb.workspace.strategy == "overlay":
        assert "lowerdir=/proc/self/fd/" in seen["fork of a fork"][1]


def test_dev_is_read_only_and_dev_shm_is_bounded_like_tmp(make_sandbox):
    """/dev is bwrap's tmpfs, as large as half the host's memory: nothing may be written there
    but /dev/shm, a tmpfs of tmp_mb like /tmp (or a memory hog lands outside every limit that
    is not a cgroup)."""
    sb = make_sandbox(tmp_mb=64)
    probe = "codefleet-probe-" + secrets.token_hex(4)
    out = sb.exec(f"touch /dev/{probe} && echo WROTE; mkdir /dev/{probe}d && echo WROTE", timeout_s=20).output
    assert "WROTE" not in out and "Read-only file system" in out, out
    shm_kb = int(run_ok(sb, "df -k --output=size /dev/shm | tail -1"))
    assert 0 < shm_kb <= 64 * 1024, f"/dev/shm is {shm_kb} KiB"
    full = sb.exec("head -c 100M /dev/zero > /dev/shm/big", timeout_s=20)
    assert full.exit_code != 0 and "No space left on device" in full.output, full.output
    assert run_ok(sb, "rm /dev/shm/big; echo ok > /dev/shm/x; cat /dev/shm/x; echo hi > /dev/null") == "ok\n"
