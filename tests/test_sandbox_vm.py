"""The vm backend's own behaviour (sandbox/vm.py): what a command in a microVM can see and reach, the VM under
hostile commands, fork by snapshot, and what is left on the host after close or a crashed owner. The Sandbox
contract itself is the rest of the sandbox suite, which `make test-vm` runs against this backend too.

Under TCG (a host whose KVM cannot run Debian's kernel) a VM restores in ~1 s and a command takes 10-250 ms:
these tests use few VMs, of one shape where they can (helpers.VM_SHAPE), and generous timeouts.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import secrets
import shlex
import signal
import struct
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import threading
import time

import pytest
from helpers import VM_SHAPE, assert_released, footprint, processes_with, running, unique_sleep, wait_for

from codefleet.sandbox import SandboxClosedError, SandboxDeadError, procs
from codefleet.sandbox.identity import SANDBOX_USER
from codefleet.sandbox.vm import vm_unavailable_reason
from codefleet.sandbox.vm_image import kernel_dir, vm_dir

REASON = vm_unavailable_reason()
pytestmark = [
    pytest.mark.vm,
    pytest.mark.skipif(REASON is not None, reason=f"vm sandbox unavailable: {REASON}"),
    pytest.mark.timeout(300),
]


@pytest.fixture
def sandbox_backend():
    return "vm"


def run(sb, command: str, timeout_s: float = 60) -> str:
    return sb.exec(command, timeout_s=timeout_s).output


def _gone(pid: int, started: int | None) -> bool:
    """True once the process `pid` that started at `started` has exited (a zombie has)."""
    if procs.start_time(pid) != started:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# -- what a command sees --------------------------------------------------------------------------------


def test_sandbox_run_prints_the_guest_kernel_not_the_hosts(state_dir):
    script = "import os; u = os.uname(); print(u.sysname, u.release)"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "codefleet.cli",
            "sandbox",
            "run",
            "--backend",
            "vm",
            "--memory-mb",
            str(VM_SHAPE["memory_mb"]),
            "--",
            "python3",
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "CODEFLEET_STATE_DIR": state_dir},
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    sysname, release = done.stdout.split()
    assert sysname == "Linux" and release != os.uname().release
    with open(os.path.join(kernel_dir(), "version")) as f:
        assert release in f.read()  # the kernel vm-setup took from Debian's package


def test_no_host_file_is_visible(sandbox, repo, config):
    secret = secrets.token_hex(8)
    with tempfile.NamedTemporaryFile("w", dir="/var/tmp", prefix="codefleet-secret-") as planted:
        planted.write(secret)
        planted.flush()
        host_paths = ["/work", "/home", os.getcwd(), repo, config.state_dir, "/var/lib/codefleet", planted.name]
        out = run(
            sandbox,
            "ls -A /root; for p in "
            + " ".join(shlex.quote(p) for p in host_paths)
            + f'; do test -e "$p" && echo "SEEN $p"; done; grep -rls {secret} /tmp /var /root; echo done',
        )
    assert out == "done\n"


def test_the_only_devices_are_two_disks_and_the_agents_port(sandbox):
    assert run(sandbox, "ls /sys/class/net") == "lo\n"
    devices = run(sandbox, "cat /sys/bus/virtio/devices/*/device").split()
    assert sorted(devices) == ["0x0002", "0x0002", "0x0003"]  # virtio block, block, console: no network card
    vsock = run(sandbox, "python3 -c 'import socket; socket.socket(socket.AF_VSOCK, socket.SOCK_STREAM)'")
    assert "[Errno 97] Address family not supported" in vsock


_PROBE = textwrap.dedent("""\
    import glob, os, signal
    print("uid", os.getuid(), os.geteuid())
    print("capeff", next(line.split()[1] for line in open("/proc/self/status") if line.startswith("CapEff")))
    agents = [int(p.split("/")[2]) for p in glob.glob("/proc/[0-9]*/cmdline") if b"agent.zip" in open(p, "rb").read()]
    print("agents", len(agents))
    for pid in agents:
        print("oom", open(f"/proc/{pid}/oom_score_adj").read().strip())
        for path in (f"/proc/{pid}/mem", f"/proc/{pid}/environ", f"/proc/{pid}/fd/0", f"/proc/{pid}/maps"):
            try:
                open(path, "rb").close()
                print("OPENED", path)
            except OSError as e:
                print("refused", path, e.strerror)
        try:
            os.kill(pid, signal.SIGKILL)
            print("KILLED", pid)
        except OSError as e:
            print("refused", pid, e.strerror)
    ports = glob.glob("/dev/vport*")
    print("ports", len(ports))
    for path in ports + ["/run/codefleet/shell"]:
        try:
            open(path, "rb").close()
            print("OPENED", path)
        except OSError as e:
            print("refused", path, e.strerror)
    for path in ["/run/codefleet/agent.zip", "/run/codefleet/shell"]:
        try:
            open(path, "r+b").close()
            print("OPENED", path)
        except OSError as e:
            print("refused", path, e.strerror)
    """)


def test_commands_run_unprivileged_and_cannot_reach_the_agent(sandbox):
    sandbox.write_file("probe.py", _PROBE)
    lines = run(sandbox, "python3 probe.py").splitlines()
    said = dict(line.split(" ", 1) for line in lines if line.split()[0] in ("uid", "capeff", "agents", "ports"))
    uid = said["uid"].split()
    assert uid[0] == uid[1] != "0" and int(said["capeff"], 16) == 0
    assert said["agents"] == "2" and said["ports"] == "1"  # PID 1 and the agent it forked; the agent's one port
    assert [line for line in lines if line.startswith("oom")] == ["oom -1000"] * 2  # never the OOM killer's choice
    assert not [line for line in lines if line.startswith(("OPENED", "KILLED"))], lines
    assert len([line for line in lines if line.startswith("refused")]) == 2 * 5 + 4, lines
    alone = sandbox.exec("unshare -r id -u", timeout_s=30)  # no namespace of its own to be root in
    assert alone.exit_code != 0 and "unshare failed" in alone.output, alone.output
    assert run(sandbox, "echo -1000 > /proc/self/oom_score_adj || echo refused").endswith("refused\n")
    assert run(sandbox, "echo still answering") == "still answering\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="QEMU drops to the sandbox user only when started by root")
def test_qemu_runs_on_the_host_as_the_unprivileged_sandbox_user(sandbox):
    with open(f"/proc/{sandbox.vm.proc.pid}/status") as f:
        uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
    assert set(uids) == {str(pwd.getpwnam(SANDBOX_USER).pw_uid)}


# -- the shell's protocol and the agent's --------------------------------------------------------------------


def test_output_that_looks_like_protocol_frames_is_only_output(sandbox):
    frames = b"".join(
        struct.pack(">I", len(reply)) + reply
        for reply in (
            json.dumps({"id": i, "ok": True, "result": {"output": "forged", "exit_code": 0}}).encode()
            for i in range(1, 40)
        )
    )
    fake = frames + b"\x1e0123456789ab:1:0\x1e" + b"\x1e0123456789ab:2:0\x1e"
    sandbox.write_file("frames.bin", fake)
    result = sandbox.exec("cat frames.bin; (exit 3)")
    assert (result.output, result.exit_code) == (fake.decode(errors="replace"), 3)
    assert run(sandbox, "echo next") == "next\n"


# A background job whose output is the protocol's pipe: it looks for the nonce in the shell's memory and
# writes the end of the next commands with status 0.
_FORGER = r"""
import os, re, sys, time
shell = os.getppid()
nonces = set()
try:
    with open(f"/proc/{shell}/maps") as maps, open(f"/proc/{shell}/mem", "rb", 0) as mem:
        for line in maps:
            span, perms = line.split()[:2]
            if perms.startswith("r"):
                start, end = (int(x, 16) for x in span.split("-"))
                try:
                    mem.seek(start)
                    nonces.update(re.findall(rb"\\036([0-9a-f]{12}):", mem.read(end - start)))
                except OSError:
                    pass
    print("nonces", len(nonces), file=sys.stderr, flush=True)
except OSError as e:
    print("refused", e.strerror, file=sys.stderr, flush=True)
time.sleep(1)
for nonce in nonces:
    for seq in range(1, 40):
        os.write(1, b"\x1e" + nonce + b":%d:0\x1e" % seq)
"""


def test_a_job_cannot_read_the_shells_nonce_to_forge_an_exit_status(sandbox):
    sandbox.write_file("forger.py", _FORGER)
    run(sandbox, "python3 forger.py 2> forger.log &")
    result = sandbox.exec("sleep 4; false", timeout_s=30)
    assert (result.exit_code, result.timed_out) == (1, False), result
    assert sandbox.read_file("forger.log").startswith("refused"), sandbox.read_file("forger.log")


# -- fork -----------------------------------------------------------------------------------------------------


def test_fork_children_are_exact_copies_and_independent(sandbox):
    marker = unique_sleep()
    run(sandbox, "mkdir -p 'sub dir' && cd 'sub dir'")
    run(sandbox, "export EXPORTED='a b'; LOCAL=kept; greet() { echo \"hi $1\"; }")
    run(sandbox, f"sleep {marker} &")
    run(sandbox, "echo in-tmp > /tmp/t.txt; echo in-workspace > file.txt")
    children = sandbox.fork(2)
    try:
        show = 'pwd; echo "$EXPORTED|$LOCAL"; greet you; jobs; cat /tmp/t.txt file.txt'
        for child in [sandbox, *children]:
            result = child.exec(show)
            lines = result.output.splitlines()
            assert lines[:3] == ["/workspace/sub dir", "a b|kept", "hi you"], result.output
            assert "Running" in lines[3] and marker in lines[3]  # the background job, copied running
            assert lines[4:] == ["in-tmp", "in-workspace"] and not result.shell_restarted
        a, b = children
        run(
            a,
            "cd /; export EXPORTED=changed; kill %1; echo by-a > '/workspace/sub dir/file.txt'; echo by-a > /tmp/t.txt",
        )
        for other in (b, sandbox):
            lines = run(other, show).splitlines()
            assert lines[:3] == ["/workspace/sub dir", "a b|kept", "hi you"] and marker in lines[3]
            assert lines[4:] == ["in-tmp", "in-workspace"]
        assert wait_for(lambda: running(a, marker) == [], timeout_s=20) and len(running(b, marker)) == 1
        randoms = {run(box, "head -c 16 /dev/urandom | od -An -tx1") for box in (sandbox, a, b)}
        assert len(randoms) == 3  # each child got fresh entropy at its restore
    finally:
        for child in children:
            child.close()


def test_close_leaves_no_qemu_and_no_directory(sandbox):
    (child,) = sandbox.fork(1)
    prints = [footprint(sandbox), footprint(child)]
    assert [len(fp["procs"]) for fp in prints] == [1, 1]  # one QEMU each
    child.close()
    sandbox.close()
    assert_released(prints)
    assert processes_with(sandbox.dir) == [] and processes_with(child.dir) == []


_OWNER = textwrap.dedent("""
    import json, os, sys
    from codefleet.sandbox import SandboxConfig, create_sandbox
    sb = create_sandbox(None, SandboxConfig(backend="vm", state_dir=sys.argv[1], memory_mb=int(sys.argv[2])))
    print(json.dumps({"pid": sb.vm.proc.pid, "started": sb.vm.started, "dir": sb.dir}), flush=True)
    os.kill(os.getpid(), 9)
""")


def test_an_owner_killed_with_sigkill_leaves_no_qemu(state_dir):
    done = subprocess.run(
        [sys.executable, "-c", _OWNER, state_dir, str(VM_SHAPE["memory_mb"])],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    qemu = json.loads(done.stdout)
    assert wait_for(lambda: _gone(qemu["pid"], qemu["started"]), timeout_s=10), "QEMU outlived its owner"
    assert processes_with(qemu["dir"]) == []


def test_close_ends_a_command_running_in_another_thread(sandbox):
    """What SIGTERM to `codefleet agent run` does: the main thread closes the sandboxes that its attempts'
    threads are running commands in."""
    marker = unique_sleep()
    outcome = []

    def work():
        try:
            outcome.append(sandbox.exec(f"sleep {marker}; echo finished", timeout_s=120))
        except SandboxClosedError as e:
            outcome.append(e)

    worker = threading.Thread(target=work)
    worker.start()
    assert wait_for(lambda: running(sandbox, marker), timeout_s=30)
    started = time.perf_counter()
    sandbox.close()
    worker.join(timeout=10)
    assert time.perf_counter() - started < 5 and not worker.is_alive()
    assert len(outcome) == 1 and isinstance(outcome[0], SandboxClosedError), outcome
    assert "was closed while it ran 'exec'" in str(outcome[0])


def test_a_killed_vm_is_a_dead_sandbox_that_says_so(sandbox):
    qemu = sandbox.vm.proc.pid
    killer = threading.Timer(1.0, os.kill, (qemu, signal.SIGKILL))
    killer.start()
    started = time.perf_counter()
    try:
        with pytest.raises(SandboxDeadError, match="create a new sandbox"):
            sandbox.exec("echo started; sleep 30", timeout_s=60)
    finally:
        killer.cancel()
    assert time.perf_counter() - started < 15  # at once, not at the command's timeout
    assert not sandbox.alive()
    with pytest.raises(SandboxDeadError):
        sandbox.read_file("README.md")
    directory = sandbox.dir
    sandbox.close()
    assert not os.path.exists(directory)


# -- hostile commands -------------------------------------------------------------------------------------------


def test_a_fork_bomb_is_bounded_by_max_processes(make_sandbox):
    sb = make_sandbox(max_processes=64)
    result = sb.exec(":(){ :|:& };:", timeout_s=5)
    assert result.exit_code in (0, 124)
    time.sleep(2)  # let it reach its limit
    # Counted by a one-off, which the agent starts outside the shell's limit: its sh, ps and wc count too.
    threads = int(sb.run_oneoff(["sh", "-c", "ps -L -u $(id -u) --no-headers | wc -l"], timeout_s=60).output)
    assert 3 < threads <= 64 + 3
    assert subprocess.run(["true"], timeout=10).returncode == 0  # the host can still fork
    answer = sb.exec("echo alive", timeout_s=30)
    assert "alive" in answer.output or answer.shell_restarted, answer
    sb.write_file("after.txt", "still served\n")
    assert sb.read_file("after.txt") == "still served\n"


def test_a_memory_hog_is_killed_and_reported_and_the_vm_lives_on(sandbox):
    run(sandbox, "cd /tmp && export KEEP=me")
    result = sandbox.exec("python3 -c 'chunks = [bytearray(1 << 20) for _ in range(1024)]'", timeout_s=120)
    assert (result.exit_code, result.timed_out) == (137, False), result
    assert f"killed by the sandbox's memory limit ({VM_SHAPE['memory_mb']} MB)" in result.output
    assert run(sandbox, "pwd; echo $KEEP") == "/tmp\nme\n"  # only the hog died
    assert run(sandbox, "python3 -c 'print(len(bytearray(64 << 20)))'") == f"{64 << 20}\n"


def test_filling_the_filesystems_in_memory_gives_enospc_and_the_vm_lives_on(sandbox):
    """/tmp, /dev/shm and /var/tmp (the root's overlay) live in the VM's memory: full, together, they must
    leave the agent and the kernel enough, since no OOM kill frees a file."""
    out = run(
        sandbox, "for d in /tmp /dev/shm /var/tmp; do head -c 1G /dev/zero > $d/fill; done; echo tried", timeout_s=180
    )
    assert out.count("No space left on device") == 3 and out.endswith("tried\n"), out
    assert run(sandbox, "python3 -c 'print(len(bytearray(64 << 20)))'") == f"{64 << 20}\n"
    assert run(sandbox, "rm /tmp/fill /dev/shm/fill /var/tmp/fill && echo usable") == "usable\n"


def test_filling_the_workspace_stops_at_workspace_mb(make_sandbox):
    sb = make_sandbox(workspace_mb=64)
    result = sb.exec("dd if=/dev/zero of=big bs=1M count=100", timeout_s=120)
    assert result.exit_code != 0 and "No space left on device" in result.output, result.output
    disk = os.stat(sb.disk)  # all the host holds of the workspace: a sparse file of that size
    assert disk.st_size == 64 << 20 and disk.st_blocks * 512 <= 64 << 20
    assert run(sb, "rm big && echo fine > small && cat small") == "fine\n"


def test_host_paths_bound_read_only_are_refused_not_dropped(repo, config, tmp_path):
    from dataclasses import replace

    from codefleet.sandbox import create_sandbox

    with pytest.raises(ValueError, match="ro_binds .* cannot reach a vm sandbox"):
        create_sandbox(repo, replace(config, ro_binds=[str(tmp_path)]))


# -- the environment's disk and who commands run as ----------------------------------------------------------------

ETC_NAMES = {
    "passwd",
    "group",
    "hosts",
    "nsswitch.conf",
    "mtab",
    "os-release",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "services",
    "protocols",
    "alternatives",
}  # at most; the host may lack some
HOST_SECRETS = (
    "etc/shadow",
    "etc/gshadow",
    "etc/ssh",
    "etc/ssl",
    "etc/machine-id",
    "etc/resolv.conf",
    "etc/sudoers",
    "etc/gitconfig",
    "etc/pip.conf",
    "usr/etc",
    "usr/local/etc",
    "root",
    "home",
    "var",
)


def _extract(disk: str, into: str) -> str:
    subprocess.run(["fsck.erofs", f"--extract={into}", disk], check=True, capture_output=True)
    return into


@pytest.mark.skipif(os.geteuid() != 0, reason="plants canary secrets in the host's /etc")
def test_the_host_disk_holds_the_allow_list_and_an_etc_of_its_own_and_no_host_secret(tmp_path, monkeypatch):
    """Nothing planted here is on the real allow-list: the host's own disk, which other processes may be
    fingerprinting meanwhile, stays the same."""
    from codefleet.sandbox import vm_disks
    from codefleet.sandbox.vm_disks import DISK_MODE, environment_disk

    monkeypatch.setenv("CODEFLEET_VM_DIR", str(tmp_path / "vm"))
    userland = ("usr/sbin", "sbin")  # small, to build in a second; the real disk's /etc is the same code's
    token = secrets.token_hex(8)
    canary_dir, canary_alt = f"/etc/codefleet-test-secret-{token}", f"/etc/alternatives/codefleet-test-secret-{token}"
    new_etc = f"/etc/codefleet-test-etc-{token}"
    before_canaries = environment_disk(userland=userland)
    try:
        os.mkdir(canary_dir, 0o700)
        with open(os.path.join(canary_dir, "server.key"), "w") as f:
            f.write(f"-----BEGIN PRIVATE KEY-----\n{token}\n-----END PRIVATE KEY-----\n")
        with open(canary_alt, "w") as f:  # a file where only symlinks are taken
            f.write(token)
        disk = environment_disk(userland=userland)
        assert disk == before_canaries  # what the allow-list leaves out is not in the fingerprint: no rebuild
        os.unlink(disk)  # built again now, with the canaries on the host
        disk = environment_disk(userland=userland)
        assert oct(os.stat(disk).st_mode & 0o777) == oct(DISK_MODE) == "0o600"  # its owner's alone
        assert os.stat(os.path.dirname(disk)).st_mode & 0o077 == 0
        root = _extract(disk, str(tmp_path / "x"))
        assert sorted(os.listdir(root)) == ["etc", "sbin", "usr"] and os.listdir(os.path.join(root, "usr")) == ["sbin"]
        assert sorted(os.listdir(os.path.join(root, "usr/sbin"))) == sorted(os.listdir("/usr/sbin"))
        assert set(os.listdir(os.path.join(root, "etc"))) <= ETC_NAMES
        assert [p for p in HOST_SECRETS if os.path.lexists(os.path.join(root, p))] == []
        for dirpath, _, files in os.walk(os.path.join(root, "etc")):
            for name in files:
                path = os.path.join(dirpath, name)
                assert token not in name and not name.endswith((".key", ".pem"))
                if not os.path.islink(path):
                    with open(path, "rb") as f:
                        data = f.read()
                    assert token.encode() not in data and b"PRIVATE KEY" not in data, path
        alternatives = os.path.join(root, "etc/alternatives")
        assert all(os.path.islink(os.path.join(alternatives, n)) for n in os.listdir(alternatives))
        with open(os.path.join(root, "etc/passwd")) as f:
            assert [line.split(":")[0] for line in f if line.split(":")[2] == "0"] == ["root"]
        # A change in what the disk holds is a new disk: any byte of the generated /etc, or the allow-list.
        with open(new_etc, "w") as f:
            f.write("one\n")
        monkeypatch.setattr(vm_disks, "ETC_COPIED", (*vm_disks.ETC_COPIED, os.path.basename(new_etc)))
        with_file = environment_disk(userland=userland)
        with open(os.path.join(_extract(with_file, str(tmp_path / "y")), new_etc.lstrip("/"))) as f:
            assert with_file != disk and f.read() == "one\n"
        assert not os.path.exists(disk)  # the stale one is dropped
        with open(new_etc, "w") as f:
            f.write("two\n")
        assert environment_disk(userland=userland) not in (disk, with_file)
        assert environment_disk(userland=("usr/sbin", "sbin", "usr/libexec")) not in (disk, with_file)
    finally:
        for path in (os.path.join(canary_dir, "server.key"), canary_alt, new_etc):
            if os.path.lexists(path):
                os.unlink(path)
        if os.path.isdir(canary_dir):
            os.rmdir(canary_dir)


def test_the_guest_has_no_host_secret_and_its_tools_work(sandbox):
    assert os.stat(sandbox.env_disk).st_mode & 0o777 == 0o600
    out = run(sandbox, "cat /etc/shadow; echo rc=$?; ls -A /etc; ls -d /usr/local/etc /usr/etc /root/* 2>&1 | wc -l")
    assert out.startswith("cat: /etc/shadow: No such file or directory\nrc=1\n"), out
    assert set(out.splitlines()[2:-1]) <= ETC_NAMES and "passwd" in out
    assert out.splitlines()[-1] == "3"  # three "No such file" lines
    assert run(sandbox, "id -un; id -u; id -g") == "agent\n1000\n1000\n"
    assert "nosuid" in run(sandbox, "grep -E '^root / ' /proc/mounts").split()[3].split(",")  # no setuid way to root
    sandbox.write_file("test_ok.py", "def test_ok():\n    assert 1 + 1 == 2\n")
    tools = sandbox.exec(
        "bash -c 'echo bash ok'; python3 -c 'import ssl, sqlite3, json; print(\"python ok\")'; "
        "python3 -m pytest -q -p no:cacheprovider test_ok.py | tail -1; "
        "git init -q g && git -C g -c user.name=a -c user.email=a@b commit -q --allow-empty -m x && "
        "git -C g log --oneline | wc -l; grep -c ok test_ok.py; awk 'BEGIN { print \"awk ok\" }'",
        timeout_s=120,
    )
    lines = tools.output.splitlines()
    assert tools.exit_code == 0 and lines[:2] == ["bash ok", "python ok"], tools.output
    assert lines[2].startswith("1 passed") and lines[3:] == ["1", "1", "awk ok"], tools.output


# An image built the way an attacker would: its passwd maps the names a guest user could be looked up by to uid 0,
# and its Python (which runs the guest agent) forges the agent's answer to a command that prints a marker.
_FORGED_ASDICT = """
_codefleet_real_asdict = asdict
def asdict(obj, *, dict_factory=dict):
    answer = _codefleet_real_asdict(obj, dict_factory=dict_factory)
    if "FORGE-THIS-ANSWER" in str(answer.get("output", "")):
        answer["exit_code"] = 10 ** 30
    return answer
"""


@pytest.fixture(scope="module")
def hostile_image():
    from codefleet.bench.image_fixture import Layer, host_userland_layer, libraries, oci_tarball, python_stdlib_dir
    from codefleet.sandbox.environments import import_image

    base = host_userland_layer(
        extra=(
            "/usr/bin/mount",
            "/usr/bin/grep",
            "/usr/bin/id",
            "/usr/bin/ls",
            "/usr/bin/cut",
            "/usr/bin/touch",
            "/bin/sh",
        )
    )
    stdlib = python_stdlib_dir()  # the whole standard library: the agent imports more than a start does
    for dirpath, dirnames, files in os.walk(stdlib):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "test", "site-packages", "dist-packages")]
        for name in files:
            base.host(os.path.join(dirpath, name))
            if name.endswith(".so"):
                for lib in libraries(os.path.join(dirpath, name)):
                    base.host(lib)
    top = Layer()
    top.add("etc", tarfile.DIRTYPE, mode=0o755)
    top.add(
        "etc/passwd",
        data=b"root:x:0:0:root:/root:/bin/sh\ncodefleet-sandbox:x:0:0::/:/bin/sh\n"
        b"nobody:x:0:0::/:/bin/sh\nagent:x:0:0::/:/bin/sh\n",
    )
    top.add("etc/group", data=b"root:x:0:\ncodefleet-sandbox:x:0:\nnogroup:x:0:\nagent:x:0:\n")
    with open(os.path.join(stdlib, "dataclasses.py"), "rb") as f:
        top.add(os.path.join(stdlib, "dataclasses.py").lstrip("/"), data=f.read() + _FORGED_ASDICT.encode())
    with tempfile.TemporaryDirectory(prefix="codefleet-test-vm-image-", dir="/var/tmp") as d:
        archive = os.path.join(d, "hostile.oci.tar")
        with open(archive, "wb") as f:
            f.write(oci_tarball([base.bytes(), top.bytes()]))
        rootfs = import_image(archive, os.path.join(d, "store")).rootfs
        yield rootfs
        for source in glob.glob(os.path.join(vm_dir(), "disks", "*.erofs.source")):  # its disk, built by the tests
            with open(source) as f:
                if f.read() == rootfs:
                    os.unlink(source[: -len(".source")])
                    os.unlink(source)


def test_an_images_passwd_does_not_choose_who_commands_run_as(make_sandbox, hostile_image):
    with open(os.path.join(hostile_image, "etc/passwd")) as f:
        assert "codefleet-sandbox:x:0:0" in f.read()  # the image's word
    sb = make_sandbox(environment=hostile_image)
    out = run(
        sb,
        "id -u; id -g; id -un; python3 -c 'import os; print(os.getuid(), os.geteuid())'; "
        "touch mine; ls -n mine | cut -d' ' -f3,4; grep ':x:0:' /etc/passwd",
    )
    assert out == "1000\n1000\nagent\n1000 1000\n1000 1000\nroot:x:0:0:root:/root:/bin/sh\n", out


def test_an_image_whose_python_forges_the_agents_answers_breaks_only_its_sandbox(make_sandbox, hostile_image):
    sb = make_sandbox(environment=hostile_image)
    assert run(sb, "echo fine") == "fine\n"
    with pytest.raises(SandboxDeadError, match=r"the guest answered 'exec' with something malformed \(exit_code"):
        sb.exec("printf 'FORGE-THIS-%s\\n' ANSWER")
    assert not sb.alive()
    with pytest.raises(SandboxDeadError, match="broken or hostile|malformed"):
        sb.exec("echo again")
