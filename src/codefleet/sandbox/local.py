"""The `local` backend: NO ISOLATION. A plain bash in a temporary copy.

For machines without user namespaces (some containers, macOS CI). Commands
run as the calling user with full access to the host, its network and its
files; only the working directory is a copy. Never the default where the
namespace backend works. rlimits bound processes, memory and CPU time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading

from codefleet.sandbox import procs
from codefleet.sandbox.base import SandboxConfig, SandboxUnavailableError, check_env_names
from codefleet.sandbox.layers import copy_layer, remove_tree
from codefleet.sandbox.shell import ShellSession
from codefleet.sandbox.shellbox import ShellSandbox, setup_script
from codefleet.sandbox.state import owner_for
from codefleet.types import SandboxInfo

_said = threading.Event()


def _say_not_isolated() -> None:
    """One line on stderr, the first time this process makes a local sandbox."""
    if not _said.is_set():
        _said.set()
        print(
            "codefleet: backend 'local': sandboxed commands run WITHOUT isolation, as this user on this host",
            file=sys.stderr,
            flush=True,
        )


class LocalSandbox(ShellSandbox):
    backend = "local"
    isolated = False  # commands run as this user on this host
    environments = False  # the host's own userland only
    host_binds = True

    def __init__(
        self, repo: str | None, config: SandboxConfig | None = None, *, _copy_from: str | None = None, _replay: str = ""
    ):
        config = config or SandboxConfig()
        if config.environment is not None:  # backend 'auto' on a host without namespaces: never the host instead
            raise SandboxUnavailableError(
                "SandboxConfig.environment needs namespace sandboxes, which this host "
                "cannot make; install bubblewrap and enable user namespaces"
            )
        _say_not_isolated()
        check_env_names(config.env)
        source = _copy_from or repo
        if source is not None and not os.path.isdir(source):
            raise FileNotFoundError(f"repository directory {source!r} does not exist")
        self.owner = owner = owner_for(config.state_dir)
        sandbox_id = "lo-" + os.urandom(5).hex()
        self.dir = os.path.join(owner.dir, "sb", sandbox_id)
        workspace = os.path.join(self.dir, "workspace")
        os.makedirs(self.dir)
        super().__init__(sandbox_id, config, workspace)
        self.workspace = workspace
        owner.track(self)
        try:
            if source:
                copy_layer(source, workspace)
            else:
                os.makedirs(workspace)
            if _copy_from and _replay:  # the parent's shell state names the parent's workspace
                _replay = _replay.replace(_copy_from, workspace)
            self._start(_replay)
        except BaseException:
            self.close()
            raise

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "HOME", "USER")}
        env.update(TERM="dumb", PAGER="cat", GIT_PAGER="cat")
        return env

    def _spawn_shell(self, replay: str) -> tuple[subprocess.Popen, ShellSession]:
        proc = procs.spawner.popen(
            ["bash", "--noprofile", "--norc", "--noediting", "-i"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            cwd=self.workspace,
            env=self._env(),
            start_new_session=True,
        )

        def list_procs() -> set[int]:
            return procs.descendants(proc.pid)

        def exit_status() -> int:
            try:
                return proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                return 255

        session = ShellSession(
            proc.stdin.fileno(), proc.stdout.fileno(), proc.pid, list_procs, exit_status, self.config.output_limit_bytes
        )
        c = self.config
        ulimits = (
            f"ulimit -S -c 0 -f {c.max_file_mb * 1024} -t {c.cpu_time_s} -u {c.max_processes} -v {c.memory_mb * 1024}"
        )
        session.wait_ready(setup_script(c, self.workspace, ulimits, replay))
        return proc, session

    def _spawn_oneoff(self, argv: list[str]) -> subprocess.Popen:
        return procs.spawner.popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=self.workspace,
            env=self._env(),
            start_new_session=True,
        )

    def _kill_processes(self) -> None:
        if self._proc is None:
            return
        for pid in procs.descendants(self._proc.pid) | {self._proc.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)  # background jobs that were re-parented

    def _make_children(self, n: int, replay: str) -> list[ShellSandbox]:
        children: list[ShellSandbox] = []
        try:
            for _ in range(n):
                children.append(LocalSandbox(None, self.config, _copy_from=self.workspace, _replay=replay))
        except BaseException:
            for child in children:
                child.close()
            raise
        return children

    def _release(self) -> None:
        remove_tree(self.dir)
        self.owner.untrack(self)

    @property
    def info(self) -> SandboxInfo:
        c = self.config
        limits = {
            "memory_mb": str(c.memory_mb),
            "max_processes": str(c.max_processes),
            "cpu_time_s": str(c.cpu_time_s),
            "enforced_by": "rlimits",
        }
        return SandboxInfo(self.id, self.backend, self.workspace, "copy", limits, isolated=False)
