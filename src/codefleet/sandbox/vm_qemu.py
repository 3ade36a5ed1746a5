"""The host's side of one microVM: the QEMU process and its QMP monitor (`Qemu`), the guest agent's port
(`AgentLink`), the watchdog that kills a dead owner's VMs, and the choice of accelerator (`accel`).
vm.py builds sandboxes from these; docs/sandboxes/vm.md says how the whole works.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future

from codefleet.sandbox import procs, vm_image
from codefleet.sandbox.base import PathEscapeError, SandboxDeadError, SandboxError, SandboxUnavailableError
from codefleet.sandbox.files import FileTooLargeError
from codefleet.sandbox.identity import SANDBOX_USER

MAX_RESPONSE = 64 << 20  # an agent's answer larger than this is a broken (or hostile) guest
MAX_ERROR_MESSAGE = 2000  # vm_agent.Agent.handle cuts an error's message to this
_ERRORS = {
    "PathEscapeError": PathEscapeError,
    "FileNotFoundError": FileNotFoundError,
    "IsADirectoryError": IsADirectoryError,
    "NotADirectoryError": NotADirectoryError,
    "FileExistsError": FileExistsError,
    "PermissionError": PermissionError,
    "FileTooLargeError": FileTooLargeError,
    "ValueError": ValueError,
    "UnicodeDecodeError": ValueError,
    "SandboxDeadError": SandboxDeadError,
}
_said_tcg = threading.Event()


def qemu_binary() -> str:
    path = shutil.which("qemu-system-x86_64")
    if path is None:
        raise SandboxUnavailableError("the vm backend needs QEMU; install Debian's qemu-system-x86")
    return path


def accel() -> str:
    """'kvm' where /dev/kvm can run the stock guest kernel, else 'tcg'. Raises where neither can run."""
    chosen = os.environ.get("CODEFLEET_VM_ACCEL", "auto")
    if chosen not in ("auto", "kvm", "tcg"):
        raise ValueError(f"CODEFLEET_VM_ACCEL={chosen!r}; use kvm, tcg or auto")
    if chosen != "auto":
        return chosen
    hardware = any(os.path.isdir(f"/sys/module/{m}") for m in ("kvm_intel", "kvm_amd"))
    if hardware and os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "kvm"
    if not _said_tcg.is_set():
        _said_tcg.set()
        why = (
            "/dev/kvm is PVM, which runs only PVM-built kernels"
            if os.path.isdir("/sys/module/kvm_pvm")
            else "/dev/kvm is missing or not usable by this user"
        )
        print(
            f"codefleet: backend 'vm': {why}; VMs run under QEMU's TCG emulation (same isolation, far slower)",
            file=sys.stderr,
            flush=True,
        )
    return "tcg"


# -- QEMU -------------------------------------------------------------------------------------------

# The watchdog: QEMU drops root with -runas, and a change of uid clears PR_SET_PDEATHSIG, so QEMU cannot
# be tied to its owner's life by the kernel. One small process per owner is: it reads "+pid ticks" and
# "-pid" lines, and when the pipe reaches EOF (the owner died, however) it kills what is still listed.
_WATCHDOG = r"""
import os, signal, sys
live = {}
def ticks(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None
for line in sys.stdin:
    op, _, rest = line.strip().partition(" ")
    if op == "+":
        pid, started = rest.split()
        live[int(pid)] = started
    elif op == "-":
        live.pop(int(rest), None)
for pid, started in live.items():
    if ticks(pid) == started:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
"""


class _Watchdog:
    def __init__(self) -> None:
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                # Not tied to the owner by PR_SET_PDEATHSIG: its SIGKILL would come right after the EOF that
                # tells the watchdog to act, and kill it first. EOF alone ends it.
                self._proc = procs.spawner.popen(
                    [sys.executable, "-I", "-S", "-c", _WATCHDOG],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            self._proc.stdin.write(line.encode())
            self._proc.stdin.flush()

    def watch(self, pid: int, started: int | None) -> None:
        self._send(f"+ {pid} {started}\n")

    def forget(self, pid: int) -> None:
        self._send(f"- {pid}\n")


watchdog = _Watchdog()


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    for s in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(s, signal.SIG_DFL)


class Qemu:
    """One QEMU process: its QMP monitor and the agent's port."""

    def __init__(
        self,
        workdir: str,
        *,
        memory_mb: int,
        vcpus: int,
        env_disk: str,
        workspace: str,
        memory: str,
        incoming_fd: int | None = None,
        console: str | None = None,
    ):
        self.workdir = workdir
        self.qmp_path = os.path.join(workdir, "qmp.sock")
        self.port_path = os.path.join(workdir, "agent.sock")
        self.accel = accel()
        args = _qemu_command(
            self.accel,
            memory_mb=memory_mb,
            vcpus=vcpus,
            memory=memory,
            console=console,
            port_path=self.port_path,
            qmp_path=self.qmp_path,
        )
        # Disks go in as descriptors (fd sets), never by path: QEMU, no longer root, could not reopen a path in
        # the owner's directory, which it must when a snapshot hands the disks over (read-only, then back).
        disks = [
            (1, os.open(env_disk, os.O_RDONLY | os.O_CLOEXEC)),
            (2, os.open(workspace, os.O_RDWR | os.O_CLOEXEC)),
            (2, os.open(workspace, os.O_RDONLY | os.O_CLOEXEC)),
        ]
        for fdset, fd in disks:
            args += ["-add-fd", f"fd={fd},set={fdset}"]
        pass_fds = tuple(fd for _, fd in disks)
        if incoming_fd is not None:
            args += ["-incoming", "defer"]
            pass_fds += (incoming_fd,)
        try:
            self.proc = procs.spawner.popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=pass_fds,
                preexec_fn=_die_with_parent,
            )
        finally:
            for _, fd in disks:
                os.close(fd)
        self.started = procs.start_time(self.proc.pid)
        watchdog.watch(self.proc.pid, self.started)
        self._qmp: socket.socket | None = None
        self._qmp_buf = b""
        self._qmp_lock = threading.Lock()

    def _connect(self, path: str, deadline: float) -> socket.socket:
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                s.connect(path)
                return s
            except (FileNotFoundError, ConnectionRefusedError):
                s.close()
                if self.proc.poll() is not None:
                    raise SandboxUnavailableError(f"QEMU exited ({self.proc.returncode}): {self.stderr()}") from None
                if time.monotonic() > deadline:
                    raise SandboxUnavailableError(
                        f"QEMU did not open {os.path.basename(path)} within its start-up time"
                    ) from None
                time.sleep(0.002)

    def connect_port(self, deadline: float) -> socket.socket:
        return self._connect(self.port_path, deadline)

    def qmp(self, command: str, fds: list[int] | None = None, **arguments: object) -> object:
        """Run one QMP command; its "return", or SandboxError with QEMU's message."""
        with self._qmp_lock:
            if self._qmp is None:
                self._qmp = self._connect(self.qmp_path, time.monotonic() + 30)
                self._qmp_read()  # greeting
                self._qmp_send({"execute": "qmp_capabilities"})
            self._qmp_send({"execute": command, **({"arguments": arguments} if arguments else {})}, fds)
            return self._qmp_read_reply(command)

    def _qmp_send(self, message: dict, fds: list[int] | None = None) -> None:
        data = json.dumps(message).encode() + b"\n"
        if fds:
            socket.send_fds(self._qmp, [data], fds)
        else:
            self._qmp.sendall(data)
        if message["execute"] == "qmp_capabilities":
            self._qmp_read_reply("qmp_capabilities")

    def _qmp_read(self) -> dict:
        while b"\n" not in self._qmp_buf:
            chunk = self._qmp.recv(1 << 16)
            if not chunk:
                raise SandboxDeadError(f"QEMU closed its monitor: {self.stderr()}")
            self._qmp_buf += chunk
        line, _, self._qmp_buf = self._qmp_buf.partition(b"\n")
        return json.loads(line)

    def _qmp_read_reply(self, command: str) -> object:
        while True:
            reply = self._qmp_read()
            if "return" in reply:
                return reply["return"]
            if "error" in reply:
                raise SandboxError(f"QEMU refused {command}: {reply['error'].get('desc')}")

    def incoming(self, fd: int, ignore_shared: bool) -> None:
        """Load the state streamed into inherited descriptor `fd`; the VM runs once it is loaded."""
        self.qmp("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": ignore_shared}])
        self.qmp("migrate-incoming", uri=f"fd:{fd}")

    def save(self, path: str, timeout_s: float, ignore_shared: bool = False) -> None:
        """Stream this VM's state to `path` (and its RAM, unless `ignore_shared`: a shared RAM file is the
        snapshot's RAM as it stands); the VM is left paused."""
        self.qmp("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared", "state": ignore_shared}])
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            self.qmp("getfd", fds=[fd], fdname="snapshot")
        finally:
            os.close(fd)
        self.qmp("migrate", uri="fd:snapshot")
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.qmp("query-migrate")
            status = info.get("status")
            if status == "completed":
                return
            if status in ("failed", "cancelled") or time.monotonic() > deadline:
                raise SandboxError(f"snapshot failed (migration {status}): {info.get('error-desc', '')}")
            time.sleep(0.002)

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "(still running)"
        return (self.proc.stderr.read() or b"").decode(errors="replace").strip()[-600:]

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        watchdog.forget(self.proc.pid)
        self.proc.stderr.close()
        if self._qmp is not None:
            self._qmp.close()


def _qemu_command(
    accel_name: str, *, memory_mb: int, vcpus: int, memory: str, console: str | None, port_path: str, qmp_path: str
) -> list[str]:
    """QEMU's command line but for its disks' descriptors and an incoming snapshot: a `microvm` on `accel_name`
    with the guest kernel and initramfs, no network device, the agent's port at `port_path`, QMP at `qmp_path`,
    and QEMU's own seccomp filter (and, as root, the sandbox user)."""
    if accel_name == "tcg":  # emulated timers: the kernel needs the PIT to boot without kvmclock
        machine, cpu = "microvm,acpi=on,pit=on,pic=on,rtc=on", ["-accel", "tcg,thread=multi", "-cpu", "max"]
    else:
        machine, cpu = "microvm,acpi=on,pit=off,pic=off,rtc=off", ["-accel", "kvm", "-cpu", "host"]
    kernel = vm_image.guest_kernel()
    args = [
        qemu_binary(),
        "-M",
        machine,
        *cpu,
        "-smp",
        str(vcpus),
        "-m",
        f"{memory_mb}M",
        "-object",
        memory,
        "-machine",
        "memory-backend=mem",
        "-nodefaults",
        "-no-user-config",
        "-nographic",
        "-no-reboot",
        "-nic",
        "none",
        "-kernel",
        kernel,
        "-initrd",
        vm_image.initramfs(),
        "-append",
        "console=ttyS0 quiet panic=-1 reboot=t random.trust_cpu=on" + _timer_args(accel_name),
        "-serial",
        f"file:{console}" if console else "null",
        "-drive",
        "id=env,file=/dev/fdset/1,format=raw,if=none,readonly=on,file.locking=off",
        "-device",
        "virtio-blk-device,drive=env",
        "-drive",
        "id=ws,file=/dev/fdset/2,format=raw,if=none,discard=unmap,file.locking=off",
        "-device",
        "virtio-blk-device,drive=ws",
        "-device",
        "virtio-serial-device",
        "-chardev",
        f"socket,id=agent,path={port_path},server=on,wait=off",
        "-device",
        "virtserialport,chardev=agent,name=codefleet.0",
        "-qmp",
        f"unix:{qmp_path},server=on,wait=off",
    ]
    # QEMU's own seccomp filter; as root it then becomes the sandbox user (-runas), a change of uid that
    # elevateprivileges=deny would forbid, and after which it holds no privilege to elevate to.
    confine = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
    if os.geteuid() == 0:  # VMSandbox refuses to start as root without this user
        args += ["-sandbox", confine, "-runas", SANDBOX_USER]
    else:
        args += ["-sandbox", confine + ",elevateprivileges=deny"]
    return args


def _timer_args(accel_name: str) -> str:
    """Under TCG the guest's TSC is the host's, but measuring it against an emulated PIT fails when the
    host is busy, and the boot then hangs: tell the kernel its frequency instead."""
    if accel_name != "tcg":
        return ""
    khz = 2_000_000
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    khz = int(float(line.split(":")[1]) * 1000)
                    break
    except (OSError, ValueError):
        pass
    return f" tsc_early_khz={khz} tsc=reliable no_timer_check"


def user_exists(name: str) -> bool:
    import pwd

    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False


# -- the agent's port -------------------------------------------------------------------------------


class AgentLink:
    """Requests to the guest agent over its port; answers matched by id (several may be in flight)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self._next = 0
        self._waiting: dict[int, Future] = {}
        self._lock = threading.Lock()
        self.broken: str | None = None
        threading.Thread(target=self._read, daemon=True, name="codefleet-vm-agent").start()

    def call(self, op: str, wait_s: float, **args: object) -> object:
        future: Future = Future()
        with self._lock:
            if self.broken:
                raise SandboxDeadError(self.broken)
            self._next += 1
            rid = self._next
            self._waiting[rid] = future
        data = json.dumps({"id": rid, "op": op, "args": args}).encode()
        try:
            self.sock.sendall(struct.pack(">I", len(data)) + data)
        except OSError as e:
            self.fail(f"the VM's agent connection broke ({e})")
        try:
            reply = future.result(wait_s)
        except TimeoutError:
            raise SandboxDeadError(f"the VM's agent did not answer {op!r} within {wait_s:g} s") from None
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
        if reply["ok"]:
            return reply["result"]
        error, message = reply["error"], reply["message"]
        raise _ERRORS.get(error, SandboxError)(message if error in _ERRORS else f"{error}: {message}")

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    return self.fail("the VM's agent closed its port (the VM died or powered off)")
                buf += chunk
                while len(buf) >= 4:
                    (size,) = struct.unpack(">I", buf[:4])
                    if size > MAX_RESPONSE:
                        return self.fail(f"the VM's agent sent a {size}-byte answer; it is broken or hostile")
                    if len(buf) < 4 + size:
                        break
                    frame, buf = buf[4 : 4 + size], buf[4 + size :]
                    try:
                        reply = json.loads(frame)
                    except (ValueError, RecursionError):  # not UTF-8, not JSON, digits beyond int's, too deep
                        return self.fail("the VM's agent sent an answer that is not JSON; it is broken or hostile")
                    wrong = _envelope_problem(reply)
                    if wrong:
                        return self.fail(f"the VM's agent sent a malformed answer ({wrong}); it is broken or hostile")
                    future = self._waiting.get(reply["id"])  # none: an answer that came after its call gave up
                    if future is not None and not future.done():
                        future.set_result(reply)
        except OSError as e:
            self.fail(f"the VM's agent connection broke ({e})")

    def fail(self, why: str) -> None:
        """Mark the link broken: every call waiting, and every later one, raises SandboxDeadError(why)."""
        with self._lock:
            self.broken = self.broken or why
            waiting = list(self._waiting.values())
        for future in waiting:
            if not future.done():
                future.set_result({"ok": False, "error": "SandboxDeadError", "message": why})

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _envelope_problem(reply: object) -> str | None:
    """What is wrong with an answer's envelope, or None: `{"id": int, "ok": true, "result": ...}` or
    `{"id": int, "ok": false, "error": name, "message": text}`, as vm_agent.Agent sends them."""
    if type(reply) is not dict or type(reply.get("id")) is not int or type(reply.get("ok")) is not bool:
        return "not an object with an integer id and a boolean ok"
    if reply["ok"]:
        return None if sorted(reply) == ["id", "ok", "result"] else "ok, but not exactly id, ok and result"
    if sorted(reply) != ["error", "id", "message", "ok"]:
        return "an error, but not exactly id, ok, error and message"
    error, message = reply["error"], reply["message"]
    if type(error) is not str or not error.isidentifier() or len(error) > 100:
        return "an error whose name is not an identifier"
    if type(message) is not str or len(message) > MAX_ERROR_MESSAGE:
        return f"an error whose message is not a string of at most {MAX_ERROR_MESSAGE} characters"
    return None
