"""The `namespace` backend: bubblewrap around an overlay workspace.

Each sandbox is one `bwrap` with its own user, mount, PID, IPC, UTS, network
and cgroup namespaces (loopback only), every capability dropped, running as
uid 1000 inside and, on the host, as a user who owns nothing: the system
user `codefleet-sandbox` when codefleet runs as root, the invoking user
otherwise (identity.py). bwrap itself runs as that user, unprivileged, so the
kernel's own permission checks guard every host file, device node and /proc
entry a command can reach, /proc/1/exe (the host's bwrap binary) included.
Where bwrap can (0.8 and later: --disable-userns) the sandbox cannot make
user namespaces of its own, so a command cannot become root with every
capability in a namespace it made itself (`unshare -r`).

The host filesystem is visible read-only and only in part: /usr (and the
/bin, /lib... links into it), /etc and the paths in `ro_binds`. /root,
/home, the host /tmp and the state directory (other sandboxes' workspaces)
are simply not there. /tmp, /var/tmp and /dev/shm are private tmpfs of
`tmp_mb` each; /workspace is the overlay (layers.py). The root holding these
mount points and /dev are bwrap's tmpfs, remounted read-only: the workspace,
/tmp, /var/tmp and /dev/shm are the only places a command can write. The
device nodes in /dev are root's, and as root they are the owner's own copies,
not the host's. bwrap, running as the sandbox user,
reaches what it binds from the state directory through the directories'
group (state.py); nothing there is readable to it but what it binds. What
bwrap is given, and what each owner makes once for it, is in bwrap.py.

The persistent shell talks to the host over two pipes that bwrap receives
as extra descriptors, not as its standard streams: bwrap's own PID 1 closes
them, so nothing in the sandbox reaches them through /proc/1/fd. The shell
runs from an execute-only copy of bash, so it is not dumpable: the commands
it runs cannot read its memory (the protocol's nonce) or its descriptors
through /proc. What stays possible is documented in docs/sandboxes/namespace.md.

bwrap's own PID 1 reaps zombies; its death takes the whole PID namespace
with it. bwrap is started with --die-with-parent from the spawner thread
(procs.py), under its owner's process name (state.py), and waits on a gate
until the host has moved it into the sandbox's cgroup: its first --args is an
empty pipe, which bwrap reads to its end before it makes any namespace, and
which the host closes once bwrap is in the cgroup. So no process of the
sandbox ever runs outside its limits, and the sandbox's cgroup namespace is
rooted at its own cgroup: /proc/self/cgroup reads `/`, not the owner's name.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor

from codefleet.sandbox import procs, seccomp
from codefleet.sandbox.base import WORKSPACE, SandboxConfig, SandboxDeadError, SandboxUnavailableError, check_env_names
from codefleet.sandbox.bwrap import (
    SHELL_PATH,
    bwrap_binary,
    bwrap_env,
    closed_ancestor,
    host_args,
    mount_view,
    options_fd,
    owner_files,
    unavailable_reason,
)
from codefleet.sandbox.bwrap_proc import bwrap_output, read_info, wait_or_kill
from codefleet.sandbox.cgroups import Cgroup
from codefleet.sandbox.environments import rootfs_of
from codefleet.sandbox.identity import Identity, host_identity
from codefleet.sandbox.layers import (
    MS_BIND,
    MS_NODEV,
    MS_NOSUID,
    MS_RDONLY,
    MS_REMOUNT,
    Workspace,
    choose_strategy,
    drop_layer,
    mount,
    remove_tree,
    umount,
)
from codefleet.sandbox.shell import ShellSession
from codefleet.sandbox.shellbox import ShellSandbox, setup_script
from codefleet.sandbox.state import Owner, owner_for
from codefleet.types import SandboxInfo

_FORK_THREADS = 4


class NamespaceSandbox(ShellSandbox):
    backend = "namespace"
    isolated = True
    environments = True
    host_binds = True

    def __init__(
        self,
        repo: str | None,
        config: SandboxConfig | None = None,
        *,
        _lowers: list[str] | None = None,
        _layers: list[str] | None = None,
        _replay: str = "",
    ):
        config = config or SandboxConfig()
        reason = unavailable_reason()
        if reason:
            raise SandboxUnavailableError(reason)
        if _lowers is None and repo is not None:  # checked before the owner tracks a half-made sandbox
            _check_repo(repo)
        self.ident: Identity = host_identity()
        check_env_names(config.env)
        _check_ro_binds(config.ro_binds)
        self.owner = owner_for(config.state_dir, self.ident.gid if self.ident.switches else None)
        files = owner_files(self.owner, self.ident)
        self.owner.track(self)
        sandbox_id = "sb-" + os.urandom(5).hex()
        self.dir = os.path.join(self.owner.dir, "sb", sandbox_id)
        os.makedirs(self.dir)
        if _lowers is None:
            _lowers = [os.path.abspath(repo) if repo else _empty_dir(self.owner)]
        self._layers = list(_layers or [])
        for layer in self._layers:
            _layer_refs.acquire(layer)
        self.workspace = Workspace(self.dir, _lowers, choose_strategy(), config.workspace_mb, self.ident)
        super().__init__(
            sandbox_id,
            config,
            self.workspace.merged,
            (self.ident.uid, self.ident.gid) if self.workspace.ident else None,
        )
        self.cgroup: Cgroup | None = None
        self._pids: list[tuple[int, int | None]] = []  # (outer bwrap, sandbox init) host pids
        self._init_pid = 0
        self._ro_stages: list[str] = []  # read-only bind mounts in self.dir (`_stage_ro_binds`)
        try:
            ro_sources = self._stage_ro_binds(config)
            self.workspace.mount()
            view = userland = None
            if self.workspace.strategy == "overlay":  # root: in the workspace's tmpfs, unmounted (or reaped) with it
                view = self._mount_view(files.directory, "view")
                rootfs = None if config.environment is None else rootfs_of(config.environment)
                if rootfs is not None and os.path.isdir(rootfs):  # else host_args says what is wrong with it
                    userland = self._mount_view(rootfs, "userland")
            self.cgroup = self.owner.cgroups.create(
                sandbox_id, config.memory_mb, config.max_processes, config.cpu_cores
            )
            # bwrap's options (through a memfd: see bwrap.py); last, once every mount point exists, the sandbox's
            # own root and /dev become read-only
            self._options = host_args(config, files, ro_sources, view, userland) + [
                "--bind",
                self.workspace.merged,
                WORKSPACE,
                "--remount-ro",
                "/dev",
                "--remount-ro",
                "/",
                "--chdir",
                WORKSPACE,
            ]
            self._start(_replay)
        except BaseException:
            self._closed = True
            self._kill_processes()
            self._release()
            raise

    # -- spawning --------------------------------------------------------------------

    def _ulimits(self) -> str:
        c = self.config
        parts = ["-c 0", f"-f {c.max_file_mb * 1024}", f"-t {c.cpu_time_s}", "-n 4096"]
        if self.cgroup is None:
            parts += [f"-u {c.max_processes}", f"-v {c.memory_mb * 1024}"]
        return "ulimit -S -H " + " ".join(parts)

    def _spawn(
        self, argv: list[str], stdout: int, stderr: int, keep_fds: tuple[int, ...] = ()
    ) -> tuple[subprocess.Popen, int]:
        """Start bwrap + argv at its gate, move it into the cgroup, open the gate; (proc, init pid).
        `keep_fds` reach argv (not bwrap's PID 1) with their numbers; the caller closes them."""
        gate_r, gate_w = os.pipe2(os.O_CLOEXEC)
        info_r, info_w = os.pipe2(os.O_CLOEXEC)
        options = options_fd(self._options)
        args = [self.owner.process_name, "--args", str(gate_r), "--args", str(options), "--info-fd", str(info_w)]
        pass_fds = [gate_r, options, info_w]
        seccomp_r = seccomp.filter_fd()
        if seccomp_r is not None:
            args += ["--seccomp", str(seccomp_r)]
            pass_fds.append(seccomp_r)
        try:
            # bwrap's own environment stays the environment of the sandbox's PID 1, which any command
            # reads in /proc/1/environ (--clearenv clears only the command's): the host's is not passed.
            proc = procs.spawner.popen(
                args + argv,
                executable=bwrap_binary(),
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                pass_fds=pass_fds + list(keep_fds),
                start_new_session=True,
                env=bwrap_env(),
                cwd="/",
                **self.ident.popen_kwargs(),
            )
        except BaseException:
            os.close(gate_w)
            os.close(info_r)
            raise
        finally:
            for fd in pass_fds:
                os.close(fd)
        try:
            try:
                if self.cgroup is not None:
                    self.cgroup.add(proc.pid)
            except ProcessLookupError:  # bwrap gave up before it read its options
                raise self._start_failure(proc) from None
            finally:
                os.close(gate_w)  # the gate opens: bwrap reads its options and makes the sandbox in its cgroup
            info = read_info(info_r)
            if info is None:
                raise self._start_failure(proc)
        except BaseException:
            proc.kill()
            proc.wait()
            if proc.stdout:
                proc.stdout.close()
            raise
        finally:
            os.close(info_r)
        return proc, info["child-pid"]

    def _start_failure(self, proc: subprocess.Popen) -> SandboxUnavailableError:
        """The error for a bwrap that exited while setting the sandbox up, in bwrap's words.
        A one-off's output holds them; a shell's stderr is discarded, so the set-up is
        tried once more with `true` to hear them."""
        wait_or_kill(proc)
        said = bwrap_output(proc)
        if not said:
            options = options_fd(self._options)
            try:
                said = (
                    subprocess.run(
                        [self.owner.process_name, "--args", str(options), "true"],
                        executable=bwrap_binary(),
                        stdin=subprocess.DEVNULL,
                        capture_output=True,
                        timeout=20,
                        pass_fds=[options],
                        env=bwrap_env(),
                        cwd="/",
                        **self.ident.popen_kwargs(),
                    )
                    .stderr.decode(errors="replace")
                    .strip()
                )
            except subprocess.TimeoutExpired:
                said = ""
            finally:
                os.close(options)
        said = said[:300] or f"exit status {proc.returncode}"
        return SandboxUnavailableError(
            f"bwrap failed to start the sandbox ({said}); check the host paths the "
            "sandbox config names (ro_binds, state_dir)"
        )

    def _spawn_shell(self, replay: str) -> tuple[subprocess.Popen, ShellSession]:
        commands_r, commands_w = os.pipe2(os.O_CLOEXEC)
        output_r, output_w = os.pipe2(os.O_CLOEXEC)
        if self.ident.switches:  # the shell reopens its output (>/dev/stdout): the pipe must be its user's
            os.fchown(output_w, self.ident.uid, self.ident.gid)
        # A readable bash puts the pipes on its own stdin and stdout and becomes the execute-only one.
        shell = (
            f"exec -a bash {SHELL_PATH} --noprofile --norc --noediting -i <&{commands_r} >&{output_w} "
            f"{commands_r}<&- {output_w}>&-"
        )
        try:
            proc, init_pid = self._spawn(
                ["bash", "--noprofile", "--norc", "-c", shell],
                subprocess.DEVNULL,
                subprocess.DEVNULL,
                (commands_r, output_w),
            )
        except BaseException:
            os.close(commands_w)
            os.close(output_r)
            raise
        finally:
            os.close(commands_r)
            os.close(output_w)
        # The host's ends of the protocol pipes, closed with the process like its own streams would be.
        proc.stdin, proc.stdout = open(commands_w, "wb", buffering=0), open(output_r, "rb", buffering=0)  # noqa: SIM115
        self._init_pid = init_pid
        self._pids = [(proc.pid, procs.start_time(proc.pid)), (init_pid, procs.start_time(init_pid))]
        with open(os.path.join(self.dir, "pids.json"), "w") as f:
            json.dump(self._pids, f)
        shell_pid_box = [0]

        def list_procs() -> set[int]:
            return procs.descendants(init_pid) - {shell_pid_box[0]}

        def exit_status() -> int:
            """The shell's status as bash reports one: 128 + n for death by signal n."""
            try:
                code = proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                return 255
            return 128 - code if code < 0 else code

        # Until the shell is known, the sandbox's init stands in for it, never pid 0: a set-up that outlasts
        # wait_ready's timeout is interrupted with SIGINT to the shell, and os.kill(0, SIGINT) interrupted
        # codefleet's own process group. The init ignores SIGINT (a PID namespace's init without a handler
        # does), and SIGKILL, the last resort, ends the sandbox.
        session = ShellSession(
            proc.stdin.fileno(), proc.stdout.fileno(), init_pid, list_procs, exit_status, self.config.output_limit_bytes
        )
        try:
            session.wait_ready(setup_script(self.config, WORKSPACE, self._ulimits(), replay))
        except SandboxDeadError:
            if proc.poll() is None:
                raise
            error = self._start_failure(proc)  # bwrap may fail its set-up after the cgroup took it
            proc.stdin.close()
            proc.stdout.close()
            raise error from None
        kids = procs.children(init_pid)
        session.shell_pid = shell_pid_box[0] = kids[0] if kids else init_pid
        return proc, session

    def _spawn_oneoff(self, argv: list[str]) -> subprocess.Popen:
        proc, _ = self._spawn(argv, subprocess.PIPE, subprocess.STDOUT)
        return proc

    # -- faults ----------------------------------------------------------------------

    def _oom_kills(self) -> int | None:
        return None if self.cgroup is None else self.cgroup.oom_kills()

    # Killing a sandbox kills its init (bwrap's PID 1 inside) first: the whole PID
    # namespace dies with it, and the outer bwrap, which reaps it, then exits by
    # itself and is reaped here. Killing the outer bwrap first would orphan init
    # to the host's PID 1, to linger as a zombie until that one reaps it.

    def _kill_oneoff(self, proc: subprocess.Popen) -> None:
        for pid in procs.children(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        wait_or_kill(proc)

    def _kill_processes(self) -> None:
        if len(self._pids) == 2 and self._proc is not None:
            procs.kill_if_same(*self._pids[1])
            wait_or_kill(self._proc)
        for pid, started in self._pids:
            procs.kill_if_same(pid, started)
        if self.cgroup is not None:
            self.cgroup.kill_all()

    # -- fork and release -------------------------------------------------------------

    def _make_children(self, n: int, replay: str) -> list[ShellSandbox]:
        layer = os.path.join(self.owner.dir, "layers", "l" + os.urandom(4).hex())
        if self.workspace.freeze(layer):
            lowers = [layer] if self.workspace.strategy == "copy" else [layer] + self.workspace.lowers
            layers = [layer] + self._layers
        else:
            lowers, layers = self.workspace.lowers, self._layers
        _layer_refs.acquire(layer)  # held while the children start, so a failure cleans it up
        children: list[ShellSandbox] = []
        failure: BaseException | None = None
        try:
            # Children start in parallel: most of a start is waiting on the kernel (namespaces, mounts).
            with ThreadPoolExecutor(min(n, _FORK_THREADS)) as pool:
                futures = [
                    pool.submit(NamespaceSandbox, None, self.config, _lowers=lowers, _layers=layers, _replay=replay)
                    for _ in range(n)
                ]
                for future in futures:
                    try:
                        children.append(future.result())
                    except BaseException as e:
                        failure = failure or e
            if failure is not None:
                for child in children:
                    child.close()
                raise failure
        finally:
            _layer_refs.release(layer)
        return children

    def _stage_ro_binds(self, config: SandboxConfig) -> dict[str, str]:
        """Where bwrap binds each `ro_binds` path from. The sandbox user opens it there, so a path it may not
        walk to (a virtual environment under /root) is bound first, read-only and by root, into this sandbox's
        directory, which it can reach; `_release` unmounts it. Only what `ro_binds` names becomes visible."""
        sources = {}
        for i, path in enumerate(map(os.path.abspath, config.ro_binds)):
            if closed_ancestor(path, self.ident) is None:
                continue
            stage = os.path.join(self.dir, "ro", str(i))
            os.makedirs(os.path.dirname(stage), mode=0o755, exist_ok=True)
            if os.path.isdir(path):
                os.mkdir(stage, 0o755)
            else:
                open(stage, "x").close()
            self._ro_stages.append(stage)
            mount(path, stage, "", "", MS_BIND)
            mount("", stage, "", "", MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
            sources[path] = stage
        return sources

    def _mount_view(self, directory: str, name: str) -> str:
        """bwrap.mount_view of `directory` at the workspace's rw/`name`; its path."""
        at = os.path.join(self.workspace.rw, name)
        os.mkdir(at, 0o755)
        mount_view(directory, _empty_dir(self.owner), at)
        return at

    def _release(self) -> None:
        for stage in self._ro_stages:  # before remove_tree, which must not walk into them
            umount(stage)
        try:
            self.workspace.unmount()
        finally:
            if self.cgroup is not None:
                self.cgroup.remove()
            remove_tree(self.dir)
            for layer in self._layers:
                _layer_refs.release(layer)
            self._layers = []
            self.owner.untrack(self)

    @property
    def info(self) -> SandboxInfo:
        limits = {
            "memory_mb": str(self.config.memory_mb),
            "max_processes": str(self.config.max_processes),
            "cpu_cores": str(self.config.cpu_cores),
            "cpu_time_s": str(self.config.cpu_time_s),
            "workspace_mb": str(self.config.workspace_mb),
            "enforced_by": f"cgroup {self.cgroup.mode}" if self.cgroup else "rlimits",
            "seccomp": "on" if seccomp.filter_bytes() is not None else "off",
            "host_user": f"{self.ident.name} (uid {self.ident.uid})",
        }
        return SandboxInfo(self.id, self.backend, WORKSPACE, self.workspace.strategy, limits, isolated=True)


def _check_repo(repo: object) -> None:
    """Refuse a repository that is not a directory path, in one sentence."""
    if not isinstance(repo, (str, os.PathLike)):
        raise TypeError(
            f"the repository must be a directory path, not {type(repo).__name__}; call create_sandbox(repo, config)"
        )
    if not os.path.isdir(repo):
        raise FileNotFoundError(f"repository directory {repo!r} does not exist")


def _check_ro_binds(ro_binds: list[str]) -> None:
    """Refuse an `ro_binds` path that does not exist on this host, naming the first."""
    missing = [path for path in ro_binds if not os.path.exists(path)]
    if missing:
        raise FileNotFoundError(
            f"SandboxConfig.ro_binds names {missing[0]!r}, which does not exist on this host; "
            "create it or remove it from ro_binds"
        )


def _empty_dir(owner: Owner) -> str:
    path = os.path.join(owner.dir, "empty")
    os.makedirs(path, exist_ok=True)
    return path


class _LayerRefs:
    """Frozen fork layers are shared by sibling sandboxes; the last one out deletes it."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, layer: str) -> None:
        with self._lock:
            self._counts[layer] = self._counts.get(layer, 0) + 1

    def release(self, layer: str) -> None:
        with self._lock:
            self._counts[layer] -= 1
            if self._counts[layer] > 0:
                return
            del self._counts[layer]
        drop_layer(layer)


_layer_refs = _LayerRefs()
