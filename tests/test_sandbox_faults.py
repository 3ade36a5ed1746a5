"""Hostile commands and crashes, against every backend where the attack does not
depend on how a namespace sandbox is built (the vm's own are in test_sandbox_vm.py).

Each test does something bad — a command that never ends, a fork bomb, a
memory bomb, a gigabyte of output, writes and reads where it must not, a
killed bwrap, a SIGKILLed host process — and checks three things: the
result says clearly what happened, the host and the other sandboxes are
unaffected, and nothing is left behind (processes, mounts, cgroups,
directories). Many sandboxes at once and a crashed host process are in
test_sandbox_lifecycle.py; the shell protocol in test_sandbox_shell.py.
"""

from __future__ import annotations

import hashlib
import os
import re
import resource
import secrets
import signal
import socket
import subprocess
import tempfile
import threading
import time

import pytest
from helpers import (
    BACKENDS,
    assert_released,
    footprint,
    namespace_only,
    needs_cgroup,
    processes_with,
    running,
    sandbox_pids,
    unique_sleep,
    wait_for,
)

from codefleet.sandbox import SandboxDeadError, SandboxUnavailableError
from codefleet.sandbox.bwrap import unavailable_reason

UNAVAILABLE = unavailable_reason()
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"namespace sandbox unavailable: {UNAVAILABLE}"),
    pytest.mark.timeout(120),
]


@pytest.fixture(params=BACKENDS)
def sandbox_backend(request):
    """Each test of a sandbox here runs against every backend (the vm one under `-m vm`)."""
    return request.param


# -- helpers ------------------------------------------------------------------------


def _state(pid: int) -> str | None:
    """The process state letter (R, S, Z...), None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def bwrap_pid(sb) -> int:
    """The sandbox's outer bwrap: the process of the sandbox whose parent is this process."""
    for pid in sandbox_pids(sb):
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        if ppid == os.getpid():
            return pid
    raise AssertionError("the sandbox has no bwrap process")


# -- commands that do not end --------------------------------------------------------


def test_timeout_kills_the_command_and_keeps_the_shell(make_sandbox):
    sb = make_sandbox()
    sb.exec("cd /tmp && export KEEP=me")
    marker = unique_sleep()
    result = sb.exec(f"echo before; sleep {marker}", timeout_s=1)
    assert result.timed_out and result.exit_code == 124
    assert result.output.startswith("before\n") and "timed out after 1 s" in result.output
    assert running(sb, marker) == []
    after = sb.exec("pwd; echo $KEEP")
    assert (after.output, after.exit_code, after.shell_restarted) == ("/tmp\nme\n", 0, False)


def test_timeout_stops_a_loop_of_builtins(make_sandbox):
    sb = make_sandbox()
    sb.exec("cd /tmp && export KEEP=me")
    result = sb.exec("while :; do :; done", timeout_s=1)
    assert result.timed_out and result.exit_code == 124
    after = sb.exec("pwd; echo $KEEP; echo next")
    assert (after.output, after.shell_restarted) == ("/tmp\nme\nnext\n", False)


def test_timeout_kills_a_command_that_ignores_sigint(make_sandbox):
    sb = make_sandbox()
    marker = unique_sleep()
    result = sb.exec(
        f"python3 -c 'import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep({marker})'",
        timeout_s=1,
    )
    assert result.timed_out and "the shell is still alive" in result.output
    assert running(sb, marker) == []
    assert sb.exec("echo ok").output == "ok\n"


def test_timeout_kills_what_the_command_put_in_the_background(make_sandbox):
    sb = make_sandbox()
    earlier, survivor = unique_sleep(), unique_sleep()
    sb.exec(f"sleep {earlier} &")  # a job of an earlier command: it is spared
    # The foreground sleep dies of SIGINT at once and the shell is back; the
    # background child ignores SIGINT and would outlive the command.
    result = sb.exec(f"(trap '' INT; exec sleep {survivor}) & sleep {unique_sleep()}", timeout_s=1)
    assert result.timed_out
    assert running(sb, survivor) == []
    assert len(running(sb, earlier)) == 1
    assert sb.exec("echo ok").output == "ok\n"


def test_background_job_is_killed_at_close(make_sandbox):
    sb = make_sandbox()
    marker = unique_sleep()
    assert sb.exec(f"sleep {marker} &").exit_code == 0
    assert wait_for(lambda: running(sb, marker), timeout_s=20), "the background sleep never started"
    assert sb.exec("jobs").output.count("Running") == 1  # it persists between commands
    fp = footprint(sb)
    sb.close()
    assert processes_with(marker) == []
    assert_released([fp])


# -- resource bombs ------------------------------------------------------------------


@namespace_only  # its cgroup; a vm's bomb: test_sandbox_vm.py
def test_fork_bomb_is_contained(make_sandbox):
    neighbour = make_sandbox()
    sb = make_sandbox(max_processes=64)
    needs_cgroup(sb)
    result = sb.exec(":(){ :|:& };:", timeout_s=5)
    assert result.exit_code in (0, 124)
    time.sleep(1)  # let it saturate its limit
    with open(os.path.join(sb.cgroup.paths.get("pids") or sb.cgroup.paths[""], "pids.current")) as f:
        assert int(f.read()) <= 64
    assert subprocess.run(["true"], timeout=10).returncode == 0  # the host can still fork
    assert neighbour.exec("seq 20 | xargs -P 20 -n 1 true && echo spawned").output == "spawned\n"
    answer = sb.exec("echo alive", timeout_s=20)
    assert "alive" in answer.output or answer.shell_restarted, answer
    fp = footprint(sb)
    sb.close()
    assert_released([fp])


@namespace_only  # bwrap, its init and the shell are what is left
def test_fork_bomb_in_the_foreground_is_killed_on_timeout(make_sandbox):
    sb = make_sandbox(max_processes=64)
    sb.exec("cd /tmp && export KEEP=me")
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    result = sb.exec(f"python3 -c '{bomb}'", timeout_s=3)
    assert result.timed_out
    # Everything the bomb forked is gone: left are bwrap, its init and the shell.
    assert len(sandbox_pids(sb)) == 3, sorted(sandbox_pids(sb))
    assert sb.exec("pwd; echo $KEEP").output == "/tmp\nme\n"


@namespace_only  # its cgroup; a vm's: test_sandbox_vm.py
def test_memory_bomb_is_killed_and_reported(make_sandbox):
    neighbour = make_sandbox()
    sb = make_sandbox(memory_mb=256)
    needs_cgroup(sb)
    sb.exec("cd /tmp && export KEEP=me")
    result = sb.exec("python3 -c 'chunks = [bytearray(1 << 20) for _ in range(1024)]'", timeout_s=30)
    assert result.exit_code == 137 and not result.timed_out
    assert "killed by the sandbox's memory limit (256 MB)" in result.output
    assert sb.cgroup.oom_kills() >= 1
    assert sb.exec("pwd; echo $KEEP").output == "/tmp\nme\n"  # only the bomb died
    assert sb.exec("python3 -c 'x = bytearray(64 << 20); print(len(x))'").output == f"{64 << 20}\n"
    assert neighbour.exec("python3 -c 'x = bytearray(400 << 20); print(len(x))'").output == f"{400 << 20}\n"


@namespace_only  # the overlay's tmpfs; a vm's disk: test_sandbox_vm.py
def test_filling_the_workspace_gives_enospc_and_spares_the_host(make_sandbox, config):
    sb = make_sandbox(workspace_mb=16)
    if sb.workspace.strategy != "overlay":
        pytest.skip(f"the {sb.workspace.strategy!r} workspace of an unprivileged user has no tmpfs of its own")
    result = sb.exec("dd if=/dev/zero of=big bs=1M count=100", timeout_s=30)
    assert result.exit_code != 0 and "No space left on device" in result.output
    # The changes live on the sandbox's own 16 MB tmpfs, not on the host's disk.
    upper = os.statvfs(sb.workspace.upper)
    assert upper.f_blocks * upper.f_frsize <= 16 << 20
    assert os.stat(sb.workspace.upper).st_dev != os.stat(config.state_dir).st_dev
    assert sb.exec("rm big && echo fine > small && cat small").output == "fine\n"


def test_filling_tmp_is_reported(make_sandbox):
    sb = make_sandbox(memory_mb=256)
    needs_cgroup(sb)  # /tmp's pages count against memory_mb
    result = sb.exec("dd if=/dev/zero of=/tmp/big bs=1M count=400", timeout_s=30)
    assert result.exit_code != 0 and not result.timed_out
    assert "No space left on device" in result.output or "memory limit" in result.output, result.output
    after = sb.exec("rm -f /tmp/big; echo usable", timeout_s=20)
    assert "usable" in after.output


# -- output --------------------------------------------------------------------------


def test_a_gigabyte_of_output_is_truncated_with_head_and_tail(make_sandbox):
    sb = make_sandbox()
    limit = sb.config.output_limit_bytes
    rss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    result = sb.exec("echo START; yes | head -c 1G; echo END", timeout_s=90)
    assert not result.timed_out and result.exit_code == 0
    total = len("START\n") + (1 << 30) + len("END\n")
    assert result.truncated and result.cut_bytes == total - limit
    assert result.output.startswith("START\ny\ny\n") and result.output.endswith("y\ny\nEND\n")
    assert f"\n[... {total - limit} bytes of output cut ...]\n" in result.output
    assert len(result.output) == limit + len(f"\n[... {total - limit} bytes of output cut ...]\n")
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before_kb) / 1024
    assert grown_mb < 100, f"the host process grew by {grown_mb:.0f} MB reading 1 GB of output"
    zeros = sb.exec("head -c 1G /dev/zero", timeout_s=90)
    assert zeros.truncated and zeros.cut_bytes == (1 << 30) - limit


def test_binary_output_is_decoded_safely(make_sandbox):
    sb = make_sandbox()
    result = sb.exec("head -c 100000 /dev/urandom")
    assert result.exit_code == 0 and isinstance(result.output, str)
    result.output.encode("utf-8")  # no lone surrogates: always re-encodable
    assert result.truncated and result.cut_bytes == 100000 - sb.config.output_limit_bytes
    # The protocol's own separator byte, NULs and invalid UTF-8 in the output change nothing.
    odd = sb.exec(r"printf 'a\036b\000c\377d\n'; exit_code_follows=1; (exit 7)")
    assert (odd.output, odd.exit_code) == ("a\x1eb\x00c\ufffdd\n", 7)
    assert sb.exec("echo still-fine").output == "still-fine\n"


# -- reaching out of the sandbox -----------------------------------------------------


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_writes_outside_the_workspace_fail(make_sandbox):
    sb = make_sandbox()
    watched = ["/etc/passwd", "/etc/hostname", "/usr/bin/env", "/etc/hosts"]
    before = {p: _digest(p) for p in watched}
    probe = "codefleet-probe-" + secrets.token_hex(4)
    attempts = [
        f"echo x > /etc/{probe}",
        "echo x >> /etc/passwd",
        "echo x > /etc/hosts",
        f"touch /usr/bin/{probe}",
        "cp /usr/bin/true /usr/bin/env",
        "rm -f /usr/bin/env",
        f"mkdir /{probe}",
        f"echo x > /{probe}",
        f"ln -s /etc /{probe}",
        "mv /etc/hostname /etc/h2",
    ]
    script = "; ".join(f"if {a} 2>/dev/null; then echo 'WROTE: {a}'; fi" for a in attempts)
    out = sb.exec(script, timeout_s=20).output
    assert "WROTE" not in out, out
    assert {p: _digest(p) for p in watched} == before
    for leftover in (f"/etc/{probe}", f"/usr/bin/{probe}", f"/{probe}"):
        assert not os.path.lexists(leftover)
    assert sb.exec("echo ok > inside && cat inside").output == "ok\n"


def test_kernel_settings_are_read_only(make_sandbox):
    """Were /proc/sys writable to the sandbox user, core_pattern alone would hand out host
    root. The sandbox user is not root on the host, and /proc/sys is read-only besides.
    Only opened for writing, never written."""
    sb = make_sandbox()
    probe = (
        "import os\n"
        "for p in ['/proc/sys/kernel/core_pattern', '/proc/sys/vm/drop_caches', '/proc/sys/kernel/hostname',\n"
        "          '/proc/sysrq-trigger']:\n"
        "    try:\n"
        "        os.close(os.open(p, os.O_WRONLY)); print('WRITABLE', p)\n"
        "    except OSError as e:\n"
        "        print('refused', p, e.strerror)\n"
    )
    out = sb.exec(f'python3 -c "{probe}"', timeout_s=20).output
    assert "WRITABLE" not in out, out
    assert out.count("Read-only file system") + out.count("Permission denied") >= 3, out


@namespace_only  # paths of other sandboxes on the host; a vm sees none (test_sandbox_vm.py)
def test_host_secrets_are_unreadable(make_sandbox):
    sb, other = make_sandbox(), make_sandbox()
    token = secrets.token_hex(8)
    other.write_file("secret.txt", f"other-{token}\n")
    other_shell = max(sandbox_pids(other))  # some process of the other sandbox, as the host numbers it
    try:
        with open("/etc/shadow") as f:
            shadow_root = next(line for line in f if line.startswith("root:")).strip()
    except PermissionError:  # not root: no line of it may start the output then
        shadow_root = None
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        with open(os.path.join(d, "secret"), "w") as f:
            f.write(f"tmp-{token}\n")
        reads = [
            f"cat {d}/secret",
            "ls -la /root",
            "cat /root/.bashrc",
            "cat /etc/shadow",
            "cat /etc/gshadow",
            f"cat {other.workspace.merged}/secret.txt",
            f"cat {other.dir}/rw/upper/secret.txt",
            f"cat /proc/{other_shell}/root/workspace/secret.txt",
            "cat /proc/*/root/workspace/secret.txt",
            "grep -rs other- /proc/*/environ",
        ]
        out = sb.exec("; ".join(reads), timeout_s=20).output
    assert token not in out, out
    assert shadow_root not in out if shadow_root else not re.search(r"^root:", out, re.M)
    assert out.count("No such file or directory") >= 7, out
    assert other.read_file("secret.txt") == f"other-{token}\n"


def _primary_ip() -> str | None:
    """The host's address on its default route, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP: no packet is sent
            return s.getsockname()[0]
        except OSError:
            return None


def test_servers_on_the_host_are_unreachable(make_sandbox):
    sb = make_sandbox()
    server = socket.create_server(("0.0.0.0", 0))
    port = server.getsockname()[1]
    accepted = []

    def serve():
        while True:
            try:
                conn, addr = server.accept()
            except OSError:
                return
            accepted.append(addr)
            conn.close()

    threading.Thread(target=serve, daemon=True).start()
    try:
        targets = ["127.0.0.1"] + ([ip] if (ip := _primary_ip()) and ip != "127.0.0.1" else [])
        for host in targets:
            py = sb.exec(
                f"python3 -c \"import socket; socket.create_connection(('{host}', {port}), timeout=3); "
                f"print('CONNECTED')\"",
                timeout_s=20,
            )
            assert "CONNECTED" not in py.output and py.exit_code != 0
            assert "refused" in py.output or "unreachable" in py.output, py.output
            tcp = sb.exec(f"exec 3<>/dev/tcp/{host}/{port} && echo CONNECTED", timeout_s=20)
            assert "CONNECTED" not in tcp.output and tcp.exit_code != 0
        assert accepted == []
        socket.create_connection(("127.0.0.1", port), timeout=3).close()  # the host reaches it
        assert wait_for(lambda: len(accepted) == 1)
    finally:
        server.close()


# -- crashes -------------------------------------------------------------------------


def test_killing_pid_1_from_inside(make_sandbox):
    sb = make_sandbox()
    first = sb.exec("kill -9 1; echo sent", timeout_s=20)
    after = sb.exec("echo alive", timeout_s=20)
    if after.shell_restarted:  # the sandbox died: then both results must say so
        assert "[codefleet: the shell exited" in first.output
        assert "the previous shell had died" in after.output
    else:  # PID 1 ignored it (a namespace's), or it is not ours to signal (a vm's agent)
        assert first.output in ("sent\n", "bash: kill: (1) - Operation not permitted\nsent\n"), first.output
    assert after.output.startswith("alive\n") and after.exit_code == 0
    everything = sb.exec("kill -9 -1; echo still-here", timeout_s=20)
    assert "still-here" in everything.output or "[codefleet: the shell exited" in everything.output
    assert "alive" in sb.exec("echo alive", timeout_s=20).output


@namespace_only  # a killed QEMU: test_sandbox_vm.py
def test_killed_bwrap_restarts_the_shell_or_says_it_is_dead(make_sandbox):
    sb = make_sandbox()
    sb.exec("echo kept > file && cd /tmp")
    marker = unique_sleep()
    sb.exec(f"sleep {marker} &")
    pid = bwrap_pid(sb)
    os.kill(pid, signal.SIGKILL)  # a crash of the sandbox, as the host sees it
    assert wait_for(lambda: _state(pid) in ("Z", None)), "bwrap survived SIGKILL"
    try:
        result = sb.exec("cat /workspace/file; pwd", timeout_s=20)
    except SandboxDeadError as e:
        assert "create a new sandbox" in str(e)
    else:
        assert result.shell_restarted and result.exit_code == 0
        assert result.output.startswith("kept\n/workspace\n")  # the workspace survives, the cwd does not
        assert "fresh shell" in result.output
    assert wait_for(lambda: not processes_with(marker)), "a job of the crashed sandbox is still running"
    fp = footprint(sb)
    sb.close()
    assert_released([fp])


@namespace_only
def test_bwrap_killed_during_a_command(make_sandbox):
    sb = make_sandbox()
    pid = bwrap_pid(sb)
    threading.Timer(0.5, os.kill, (pid, signal.SIGKILL)).start()
    result = sb.exec("echo started; sleep 30; echo never", timeout_s=20)
    assert not result.timed_out and result.exit_code == 137
    assert result.output.startswith("started\n") and "never" not in result.output
    assert "[codefleet: the shell exited (status 137)" in result.output
    assert sb.exec("echo back").shell_restarted


@namespace_only
def test_ro_binds_that_do_not_exist_say_so_in_bwraps_words(make_sandbox, open_tmp):
    with pytest.raises(FileNotFoundError, match=r"ro_binds names .*missing.*remove it from ro_binds"):
        make_sandbox(ro_binds=[str(open_tmp / "missing")])
    shared = open_tmp / "shared"
    shared.mkdir()
    (shared / "data.txt").write_text("shared\n")
    sb = make_sandbox(ro_binds=[str(shared)])
    assert sb.exec(f"cat {shared}/data.txt").output == "shared\n"  # under /tmp: on top of the private tmpfs
    (shared / "data.txt").unlink()
    shared.rmdir()  # gone after the start: every later bwrap fails while it sets the sandbox up
    try:
        said = sb.run_oneoff(["true"]).output
    except SandboxUnavailableError as e:
        said = str(e)
    assert "Can't find source path" in said
    sb.exec("exit 3")
    with pytest.raises(SandboxDeadError, match="could not be restarted .*bwrap: Can't find source path"):
        sb.exec("echo restarted")
    fp = footprint(sb)
    sb.close()
    assert_released([fp])
