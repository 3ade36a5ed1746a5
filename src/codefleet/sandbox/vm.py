"""The `vm` backend: each sandbox is a QEMU microVM with its own kernel, restored from a snapshot.

Layout of one VM (vm_image.py and vm_disks.py build the pieces): QEMU's `microvm` machine, no network
device, the guest kernel booted directly (PVH), the environment as a read-only erofs disk (`/dev/vda`) under a
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
import contextlib
import fcntl
import hashlib
import json
import math
import os
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from codefleet.sandbox import vm_disks, vm_image
from codefleet.sandbox.base import (
    SandboxClosedError,
    SandboxConfig,
    SandboxDeadError,
    SandboxError,
    SandboxUnavailableError,
    check_env_names,
)
from codefleet.sandbox.identity import SANDBOX_USER
from codefleet.sandbox.state import owner_for
from codefleet.sandbox.vm_answers import MalformedAnswerError, answer_of
from codefleet.sandbox.vm_qemu import AgentLink, Qemu, accel, qemu_binary, user_exists
from codefleet.types import ExecResult, FileEntry, SandboxInfo, SearchMatch

FORK_PARALLEL = 8  # children of one fork restored at once
RPC_GRACE_S = 60.0  # beyond a command's own timeout, how long the host waits for the agent's answer


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


# -- templates ----------------------------------------------------------------------------------------


def template_dir() -> str:
    """Snapshots live on tmpfs: their RAM files are mapped by every VM restored from them."""
    return os.environ.get("CODEFLEET_VM_TEMPLATES") or f"/dev/shm/codefleet-vm-{os.getuid()}"


class Template:
    """A booted, idle VM saved once per (kernel, initramfs, environment disk, memory, vCPUs, disk size)."""

    def __init__(self, env_disk: str, memory_mb: int, vcpus: int, workspace_mb: int):
        self.env_disk, self.memory_mb, self.vcpus, self.workspace_mb = env_disk, memory_mb, vcpus, workspace_mb
        key = json.dumps(
            [vm_image.guest_kernel(), vm_image.initramfs(), env_disk, memory_mb, vcpus, workspace_mb, accel()]
        )
        self.dir = os.path.join(template_dir(), hashlib.sha256(key.encode()).hexdigest()[:20])
        self.memory = os.path.join(self.dir, "memory")
        self.state = os.path.join(self.dir, "state")
        self.boot_s: float | None = None

    def ensure(self, boot_timeout_s: float) -> Template:
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
        with contextlib.suppress(OSError):
            os.utime(self.dir)

    def _build(self, boot_timeout_s: float) -> None:
        building = self.dir + ".part"
        shutil.rmtree(building, ignore_errors=True)
        os.makedirs(building, mode=0o700)
        blank = os.path.join(building, "blank.img")
        with open(blank, "wb") as f:
            f.truncate(self.workspace_mb << 20)
        started = time.perf_counter()
        vm = Qemu(
            building,
            memory_mb=self.memory_mb,
            vcpus=self.vcpus,
            env_disk=self.env_disk,
            workspace=blank,
            memory=f"memory-backend-file,id=mem,size={self.memory_mb}M,"
            f"mem-path={os.path.join(building, 'memory')},share=on",
            console=os.path.join(building, "console.log"),
        )
        try:
            link = AgentLink(vm.connect_port(time.monotonic() + 30))
            try:
                link.call("hello", boot_timeout_s, entropy=base64.b64encode(os.urandom(64)).decode())
            except SandboxDeadError as e:
                time.sleep(0.2)  # QEMU's own last words, if it is exiting
                raise SandboxUnavailableError(
                    f"the VM did not boot to its agent: {e}; QEMU: {vm.stderr()}; its "
                    f"console: {_tail(os.path.join(building, 'console.log'))}"
                ) from None
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
    isolated = True
    environments = True  # as a read-only disk
    host_binds = False  # it sees only its environment's disk and the workspace

    def __init__(self, repo: str | None, config: SandboxConfig | None = None, *, _fork: tuple | None = None):
        config = config or SandboxConfig()
        check_env_names(config.env)
        if repo is not None and not isinstance(repo, (str, os.PathLike)):
            raise TypeError(
                f"the repository must be a directory path, not {type(repo).__name__}; call create_sandbox(repo, config)"
            )
        if repo is not None and not os.path.isdir(repo):
            raise FileNotFoundError(f"repository directory {repo!r} does not exist")
        if config.ro_binds:
            raise ValueError(
                f"SandboxConfig.ro_binds {config.ro_binds} cannot reach a vm sandbox, which sees only its "
                "environment's disk and the workspace; give those files as an environment "
                "(docs/environments.md) or use backend 'namespace'"
            )
        if os.geteuid() == 0 and not user_exists(SANDBOX_USER):
            raise SandboxUnavailableError(
                f"as root, vm sandboxes run QEMU as the user {SANDBOX_USER}, which does not "
                "exist; create it with scripts/setup.sh (docs/sandboxes/namespace.md)"
            )
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
        env_disk = vm_disks.environment_disk(rootfs)
        vm_disks.workspace_disk(self.disk, repo, c.workspace_mb)
        template = Template(env_disk, c.memory_mb, self.vcpus, c.workspace_mb).ensure(self._boot_timeout())
        template.used()
        fd = os.open(template.state, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._launch(
                env_disk,
                f"memory-backend-file,id=mem,size={c.memory_mb}M,mem-path={template.memory},share=off",
                fd,
                ignore_shared=True,
            )
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
        self.vm = Qemu(
            self.dir,
            memory_mb=self.config.memory_mb,
            vcpus=self.vcpus,
            env_disk=env_disk,
            workspace=self.disk,
            memory=memory,
            incoming_fd=incoming_fd,
        )
        self.vm.incoming(incoming_fd, ignore_shared)
        with open(os.path.join(self.dir, "pids.json"), "w") as f:  # for the reaper (state.py)
            json.dump([[self.vm.proc.pid, self.vm.started]], f)
        self.link = AgentLink(self.vm.connect_port(time.monotonic() + 30))
        self._call("hello", self._boot_timeout(), entropy=base64.b64encode(os.urandom(64)).decode())

    def _call(self, op: str, wait_s: float, **args: object) -> object:
        """The agent's answer to `op`, checked and as the host's types (`answer_of`). A malformed answer breaks
        the link: this and every later call raise SandboxDeadError, and alive() is False."""
        if self._closed:
            raise SandboxClosedError(f"sandbox {self.id} is closed; create a new one")
        try:
            return answer_of(op, self.link.call(op, wait_s, **args), args, self.config.output_limit_bytes)
        except MalformedAnswerError as e:
            self.link.fail(str(e))
            raise MalformedAnswerError(f"sandbox {self.id}: {e}; close it and create a new sandbox") from None
        except SandboxDeadError as e:
            if self._closing:
                raise SandboxClosedError(f"sandbox {self.id} was closed while it ran {op!r}") from None
            raise SandboxDeadError(f"sandbox {self.id}: {e}; close it and create a new sandbox") from None

    # -- the contract ----------------------------------------------------------------------------------

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        with self._lock:
            return self._call("exec", timeout_s + RPC_GRACE_S, command=command, timeout_s=timeout_s)

    def run_oneoff(self, argv: list[str], timeout_s: float | None = None) -> ExecResult:
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        return self._call("oneoff", timeout_s + RPC_GRACE_S, argv=list(argv), timeout_s=timeout_s)

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        return self._call("read", RPC_GRACE_S, path=path, start_line=start_line, end_line=end_line)

    def write_file(self, path: str, content: str | bytes) -> None:
        data = content.encode() if isinstance(content, str) else bytes(content)
        self._call("write", RPC_GRACE_S, path=path, content=base64.b64encode(data).decode())

    def list_dir(self, path: str = ".", recursive: bool = False) -> list[FileEntry]:
        return self._call("list", RPC_GRACE_S, path=path, recursive=recursive)

    def search(self, pattern: str, path: str = ".", max_matches: int = 200) -> list[SearchMatch]:
        return self._call("search", RPC_GRACE_S + 30, pattern=pattern, path=path, max_matches=max_matches)

    def alive(self) -> bool:
        if self._closed or self.vm is None or self.vm.proc.poll() is not None or self.link.broken:
            return False
        try:
            return self._call("alive", 10)
        except SandboxError:
            return False

    def fork(self, n: int) -> list[VMSandbox]:
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
                    made = [
                        pool.submit(VMSandbox, None, self.config, _fork=(self.env_disk, stream, self.disk))
                        for _ in range(n)
                    ]
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
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(stream)
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
        limits = {
            "memory_mb": str(c.memory_mb),
            "vcpus": str(self.vcpus),
            "workspace_mb": str(c.workspace_mb),
            "max_processes": str(c.max_processes),
            "cpu_time_s": str(c.cpu_time_s),
            "enforced_by": "vm",
            "accel": self.vm.accel if self.vm else accel(),
        }
        return SandboxInfo(self.id, self.backend, "/workspace", "ext4", limits, isolated=True)

    def __enter__(self) -> VMSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<VMSandbox {self.id} {'closed' if self._closed else 'open'}>"


def _config_dict(config: SandboxConfig) -> dict:
    return {
        k: getattr(config, k)
        for k in (
            "timeout_s",
            "output_limit_bytes",
            "memory_mb",
            "max_processes",
            "cpu_cores",
            "cpu_time_s",
            "workspace_mb",
            "tmp_mb",
            "max_file_mb",
            "env",
        )
    }


def _copy_sparse(src: str, dst: str) -> None:
    subprocess.run(["cp", "--sparse=always", "--reflink=auto", src, dst], check=True, capture_output=True)
