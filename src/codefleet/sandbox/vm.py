"""The `vm` backend: each sandbox is a QEMU microVM with its own kernel, restored from a snapshot.

Layout of one VM (vm_image.py builds the pieces): QEMU's `microvm` machine, no network device, the
guest kernel booted directly (PVH), the environment as a read-only erofs disk (`/dev/vda`) under a
tmpfs overlay, the repository as an ext4 disk of `workspace_mb` (`/dev/vdb`, mounted at /workspace)
and one virtio-serial port to the guest agent (vm_agent.py), which runs the shell and the file API.
Memory is `memory_mb`, vCPUs `ceil(cpu_cores)`; the guest kernel enforces the rest (ulimits).

Snapshots. The first VM for a given environment and shape boots once, up to an idle agent, and is saved
(`Template`): its RAM as a file on tmpfs, its device state beside it. Every sandbox after that restores
from it: QEMU maps the RAM file privately (copy-on-write: restored VMs share the pages they have not
written) and loads the device state; the agent then mounts this sandbox's workspace disk and starts
its shell. `fork(n)` pauses the sandbox, streams its RAM and device state to a file, copies its
workspace disk n times and restores n children from the stream; the parent then resumes. Children
are exact copies: shell, cwd, environment, background jobs, files. Each gets fresh entropy at once.

QEMU itself is confined: its own seccomp filter (`-sandbox on`, no spawning, no privilege changes),
as the unprivileged sandbox user when started by root (`-runas`), killed with its owner
(PR_SET_PDEATHSIG) and reaped by the next owner otherwise (state.py: its command line names the
owner's sb/ directory).

Acceleration is KVM where it can run a stock kernel, else QEMU's TCG (`accel()`): the same isolation,
one to two orders of magnitude slower. A host whose /dev/kvm is Ant Group's PVM (`kvm_pvm`, on some
cloud VMs) runs only PVM-built guests, so it gets TCG; `CODEFLEET_VM_ACCEL=kvm|tcg` overrides.
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import hashlib
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

from codefleet.sandbox import procs, vm_image
from codefleet.sandbox.base import (
    PathEscapeError,
    SandboxClosedError,
    SandboxConfig,
    SandboxDeadError,
    SandboxError,
    SandboxUnavailableError,
    check_env_names,
)
from codefleet.sandbox.files import FileTooLargeError
from codefleet.sandbox.identity import SANDBOX_USER
from codefleet.sandbox.state import owner_for
from codefleet.types import ExecResult, FileEntry, SandboxInfo, SearchMatch

MAX_RESPONSE = 64 << 20  # an agent's answer larger than this is a broken (or hostile) guest
FORK_PARALLEL = 8  # children of one fork restored at once
RPC_GRACE_S = 60.0  # beyond a command's own timeout, how long the host waits for the agent's answer
_ERRORS = {"PathEscapeError": PathEscapeError, "FileNotFoundError": FileNotFoundError,
           "IsADirectoryError": IsADirectoryError, "NotADirectoryError": NotADirectoryError,
           "FileExistsError": FileExistsError, "PermissionError": PermissionError,
           "FileTooLargeError": FileTooLargeError, "ValueError": ValueError, "UnicodeDecodeError": ValueError,
           "SandboxDeadError": SandboxDeadError}
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
        why = ("/dev/kvm is PVM, which runs only PVM-built kernels" if os.path.isdir("/sys/module/kvm_pvm")
               else "/dev/kvm is missing or not usable by this user")
        print(f"codefleet: backend 'vm': {why}; VMs run under QEMU's TCG emulation (same isolation, far slower)",
              file=sys.stderr, flush=True)
    return "tcg"


def vm_unavailable_reason() -> str | None:
    """Why this host cannot run vm sandboxes (one sentence), or None if it can."""
    try:
        qemu_binary()
        vm_image.guest_kernel()
        for tool in ("mkfs.erofs", "mkfs.ext4"):
            if shutil.which(tool) is None:
                return f"{tool} is missing; install Debian's {'erofs-utils' if 'erofs' in tool else 'e2fsprogs'}"
    except SandboxUnavailableError as e:
        return str(e)
    return None


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
                self._proc = procs.spawner.popen([sys.executable, "-I", "-S", "-c", _WATCHDOG],
                                                 stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                                 stderr=subprocess.DEVNULL, start_new_session=True)
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

    def __init__(self, workdir: str, *, memory_mb: int, vcpus: int, env_disk: str, workspace: str,
                 memory: str, incoming_fd: int | None = None, console: str | None = None):
        self.workdir = workdir
        self.qmp_path = os.path.join(workdir, "qmp.sock")
        self.port_path = os.path.join(workdir, "agent.sock")
        self.accel = accel()
        if self.accel == "tcg":  # emulated timers: the kernel needs the PIT to boot without kvmclock
            machine, cpu = "microvm,acpi=on,pit=on,pic=on,rtc=on", ["-accel", "tcg,thread=multi", "-cpu", "max"]
        else:
            machine, cpu = "microvm,acpi=on,pit=off,pic=off,rtc=off", ["-accel", "kvm", "-cpu", "host"]
        kernel = vm_image.guest_kernel()
        args = [qemu_binary(), "-M", machine, *cpu, "-smp", str(vcpus), "-m", f"{memory_mb}M",
                "-object", memory, "-machine", "memory-backend=mem",
                "-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-nic", "none",
                "-kernel", kernel, "-initrd", vm_image.initramfs(),
                "-append", "console=ttyS0 quiet panic=-1 reboot=t random.trust_cpu=on" + _timer_args(self.accel),
                "-serial", f"file:{console}" if console else "null",
                "-drive", "id=env,file=/dev/fdset/1,format=raw,if=none,readonly=on,file.locking=off",
                "-device", "virtio-blk-device,drive=env",
                "-drive", "id=ws,file=/dev/fdset/2,format=raw,if=none,discard=unmap,file.locking=off",
                "-device", "virtio-blk-device,drive=ws",
                "-device", "virtio-serial-device",
                "-chardev", f"socket,id=agent,path={self.port_path},server=on,wait=off",
                "-device", "virtserialport,chardev=agent,name=codefleet.0",
                "-qmp", f"unix:{self.qmp_path},server=on,wait=off"]
        # QEMU's own seccomp filter; as root it then becomes the sandbox user (-runas), a change of uid that
        # elevateprivileges=deny would forbid, and after which it holds no privilege to elevate to.
        confine = "on,obsolete=deny,spawn=deny,resourcecontrol=deny"
        if os.geteuid() == 0:  # VMSandbox refuses to start as root without this user
            args += ["-sandbox", confine, "-runas", SANDBOX_USER]
        else:
            args += ["-sandbox", confine + ",elevateprivileges=deny"]
        # Disks go in as descriptors (fd sets), never by path: QEMU, no longer root, could not reopen a path in
        # the owner's directory, which it must when a snapshot hands the disks over (read-only, then back).
        disks = [(1, os.open(env_disk, os.O_RDONLY | os.O_CLOEXEC)), (2, os.open(workspace, os.O_RDWR | os.O_CLOEXEC)),
                 (2, os.open(workspace, os.O_RDONLY | os.O_CLOEXEC))]
        for fdset, fd in disks:
            args += ["-add-fd", f"fd={fd},set={fdset}"]
        pass_fds = tuple(fd for _, fd in disks)
        if incoming_fd is not None:
            args += ["-incoming", "defer"]
            pass_fds += (incoming_fd,)
        try:
            self.proc = procs.spawner.popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.PIPE, pass_fds=pass_fds, preexec_fn=_die_with_parent)
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
                    raise SandboxUnavailableError(f"QEMU did not open {os.path.basename(path)} within its "
                                                  "start-up time") from None
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
        self.qmp("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared",
                                                            "state": ignore_shared}])
        self.qmp("migrate-incoming", uri=f"fd:{fd}")

    def save(self, path: str, timeout_s: float, ignore_shared: bool = False) -> None:
        """Stream this VM's state to `path` (and its RAM, unless `ignore_shared`: a shared RAM file is the
        snapshot's RAM as it stands); the VM is left paused."""
        self.qmp("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared",
                                                            "state": ignore_shared}])
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


def _user_exists(name: str) -> bool:
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
            self._fail(f"the VM's agent connection broke ({e})")
        try:
            reply = future.result(wait_s)
        except TimeoutError:
            raise SandboxDeadError(f"the VM's agent did not answer {op!r} within {wait_s:g} s") from None
        finally:
            with self._lock:
                self._waiting.pop(rid, None)
        if reply.get("ok") is True:
            return reply.get("result")
        error, message = str(reply.get("error")), str(reply.get("message"))[:2000]
        raise _ERRORS.get(error, SandboxError)(message if error in _ERRORS else f"{error}: {message}")

    def _read(self) -> None:
        buf = b""
        try:
            while True:
                chunk = self.sock.recv(1 << 20)
                if not chunk:
                    return self._fail("the VM's agent closed its port (the VM died or powered off)")
                buf += chunk
                while len(buf) >= 4:
                    (size,) = struct.unpack(">I", buf[:4])
                    if size > MAX_RESPONSE:
                        return self._fail(f"the VM's agent sent a {size}-byte answer; it is broken or hostile")
                    if len(buf) < 4 + size:
                        break
                    frame, buf = buf[4:4 + size], buf[4 + size:]
                    try:
                        reply = json.loads(frame)
                        future = self._waiting.get(reply["id"]) if isinstance(reply, dict) else None
                    except (ValueError, KeyError, TypeError):
                        return self._fail("the VM's agent sent an answer that is not JSON; it is broken or hostile")
                    if future is not None and not future.done():
                        future.set_result(reply)
        except OSError as e:
            self._fail(f"the VM's agent connection broke ({e})")

    def _fail(self, why: str) -> None:
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


# -- templates ----------------------------------------------------------------------------------------

def template_dir() -> str:
    """Snapshots live on tmpfs: their RAM files are mapped by every VM restored from them."""
    return os.environ.get("CODEFLEET_VM_TEMPLATES") or f"/dev/shm/codefleet-vm-{os.getuid()}"


class Template:
    """A booted, idle VM saved once per (kernel, initramfs, environment disk, memory, vCPUs, disk size)."""

    def __init__(self, env_disk: str, memory_mb: int, vcpus: int, workspace_mb: int):
        self.env_disk, self.memory_mb, self.vcpus, self.workspace_mb = env_disk, memory_mb, vcpus, workspace_mb
        key = json.dumps([vm_image.guest_kernel(), vm_image.initramfs(), env_disk, memory_mb, vcpus, workspace_mb,
                          accel()])
        self.dir = os.path.join(template_dir(), hashlib.sha256(key.encode()).hexdigest()[:20])
        self.memory = os.path.join(self.dir, "memory")
        self.state = os.path.join(self.dir, "state")
        self.boot_s: float | None = None

    def ensure(self, boot_timeout_s: float) -> "Template":
        if os.path.isfile(self.state):
            return self
        os.makedirs(template_dir(), mode=0o700, exist_ok=True)
        with open(os.path.join(template_dir(), "lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per host; the others wait and use its template
            if not os.path.isfile(self.state):
                self._build(boot_timeout_s)
                prune_templates(keep=TEMPLATES_KEPT)
        return self

    def used(self) -> None:
        """Mark this template as just used (pruning keeps the most recently used)."""
        try:
            os.utime(self.dir)
        except OSError:
            pass



    def _build(self, boot_timeout_s: float) -> None:
        building = self.dir + ".part"
        shutil.rmtree(building, ignore_errors=True)
        os.makedirs(building, mode=0o700)
        blank = os.path.join(building, "blank.img")
        with open(blank, "wb") as f:
            f.truncate(self.workspace_mb << 20)
        started = time.perf_counter()
        vm = Qemu(building, memory_mb=self.memory_mb, vcpus=self.vcpus, env_disk=self.env_disk, workspace=blank,
                  memory=f"memory-backend-file,id=mem,size={self.memory_mb}M,"
                         f"mem-path={os.path.join(building, 'memory')},share=on",
                  console=os.path.join(building, "console.log"))
        try:
            link = AgentLink(vm.connect_port(time.monotonic() + 30))
            try:
                link.call("hello", boot_timeout_s, entropy=base64.b64encode(os.urandom(64)).decode())
            except SandboxDeadError as e:
                time.sleep(0.2)  # QEMU's own last words, if it is exiting
                raise SandboxUnavailableError(f"the VM did not boot to its agent: {e}; QEMU: {vm.stderr()}; its "
                                              f"console: {_tail(os.path.join(building, 'console.log'))}") from None
            self.boot_s = time.perf_counter() - started
            vm.save(os.path.join(building, "state"), timeout_s=120, ignore_shared=True)
            link.close()
        finally:
            vm.kill()
        os.unlink(blank)
        os.replace(building, self.dir) if not os.path.exists(self.dir) else shutil.rmtree(building)


TEMPLATES_KEPT = 6  # snapshots kept per host; each holds its VM's touched RAM on tmpfs (~130 MB idle)


def prune_templates(keep: int) -> list[str]:
    """Remove all but the `keep` most recently used templates, and builds that died half-way. Called under
    the templates' lock. VMs restored from a removed template keep running: their mapping holds its RAM."""
    root = template_dir()
    entries = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.endswith(".part"):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.isdir(path):
            entries.append((os.stat(path).st_mtime, path))
    removed = [path for _, path in sorted(entries, reverse=True)[keep:]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def _tail(path: str) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 1500))
            return f.read().decode(errors="replace").strip()
    except OSError:
        return "(nothing)"


# -- the sandbox -------------------------------------------------------------------------------------

class VMSandbox:
    """A sandbox that is a microVM (see the module docstring). Thread-safe like the shell backends."""

    backend = "vm"

    def __init__(self, repo: str | None, config: SandboxConfig | None = None, *, _fork: tuple | None = None):
        config = config or SandboxConfig()
        check_env_names(config.env)
        if repo is not None and not isinstance(repo, (str, os.PathLike)):
            raise TypeError(f"the repository must be a directory path, not {type(repo).__name__}; "
                            "call create_sandbox(repo, config)")
        if repo is not None and not os.path.isdir(repo):
            raise FileNotFoundError(f"repository directory {repo!r} does not exist")
        if config.ro_binds:
            raise ValueError(f"SandboxConfig.ro_binds {config.ro_binds} cannot reach a vm sandbox, which sees only its "
                             "environment's disk and the workspace; give those files as an environment "
                             "(docs/environments.md) or use backend 'namespace'")
        if os.geteuid() == 0 and not _user_exists(SANDBOX_USER):
            raise SandboxUnavailableError(f"as root, vm sandboxes run QEMU as the user {SANDBOX_USER}, which does not "
                                          "exist; create it with scripts/setup.sh (docs/sandbox.md)")
        self.config = config
        self.owner = owner_for(config.state_dir)
        self.id = "vm-" + os.urandom(5).hex()
        self.dir = os.path.join(self.owner.dir, "sb", self.id)
        os.makedirs(self.dir, mode=0o700)
        self._lock = threading.RLock()
        self._closed = False
        self._closing = False  # close() has begun: what the VM's death makes a command raise
        self.vm: Qemu | None = None
        self.link: AgentLink | None = None
        self.restore_s = 0.0
        self.owner.track(self)
        try:
            started = time.perf_counter()
            self.disk = os.path.join(self.dir, "workspace.img")
            if _fork is None:
                self._restore_from_template(repo)
            else:
                self._restore_from_stream(*_fork)
            self.restore_s = time.perf_counter() - started
        except BaseException:
            self.close()
            raise

    # -- start ----------------------------------------------------------------------------------------

    @property
    def vcpus(self) -> int:
        return max(1, math.ceil(self.config.cpu_cores))

    def _boot_timeout(self) -> float:
        return 30.0 if accel() == "kvm" else 180.0

    def _restore_from_template(self, repo: str | None) -> None:
        c = self.config
        rootfs = None
        if c.environment is not None:
            from codefleet.sandbox.environments import rootfs_of

            rootfs = rootfs_of(c.environment)
        env_disk = vm_image.environment_disk(rootfs)
        vm_image.workspace_disk(self.disk, repo, c.workspace_mb)
        template = Template(env_disk, c.memory_mb, self.vcpus, c.workspace_mb).ensure(self._boot_timeout())
        template.used()
        fd = os.open(template.state, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._launch(env_disk, f"memory-backend-file,id=mem,size={c.memory_mb}M,mem-path={template.memory},"
                                   "share=off", fd, ignore_shared=True)
        finally:
            os.close(fd)
        self._call("start", 120, config=_config_dict(c))
        self.env_disk = env_disk

    def _restore_from_stream(self, env_disk: str, stream: str, parent_disk: str) -> None:
        _copy_sparse(parent_disk, self.disk)
        fd = os.open(stream, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._launch(env_disk, f"memory-backend-ram,id=mem,size={self.config.memory_mb}M", fd, ignore_shared=False)
        finally:
            os.close(fd)
        self.env_disk = env_disk

    def _launch(self, env_disk: str, memory: str, incoming_fd: int, ignore_shared: bool) -> None:
        self.vm = Qemu(self.dir, memory_mb=self.config.memory_mb, vcpus=self.vcpus, env_disk=env_disk,
                       workspace=self.disk, memory=memory, incoming_fd=incoming_fd)
        self.vm.incoming(incoming_fd, ignore_shared)
        with open(os.path.join(self.dir, "pids.json"), "w") as f:  # for the reaper (state.py)
            json.dump([[self.vm.proc.pid, self.vm.started]], f)
        self.link = AgentLink(self.vm.connect_port(time.monotonic() + 30))
        self._call("hello", self._boot_timeout(), entropy=base64.b64encode(os.urandom(64)).decode())

    def _call(self, op: str, wait_s: float, **args: object) -> object:
        if self._closed:
            raise SandboxClosedError(f"sandbox {self.id} is closed; create a new one")
        try:
            return self.link.call(op, wait_s, **args)
        except SandboxDeadError as e:
            if self._closing:
                raise SandboxClosedError(f"sandbox {self.id} was closed while it ran {op!r}") from None
            raise SandboxDeadError(f"sandbox {self.id}: {e}; close it and create a new sandbox") from None

    # -- the contract ----------------------------------------------------------------------------------

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            return _exec_result(self._call("exec", timeout_s + RPC_GRACE_S, command=command, timeout_s=timeout_s))

    def run_oneoff(self, argv: list[str], timeout_s: float | None = None) -> ExecResult:
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        return _exec_result(self._call("oneoff", timeout_s + RPC_GRACE_S, argv=list(argv), timeout_s=timeout_s))

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        text = self._call("read", RPC_GRACE_S, path=path, start_line=start_line, end_line=end_line)
        if not isinstance(text, str):
            raise SandboxError(f"sandbox {self.id}: the agent answered a read with {type(text).__name__}")
        return text

    def write_file(self, path: str, content: str | bytes) -> None:
        data = content.encode() if isinstance(content, str) else bytes(content)
        self._call("write", RPC_GRACE_S, path=path, content=base64.b64encode(data).decode())

    def list_dir(self, path: str = ".", recursive: bool = False) -> list[FileEntry]:
        rows = self._call("list", RPC_GRACE_S, path=path, recursive=recursive)
        return [FileEntry(str(r["path"]), str(r["kind"]), int(r["size_bytes"])) for r in _rows(rows)]

    def search(self, pattern: str, path: str = ".", max_matches: int = 200) -> list[SearchMatch]:
        rows = self._call("search", RPC_GRACE_S + 30, pattern=pattern, path=path, max_matches=max_matches)
        return [SearchMatch(str(r["path"]), int(r["line_number"]), str(r["line"])) for r in _rows(rows)]

    def alive(self) -> bool:
        if self._closed or self.vm is None or self.vm.proc.poll() is not None or self.link.broken:
            return False
        try:
            return self._call("alive", 10) is True
        except SandboxError:
            return False

    def fork(self, n: int) -> list["VMSandbox"]:
        """n sandboxes restored from a snapshot of this one taken now (memory, disk, shell and all)."""
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        with self._lock:
            if self._closed:
                raise SandboxClosedError(f"sandbox {self.id} is closed; create a new one")
            stream = os.path.join(self.dir, "fork.state")
            try:
                self.vm.save(stream, timeout_s=120)  # pauses; QEMU flushed the workspace disk first
                # restored side by side: each child is its own QEMU reading the same stream
                with ThreadPoolExecutor(max_workers=min(n, FORK_PARALLEL)) as pool:
                    made = [pool.submit(VMSandbox, None, self.config, _fork=(self.env_disk, stream, self.disk))
                            for _ in range(n)]
                children = [f.result() for f in made if f.exception() is None]
                failed = next((f.exception() for f in made if f.exception() is not None), None)
                if failed is not None:
                    for child in children:
                        child.close()
                    raise failed
            finally:
                try:
                    self.vm.qmp("cont")
                finally:
                    try:
                        os.unlink(stream)
                    except FileNotFoundError:
                        pass
            return children

    def close(self) -> None:
        """Kill the VM and remove its directory. Idempotent. A command running in another thread is not waited
        for: the VM is killed first, outside the lock that command holds, and the command raises
        SandboxClosedError."""
        self._closing = True
        if self.vm is not None and not self._closed:
            self.vm.proc.kill()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self.link is not None:
                    self.link.close()
                if self.vm is not None:
                    self.vm.kill()
            finally:
                shutil.rmtree(self.dir, ignore_errors=True)
                self.owner.untrack(self)

    @property
    def info(self) -> SandboxInfo:
        c = self.config
        limits = {"memory_mb": str(c.memory_mb), "vcpus": str(self.vcpus), "workspace_mb": str(c.workspace_mb),
                  "max_processes": str(c.max_processes), "cpu_time_s": str(c.cpu_time_s),
                  "enforced_by": "vm", "accel": self.vm.accel if self.vm else accel()}
        return SandboxInfo(self.id, self.backend, "/workspace", "ext4", limits, isolated=True)

    def __enter__(self) -> "VMSandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<VMSandbox {self.id} {'closed' if self._closed else 'open'}>"


def _config_dict(config: SandboxConfig) -> dict:
    return {k: getattr(config, k) for k in ("timeout_s", "output_limit_bytes", "memory_mb", "max_processes",
                                             "cpu_cores", "cpu_time_s", "workspace_mb", "tmp_mb", "max_file_mb",
                                             "env")}


def _rows(rows: object) -> list[dict]:
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise SandboxError("the VM's agent answered with something that is not a list of entries")
    return rows


def _exec_result(raw: object) -> ExecResult:
    if not isinstance(raw, dict):
        raise SandboxError("the VM's agent answered a command with something that is not a result")
    return ExecResult(str(raw.get("output", "")), int(raw.get("exit_code", -1)), bool(raw.get("timed_out")),
                      bool(raw.get("truncated")), float(raw.get("duration_s", 0.0)), int(raw.get("cut_bytes", 0)),
                      bool(raw.get("shell_restarted")))


def _copy_sparse(src: str, dst: str) -> None:
    subprocess.run(["cp", "--sparse=always", "--reflink=auto", src, dst], check=True, capture_output=True)
