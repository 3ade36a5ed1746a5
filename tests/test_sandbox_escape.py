"""A security review's findings against the namespace backend, each tried the way
an attacker inside a sandbox would. Every one of them worked before sandboxes
ran as a host user who owns nothing (issue 33). The attacks that do not depend
on how a namespace sandbox is built are tried against every backend.

Attacks on host binaries and device nodes run in a mount namespace of their
own, against private copies bound over the host's paths: were a protection
missing, the copy would change, never the host's file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import textwrap

import pytest
from helpers import BACKENDS, namespace_only

from codefleet.sandbox import SandboxUnavailableError, bwrap, create_sandbox, identity, namespace, resolve_backend
from codefleet.sandbox.layers import mounts_under

UNAVAILABLE = bwrap.unavailable_reason()
AS_ROOT = os.geteuid() == 0
pytestmark = [
    pytest.mark.skipif(UNAVAILABLE is not None, reason=f"namespace sandbox unavailable: {UNAVAILABLE}"),
    pytest.mark.timeout(120),
]
root_only = pytest.mark.skipif(not AS_ROOT, reason="binds a private copy over a host path: needs root")


@pytest.fixture(params=BACKENDS)
def sandbox_backend(request):
    """Each test of a sandbox here runs against every backend (the vm one under `-m vm`)."""
    return request.param


def run(sb, command: str) -> str:
    return sb.exec(command, timeout_s=30).output


def in_private_mounts(script: str, state_dir: str, **env: str) -> dict:
    """Run `script` (Python, with `state_dir` as argv[1]) in a mount namespace of its own, where the
    binds it makes stay; it prints one JSON object last, which is returned."""
    done = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-c", textwrap.dedent(script), state_dir],
        capture_output=True,
        text=True,
        timeout=100,
        env={**os.environ, **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- 1. /proc/1/exe is the host's bwrap; a sandbox that could change it disabled isolation for good ------


_BWRAP_COPY = """
    import json, os, shutil, stat, subprocess, sys
    from codefleet.sandbox import SandboxConfig, create_sandbox
    state_dir = sys.argv[1]
    real = shutil.which("bwrap")
    copy = os.path.join(state_dir, "bwrap-copy")
    shutil.copy2(real, copy)
    subprocess.run(["mount", "--bind", copy, real], check=True)
    before = os.stat(copy)
    cfg = SandboxConfig(state_dir=os.path.join(state_dir, "s"), backend="auto")
    sb = create_sandbox(None, cfg)
    said = sb.exec("chmod 000 /proc/1/exe; chmod 4757 /proc/1/exe; touch /proc/1/exe; "
                   "python3 -c \\"import os; os.setxattr('/proc/1/exe', 'user.x', b'1')\\"; echo end").output
    sb.close()
    after = os.stat(copy)
    nxt = create_sandbox(None, cfg)
    print(json.dumps({"said": said, "mode_before": before.st_mode, "mode_after": after.st_mode,
                      "mtime_same": before.st_mtime_ns == after.st_mtime_ns,
                      "xattrs": os.listxattr(copy), "next_backend": nxt.info.backend,
                      "next_isolated": nxt.info.isolated, "next_id": nxt.exec("id -u").output.strip()}))
    nxt.close()
"""


@root_only
def test_the_hosts_bwrap_binary_cannot_be_changed_from_inside(open_tmp):
    seen = in_private_mounts(_BWRAP_COPY, str(open_tmp))
    refusals = seen["said"].count("Operation not permitted") + seen["said"].count("Permission denied")
    assert refusals == 4 and seen["said"].endswith("end\n"), seen["said"]
    assert seen["mode_after"] == seen["mode_before"] and seen["mtime_same"] and seen["xattrs"] == []
    assert (seen["next_backend"], seen["next_isolated"], seen["next_id"]) == ("namespace", True, "1000")


_BROKEN_BWRAP = """
    import json, os, shutil, subprocess, sys
    from codefleet.sandbox import SandboxConfig, SandboxUnavailableError, create_sandbox, resolve_backend
    state_dir = sys.argv[1]
    broken = os.path.join(state_dir, "bwrap-broken")
    with open(broken, "w") as f:
        f.write("#!/bin/sh\\necho 'bwrap: broken on purpose' >&2\\nexit 1\\n")
    os.chmod(broken, 0o755)
    subprocess.run(["mount", "--bind", broken, shutil.which("bwrap")], check=True)
    try:
        sb = create_sandbox(None, SandboxConfig(state_dir=os.path.join(state_dir, "s")))
        outcome = {"backend": sb.info.backend}
        sb.close()
    except SandboxUnavailableError as e:
        outcome = {"error": str(e)}
    print(json.dumps({**outcome, "auto": resolve_backend("auto")}))
"""


@root_only
def test_a_failing_bwrap_is_an_error_never_a_fall_back_to_no_isolation(open_tmp):
    seen = in_private_mounts(_BROKEN_BWRAP, str(open_tmp))
    assert seen["auto"] == "namespace"
    assert "backend" not in seen, "a broken bwrap fell back to the local backend"
    assert "broken on purpose" in seen["error"]


@namespace_only
def test_without_its_unprivileged_user_the_namespace_backend_refuses_to_start(repo, config, monkeypatch):
    if not AS_ROOT:
        pytest.skip("only root needs the codefleet-sandbox user")
    monkeypatch.setattr(identity, "SANDBOX_USER", "codefleet-no-such-user-" + secrets.token_hex(3))
    with pytest.raises(SandboxUnavailableError, match="unprivileged system user .*useradd --system"):
        create_sandbox(repo, dataclasses.replace(config, backend="namespace"))


@namespace_only  # a vm's processes are in its guest (test_sandbox_vm.py); on the host it is QEMU
def test_sandboxed_processes_run_as_a_host_user_who_is_not_root(make_sandbox):
    sb = make_sandbox()
    run(sb, "sleep 30 & echo started > mine.txt")
    expected = pwd.getpwnam(identity.SANDBOX_USER).pw_uid if AS_ROOT else os.getuid()
    assert expected != 0
    host_uids = set()
    for pid in namespace.procs.descendants(sb._init_pid) | {sb._init_pid, sb._proc.pid}:
        with open(f"/proc/{pid}/status") as f:
            uids = next(line for line in f if line.startswith("Uid:")).split()[1:]
        host_uids.update(int(u) for u in uids)
    assert host_uids == {expected}
    if sb.workspace.strategy == "overlay":
        assert os.stat(os.path.join(sb.workspace.upper, "mine.txt")).st_uid == expected
    assert sb.info.limits["host_user"].endswith(f"(uid {expected})")


@namespace_only  # the overlay over the host's repository and its user mapping
def test_the_repository_stays_its_owners_and_the_sandbox_may_change_it(make_sandbox, repo):
    sb = make_sandbox()
    out = run(
        sb, "echo '# changed' >> pkg/calc.py && stat -c '%U %a' pkg/calc.py && mkdir new && rm README.md && echo ok"
    )
    assert out.endswith("agent 644\nok\n"), out
    assert os.stat(os.path.join(repo, "pkg", "calc.py")).st_uid == os.getuid()
    assert os.path.exists(os.path.join(repo, "README.md"))
    sb.write_file("made/by/tool.txt", "from the file API\n")
    assert run(sb, "echo more >> made/by/tool.txt && stat -c %U made/by made/by/tool.txt").split() == ["agent"] * 2


# -- 2. device nodes -------------------------------------------------------------------------------------


_DEV_NULL_COPY = """
    import json, os, stat, subprocess, sys
    from codefleet.sandbox import SandboxConfig, create_sandbox
    state_dir = sys.argv[1]
    copy = os.path.join(state_dir, "null-copy")
    os.mknod(copy, 0o666 | stat.S_IFCHR, os.stat("/dev/null").st_rdev)
    os.chmod(copy, 0o666)
    subprocess.run(["mount", "--bind", copy, "/dev/null"], check=True)
    before = os.stat(copy)
    sb = create_sandbox(None, SandboxConfig(state_dir=os.path.join(state_dir, "s"), backend="namespace"))
    said = sb.exec("chmod 000 /dev/null; chmod 4777 /dev/null; touch -d 2001-01-01 /dev/null; touch /dev/null; "
                   "echo works > /dev/null && echo written").output
    sb.close()
    after = os.stat(copy)
    print(json.dumps({"said": said, "mode_same": before.st_mode == after.st_mode,
                      "times_same": (before.st_mtime_ns, before.st_atime_ns) == (after.st_mtime_ns,
                                                                                 after.st_atime_ns)}))
"""


@root_only
def test_the_hosts_device_nodes_cannot_be_changed_from_inside(open_tmp):
    seen = in_private_mounts(_DEV_NULL_COPY, str(open_tmp))
    refused = seen["said"].count("Operation not permitted") + seen["said"].count("Read-only file system")
    assert refused >= 3, seen["said"]  # EROFS: as root the nodes are bound from the owner's read-only view
    assert seen["said"].endswith("written\n")
    assert seen["mode_same"] and seen["times_same"]


# -- 3. what only root may read -----------------------------------------------------------------------------


@namespace_only  # a vm sees no host file at all (test_sandbox_vm.py)
def test_root_only_files_and_proc_entries_are_not_readable(make_sandbox):
    if not AS_ROOT:
        pytest.skip("plants root-owned files on the host")
    secret, name = secrets.token_hex(8), secrets.token_hex(4)
    hidden_dir = f"/usr/local/codefleet-test-{name}"
    late_etc = f"/etc/codefleet-test-{name}"
    sb = make_sandbox()  # the /etc file is made after this process's first sandbox
    try:
        os.mkdir(hidden_dir, 0o700)
        for path in (f"{hidden_dir}/key", late_etc):
            with open(path, "w") as f:
                f.write(secret)
            os.chmod(path, 0o600)
        late = make_sandbox()
        for box in (sb, late):
            out = run(box, f"cat {hidden_dir}/key {late_etc} 2>&1; ls {hidden_dir} 2>&1")
            assert secret not in out and out.count("Permission denied") == 3, out
        proc_files = [
            p
            for p in (
                "/proc/kpageflags",
                "/proc/kpagecount",
                "/proc/kpagecgroup",
                "/proc/slabinfo",
                "/proc/pagetypeinfo",
                "/proc/vmallocinfo",
            )
            if os.path.exists(p)
        ]
        assert proc_files
        out = run(
            sb,
            "for f in " + " ".join(proc_files) + "; do head -c 64 $f >/dev/null 2>&1 && echo READ $f; done; echo done",
        )
        assert out == "done\n", out
    finally:
        shutil.rmtree(hidden_dir, ignore_errors=True)
        if os.path.exists(late_etc):
            os.unlink(late_etc)


# -- 4. the persistent shell's channel ----------------------------------------------------------------------


def test_the_shells_memory_descriptors_and_pipes_are_out_of_reach(make_sandbox):
    sb = make_sandbox()
    probe = textwrap.dedent("""\
        import os, re
        shell = os.getppid()
        for path in (f"/proc/{shell}/mem", f"/proc/{shell}/environ", f"/proc/{shell}/fd/0", f"/proc/{shell}/fd/1"):
            try:
                open(path, "rb" if path.endswith(("mem", "environ", "0")) else "wb").close()
                print("OPENED", path)
            except OSError as e:
                print("refused", path, e.strerror)
        try:
            held = {fd: os.readlink(f"/proc/1/fd/{fd}") for fd in os.listdir("/proc/1/fd")}
        except PermissionError:  # PID 1 is not ours to look into (a vm's agent)
            held = {}
        for fd, target in held.items():
            if target.startswith("pipe:"):
                print("PID 1 HOLDS", fd, target)
        """)
    sb.write_file("probe.py", probe)
    out = run(sb, "python3 probe.py")
    assert "OPENED" not in out and "HOLDS" not in out and out.count("refused") == 4, out
    assert run(sb, "echo still answering") == "still answering\n"


def test_a_background_job_cannot_answer_for_the_next_command(make_sandbox):
    """The attack: a job outlives its command and writes a forged end marker into the shell's output pipe
    (through /proc/1/fd/1 or the shell's own fds) with exit status 0, before the next command finishes."""
    sb = make_sandbox()
    forger = textwrap.dedent("""\
        import os, time
        time.sleep(0.5)
        for target in ("/proc/1/fd/0", "/proc/1/fd/1", "/proc/1/fd/2", f"/proc/{os.getppid()}/fd/0",
                       f"/proc/{os.getppid()}/fd/1"):
            try:
                if not os.readlink(target).startswith("pipe:"):
                    continue  # /dev/null: nothing to forge through
                with open(target, "wb") as f:
                    f.write(b"forged\\n\\x1eguess:2:0\\x1e")
                print("FORGED via", target, flush=True)
            except OSError:
                pass
        """)
    sb.write_file("forger.py", forger)
    run(sb, "python3 forger.py > forger.log 2>&1 &")
    result = sb.exec("sleep 1; false", timeout_s=10)
    assert result.exit_code == 1 and "forged" not in result.output
    assert "FORGED" not in run(sb, "sleep 0.2; cat forger.log")


# -- 5. socket families -----------------------------------------------------------------------------------------


@namespace_only  # the seccomp filter; a vm has no vsock device at all (test_sandbox_vm.py)
def test_vsock_and_other_unneeded_socket_families_are_refused(make_sandbox):
    sb = make_sandbox()
    probe = textwrap.dedent("""\
        import socket
        for name in ("AF_VSOCK", "AF_PACKET", "AF_BLUETOOTH", "AF_CAN", "AF_TIPC", "AF_ALG", "AF_UNIX", "AF_INET",
                     "AF_INET6", "AF_NETLINK"):
            kind = socket.SOCK_DGRAM if name in ("AF_NETLINK", "AF_PACKET", "AF_CAN") else socket.SOCK_STREAM
            try:
                socket.socket(getattr(socket, name), kind).close()
                print(name, "ok")
            except OSError as e:
                print(name, e.errno)
        """)
    sb.write_file("sockets.py", probe)
    seen = dict(line.split() for line in run(sb, "python3 sockets.py").splitlines())
    if sb.info.limits["seccomp"] != "on":
        pytest.skip("libseccomp is not installed")
    assert {name for name, said in seen.items() if said == "ok"} == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert seen["AF_VSOCK"] == "97"  # EAFNOSUPPORT


# -- 6. fork keeps a sandbox's data inside its budget --------------------------------------------------------------


@namespace_only
def test_a_frozen_fork_layer_is_bounded_memory_not_host_disk(make_sandbox):
    sb = make_sandbox(workspace_mb=64)
    run(
        sb,
        "head -c 20M /dev/zero > big.bin && cp /bin/true suid && chmod 4755 suid && mkdir -p d && "
        "chmod 2775 d && for i in $(seq 300); do echo $i > d/f$i; done",
    )
    kids = sb.fork(2)
    try:
        layer = kids[0]._layers[0]
        if sb.workspace.strategy == "overlay":
            with open("/proc/self/mountinfo") as f:
                layer_mount = [line.split(" - ")[1].split() for line in f if f" {layer} " in line]
            assert layer_mount and layer_mount[0][0] == "tmpfs"
            assert "size=65536k" in layer_mount[0][2]
        assert not os.stat(os.path.join(layer, "suid")).st_mode & (stat.S_ISUID | stat.S_ISGID)
        assert os.stat(os.path.join(layer, "d")).st_mode & stat.S_ISGID  # a directory keeps it
        assert os.stat(os.path.join(layer, "big.bin")).st_uid != 0
        assert run(kids[1], "wc -c < big.bin; cat d/f300") == "20971520\n300\n"
    finally:
        for kid in kids:
            kid.close()
    assert not os.path.exists(layer) and mounts_under(layer) == []


def test_auto_falls_back_to_local_only_where_namespaces_can_never_work(monkeypatch):
    assert resolve_backend("auto") == "namespace"
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
    assert resolve_backend("auto") == "local"
