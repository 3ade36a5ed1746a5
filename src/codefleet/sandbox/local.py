"""The `local` backend: NO ISOLATION. A plain bash in a temporary copy.

For machines without user namespaces (some containers, macOS CI). Commands
run as the calling user with full access to the host, its network and its
files; only the working directory is a copy. Never the default where the
namespace backend works. rlimits bound processes, memory and CPU time.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import warnings

from codefleet.sandbox import procs
from codefleet.sandbox.base import SandboxConfig
from codefleet.sandbox.shell import ShellSession
from codefleet.sandbox.shellbox import ShellSandbox, setup_script
from codefleet.sandbox.state import owner_for
from codefleet.types import SandboxInfo


class LocalSandbox(ShellSandbox):
    backend = "local"

    def __init__(self, repo: str | None, config: SandboxConfig | None = None, *, _copy_from: str | None = None,
                 _replay: str = ""):
        warnings.warn("codefleet local sandbox: commands run WITHOUT isolation on this host", stacklevel=2)
        config = config or SandboxConfig()
        owner = owner_for(config.state_dir)
        owner.track(self)
        sandbox_id = "lo-" + os.urandom(5).hex()
        self.dir = os.path.join(owner.dir, "sb", sandbox_id)
        workspace = os.path.join(self.dir, "workspace")
        source = _copy_from or repo
        if source is not None and not os.path.isdir(source):
            raise FileNotFoundError(f"repository directory {source!r} does not exist")
        os.makedirs(self.dir)
        if source:
            shutil.copytree(source, workspace, symlinks=True)
        else:
            os.makedirs(workspace)
        super().__init__(sandbox_id, config, workspace)
        self.workspace = workspace
        try:
            self._start(_replay)
        except BaseException:
            self.close()
            raise

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "HOME", "USER")}
        env.update(TERM="dumb", PAGER="cat", GIT_PAGER="cat")
        return env

    def _spawn_shell(self, replay: str) -> tuple[subprocess.Popen, ShellSession]:
        proc = procs.spawner.popen(["bash", "--noprofile", "--norc", "-i"], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=self.workspace,
                                   env=self._env(), start_new_session=True)

        def list_procs() -> set[int]:
            return procs.descendants(proc.pid)

        def exit_status() -> int:
            try:
                return proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                return 255

        session = ShellSession(proc.stdin.fileno(), proc.stdout.fileno(), proc.pid, list_procs, exit_status,
                               self.config.output_limit_bytes)
        c = self.config
        ulimits = (f"ulimit -S -c 0 -f {c.max_file_mb * 1024} -t {c.cpu_time_s} -u {c.max_processes} "
                   f"-v {c.memory_mb * 1024}")
        session.wait_ready(setup_script(c, self.workspace, ulimits, replay))
        return proc, session

    def _spawn_oneoff(self, argv: list[str]) -> subprocess.Popen:
        return procs.spawner.popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, cwd=self.workspace, env=self._env(),
                                   start_new_session=True)

    def _kill_processes(self) -> None:
        if self._proc is None:
            return
        for pid in procs.descendants(self._proc.pid) | {self._proc.pid}:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)  # background jobs that were re-parented
        except (ProcessLookupError, PermissionError):
            pass

    def _make_children(self, n: int, replay: str) -> list[ShellSandbox]:
        replay = replay.replace(self.workspace, "{WORKSPACE}")
        children: list[ShellSandbox] = []
        for _ in range(n):
            child = LocalSandbox(None, self.config, _copy_from=self.workspace)
            if replay:
                child.exec(replay.replace("{WORKSPACE}", child.workspace))
            children.append(child)
        return children

    def _release(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    @property
    def info(self) -> SandboxInfo:
        c = self.config
        limits = {"memory_mb": str(c.memory_mb), "max_processes": str(c.max_processes),
                  "cpu_time_s": str(c.cpu_time_s), "enforced_by": "rlimits"}
        return SandboxInfo(self.id, self.backend, self.workspace, "copy", limits, isolated=False)
