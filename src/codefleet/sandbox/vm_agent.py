"""The guest agent of a `vm` sandbox: PID 1 of the microVM, serving the host over one virtio-serial port.

It runs codefleet's own persistent shell and file API inside the guest (`GuestSandbox`, a `ShellSandbox`
like the local backend's, over /workspace), so a command, its timeout, its output cap and a path's
confinement behave exactly as in a namespace sandbox. Commands run as an unprivileged user fixed here
(`agent`, uid and gid 1000, as in a namespace sandbox), never looked up in the environment's /etc/passwd,
which an image controls: PID 1 writes the guest's passwd and group before anything runs. Commands cannot
touch the agent, its port or the guest's mounts. The VM is the boundary; what comes back from here is
treated by the host as untrusted data (vm_qemu.AgentLink and vm_answers.answer_of check it).

Protocol: frames of a 4-byte big-endian length and a JSON object. The host sends `{"id", "op", ...}`;
the agent answers `{"id", "ok": true, "result"}` or `{"id", "ok": false, "error", "message"}`, requests
handled concurrently (the shell's lock keeps commands in order). Ops: hello (fresh entropy after a
restore, since a snapshot's children would otherwise share their random state), start (mount the
workspace disk, start the shell), exec, oneoff, read, write, list, search, alive.

Only the standard library and codefleet's stdlib-only sandbox modules are imported: this file runs under
the environment's own python3, shipped in the initramfs as a zip (vm_image.agent_zip).
"""

from __future__ import annotations

import base64
import ctypes
import fcntl
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from dataclasses import asdict

from codefleet.sandbox.base import SandboxConfig
from codefleet.sandbox.shell import ShellSession
from codefleet.sandbox.shellbox import ShellSandbox, setup_script
from codefleet.types import SandboxInfo

MAX_FRAME = 64 << 20  # a request larger than this is refused (the host never sends one)
WORKSPACE_DEVICE = "/dev/vdb"
PORT_NAME = "codefleet.0"
# The shell runs from an execute-only copy of bash, as in a namespace sandbox: a process whose program its user
# may not read is not dumpable, so the commands it runs cannot read its memory (the protocol's nonce) or open
# its descriptors through /proc, and so cannot forge the end of a command.
SHELL_PATH = "/run/codefleet/shell"


# Who commands run as: the uid and name of a namespace sandbox's commands (bwrap.SANDBOX_UID). Fixed: an
# image's passwd may map any name to 0. The guest's passwd and group say so (vm_disks' host disk has the same).
GUEST_UID = GUEST_GID = 1000
GUEST_USER = "agent"
PASSWD = (
    "root:x:0:0:root:/root:/bin/sh\n"
    f"{GUEST_USER}:x:{GUEST_UID}:{GUEST_GID}:{GUEST_USER}:/workspace:/bin/bash\n"
    "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
)
GROUP = f"root:x:0:\n{GUEST_USER}:x:{GUEST_GID}:\nnogroup:x:65534:\n"


class GuestSandbox(ShellSandbox):
    """The shell and files inside the guest: bash as the sandbox user over /workspace."""

    backend = "vm"

    def __init__(self, config: SandboxConfig, uid: int, gid: int, replay: str = ""):
        super().__init__("guest", config, "/workspace", (uid, gid))
        self.uid, self.gid = uid, gid
        self._oom_seen = _oom_kills()  # OOM kills already reported
        self._start(replay)

    def _env(self) -> dict[str, str]:
        return {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": "/workspace",
            "LANG": "C.UTF-8",
            "TERM": "dumb",
            "PAGER": "cat",
            "GIT_PAGER": "cat",
            "USER": GUEST_USER,
            "TMPDIR": "/tmp",
        }

    def _drop(self) -> None:
        with open("/proc/self/oom_score_adj", "w") as f:  # the OOM killer's choice again, unlike the agent's
            f.write("0")
        os.setsid()
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)

    def _spawn_shell(self, replay: str) -> tuple[subprocess.Popen, ShellSession]:
        proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc", "--noediting", "-i"],
            executable=SHELL_PATH,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd="/workspace",
            env=self._env(),
            preexec_fn=self._drop,
        )
        for pipe in (proc.stdin, proc.stdout):  # each command reopens /dev/stdout, which only its owner may
            os.fchown(pipe.fileno(), self.uid, self.gid)

        def list_procs() -> set[int]:
            return _procs_of(self.uid) - {proc.pid}

        def exit_status() -> int:
            try:
                return proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                return 255

        session = ShellSession(
            proc.stdin.fileno(), proc.stdout.fileno(), proc.pid, list_procs, exit_status, self.config.output_limit_bytes
        )
        c = self.config
        ulimits = f"ulimit -S -c 0 -f {c.max_file_mb * 1024} -t {c.cpu_time_s} -u {c.max_processes}"
        session.wait_ready(setup_script(c, "/workspace", ulimits, replay))
        return proc, session

    def _spawn_oneoff(self, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd="/workspace",
            env=self._env(),
            preexec_fn=self._drop,
        )

    def _kill_processes(self) -> None:
        _kill_all_of(self.uid)

    def _oom_kills(self) -> int | None:
        return _oom_kills()

    def _make_children(self, n: int, replay: str) -> list[ShellSandbox]:
        raise NotImplementedError("a vm sandbox forks on the host, by snapshot")

    def _release(self) -> None:
        pass

    @property
    def info(self) -> SandboxInfo:
        return SandboxInfo(self.id, "vm", "/workspace", "ext4", {}, isolated=True)


def _oom_kills() -> int:
    """How many processes the guest kernel's OOM killer has killed since boot."""
    with open("/proc/vmstat") as f:
        for line in f:
            if line.startswith("oom_kill "):
                return int(line.split()[1])
    return 0


def _procs_of(uid: int) -> set[int]:
    found = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    found.add(int(name))
            except OSError:
                pass
    return found


def _kill_all_of(uid: int) -> None:
    """SIGKILL every process of `uid`: kill(-1) from a child that has become that user reaches all of them,
    wherever they forked to, and nothing else."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(65534)
            os.setuid(uid)
            for _ in range(3):
                os.kill(-1, signal.SIGKILL)
        except OSError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


class Agent:
    def __init__(self, port: int):
        self.port = port
        self.box: GuestSandbox | None = None
        self.uid, self.gid = GUEST_UID, GUEST_GID
        self._send_lock = threading.Lock()

    def serve(self) -> None:
        buf = b""
        while True:
            chunk = os.read(self.port, 1 << 20)
            if not chunk:  # no host connected: a virtio-serial port reads EOF until one is
                threading.Event().wait(0.01)
                continue
            buf += chunk
            while len(buf) >= 4:
                (size,) = struct.unpack(">I", buf[:4])
                if size > MAX_FRAME:
                    buf = b""
                    break
                if len(buf) < 4 + size:
                    break
                frame, buf = buf[4 : 4 + size], buf[4 + size :]
                try:
                    request = json.loads(frame)
                except ValueError:
                    continue
                threading.Thread(target=self.handle, args=(request,), daemon=True).start()

    def send(self, message: dict) -> None:
        data = json.dumps(message).encode()
        with self._send_lock:
            view = memoryview(struct.pack(">I", len(data)) + data)
            try:
                while view:
                    view = view[os.write(self.port, view) :]
            except OSError:  # the host went away (a snapshot is being taken, or it closed): the answer is lost
                pass

    def handle(self, request: dict) -> None:
        rid = request.get("id")
        try:
            result = getattr(self, "op_" + str(request.get("op")))(**request.get("args", {}))
            self.send({"id": rid, "ok": True, "result": result})
        except Exception as e:  # noqa: BLE001 - every error goes back to the host, named
            self.send({"id": rid, "ok": False, "error": type(e).__name__, "message": str(e)[:2000]})

    # -- ops ---------------------------------------------------------------------------------------

    def op_hello(self, entropy: str) -> dict:
        with open("/dev/urandom", "wb") as f:  # mixed in: children of one snapshot diverge from here on
            f.write(base64.b64decode(entropy))
        return {"started": self.box is not None}

    def op_start(self, config: dict) -> dict:
        config = SandboxConfig(**config)
        fd = os.open(WORKSPACE_DEVICE, os.O_RDONLY)
        try:  # BLKFLSBUF: what the template's kernel cached of its blank disk is not this sandbox's disk
            fcntl.ioctl(fd, 0x1261)
        finally:
            os.close(fd)
        subprocess.run(
            ["mount", "-t", "ext4", "-o", "nosuid,nodev", WORKSPACE_DEVICE, "/workspace"],
            check=True,
            capture_output=True,
        )
        try:
            os.rmdir("/workspace/lost+found")
        except OSError:
            pass
        for root, dirs, files in os.walk("/workspace"):
            for name in [root] + [os.path.join(root, n) for n in dirs + files]:
                os.lchown(name, self.uid, self.gid)
        # What commands can write into memory (/tmp, /dev/shm and, through the root's overlay, /var/tmp: 12%,
        # vm_image.INIT) stays within half the VM's: filled, it is "No space left on device", not a VM whose
        # agent and kernel starve, which no OOM kill can help (a file in memory belongs to no process).
        for point, size_mb in (
            ("/tmp", min(config.tmp_mb, config.memory_mb // 4)),
            ("/dev/shm", min(config.tmp_mb, config.memory_mb // 8)),
        ):
            subprocess.run(["mount", "-o", f"remount,size={max(size_mb, 1)}m", point], check=True, capture_output=True)
        self.box = GuestSandbox(config, self.uid, self.gid)
        return {}

    def _box(self) -> GuestSandbox:
        if self.box is None:
            raise RuntimeError("the sandbox has not been started")
        return self.box

    def op_exec(self, command: str, timeout_s: float | None = None) -> dict:
        return asdict(self._box().exec(command, timeout_s))

    def op_oneoff(self, argv: list[str], timeout_s: float | None = None) -> dict:
        return asdict(self._box().run_oneoff(argv, timeout_s))

    def op_read(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        return self._box().read_file(path, start_line, end_line)

    def op_write(self, path: str, content: str) -> None:
        self._box().write_file(path, base64.b64decode(content))

    def op_list(self, path: str = ".", recursive: bool = False) -> list:
        return [asdict(e) for e in self._box().list_dir(path, recursive)]

    def op_search(self, pattern: str, path: str = ".", max_matches: int = 200) -> list:
        return [asdict(m) for m in self._box().search(pattern, path, max_matches)]

    def op_alive(self) -> bool:
        return self._box().alive()


def _find_port() -> str:
    for entry in sorted(os.listdir("/sys/class/virtio-ports")):
        with open(f"/sys/class/virtio-ports/{entry}/name") as f:
            if f.read().strip() == PORT_NAME:
                return f"/dev/{entry}"
    raise RuntimeError(f"no virtio-serial port named {PORT_NAME}")


def _power_off() -> None:
    os.sync()
    ctypes.CDLL(None, use_errno=True).reboot(0x4321FEDC)  # LINUX_REBOOT_CMD_POWER_OFF
    os._exit(1)


def _mounts() -> None:
    for args in (
        ["-t", "proc", "-o", "nosuid,nodev,noexec", "proc", "/proc"],
        ["-t", "sysfs", "-o", "nosuid,nodev,noexec", "sys", "/sys"],
        ["-t", "tmpfs", "-o", "nosuid,nodev,mode=1777,size=512m", "tmp", "/tmp"],
    ):
        subprocess.run(["mount", *args], check=True)
    os.makedirs("/dev/shm", exist_ok=True)
    os.makedirs("/dev/pts", exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "nosuid,nodev,mode=1777,size=64m", "shm", "/dev/shm"], check=True)
    subprocess.run(
        ["mount", "-t", "devpts", "-o", "nosuid,noexec,newinstance,ptmxmode=0666", "pts", "/dev/pts"], check=False
    )
    for name, target in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):  # what udev would make; the shell's protocol needs them
        if not os.path.lexists(f"/dev/{name}"):
            os.symlink(target, f"/dev/{name}")
    with open("/proc/sys/kernel/dmesg_restrict", "w") as f:
        f.write("1")


def _lock_down() -> None:
    """What commands must not have: user namespaces (`unshare -r`, root of a namespace of their own), the agent
    or PID 1 as the OOM killer's choice (the VM is lost without them; the agent, forked from PID 1, inherits it
    and a command's processes get theirs back, GuestSandbox._drop), and a readable shell (SHELL_PATH)."""
    with open("/proc/sys/user/max_user_namespaces", "w") as f:
        f.write("0")
    with open("/proc/self/oom_score_adj", "w") as f:
        f.write("-1000")
    shutil.copyfile(shutil.which("bash") or "/bin/bash", SHELL_PATH)
    os.chmod(SHELL_PATH, 0o111)


def _write_identity(etc: str = "/etc") -> None:
    """The guest's passwd and group (PASSWD, GROUP) in place of the environment's, written in the root's
    overlay, never through what the image put there: a symlink /etc, passwd or group is replaced, not
    followed."""
    if os.path.islink(etc) or not os.path.isdir(etc):
        if os.path.lexists(etc):
            os.unlink(etc)
        os.mkdir(etc, 0o755)
    for name, text in (("passwd", PASSWD), ("group", GROUP)):
        path = os.path.join(etc, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        with open(path, "x") as f:  # O_EXCL: created here, never an existing file or a symlink's target
            f.write(text)
        os.chmod(path, 0o644)


def main() -> None:
    """PID 1: mount, fork the agent, reap orphans; when the agent dies the VM powers off."""
    if os.getpid() == 1:
        _mounts()
        _write_identity()
        _lock_down()
        agent_pid = os.fork()
        if agent_pid:
            while True:
                try:
                    pid, _ = os.wait()
                except ChildProcessError:
                    pid = agent_pid
                if pid == agent_pid:
                    _power_off()
    try:
        port = os.open(_find_port(), os.O_RDWR)
        agent = Agent(port)
        print("codefleet-agent: ready", flush=True)
        agent.serve()
    except BaseException as e:  # noqa: BLE001
        print(f"codefleet-agent: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        os._exit(1)
