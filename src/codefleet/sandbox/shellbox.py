"""What every shell-backed sandbox shares: exec with shell recovery, the file
API, search, fork bookkeeping and close. Backends (namespace.py, local.py)
only say how to start a shell, how to start a one-off process, how to make a
child workspace and how to tear down.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import replace

from codefleet.sandbox.base import SandboxClosedError, SandboxConfig, SandboxDeadError, check_env_names
from codefleet.sandbox.files import WorkspaceFiles
from codefleet.sandbox.shell import OutputCollector, ShellSession, shell_quote
from codefleet.types import ExecResult, FileEntry, SandboxInfo, SearchMatch


def setup_script(config: SandboxConfig, workdir: str, ulimits: str, replay: str = "") -> str:
    """The first lines every fresh shell runs. `exit` is wrapped because an
    interactive bash announces "exit" on stderr, which commands see merged."""
    lines = [
        "set +H +o history; unset HISTFILE PROMPT_COMMAND; PS1=''; PS2=''; PS0=''",
        'exit() { builtin exit "$@" 2>/dev/null; }; logout() { builtin exit "$@" 2>/dev/null; }',
        ulimits,
        f"cd {bash_literal(workdir)}",
    ]
    check_env_names(config.env)  # again: the dict may have changed since the config was made
    lines += [f"export {k}={bash_literal(v)}" for k, v in config.env.items()]
    if replay:
        lines.append(replay)
    return "\n".join(line for line in lines if line)


def bash_literal(text: str) -> str:
    """`text` as one bash word made of printable characters: '...' or, when it
    holds control characters, $'...' with escapes."""
    if text.isprintable():
        return shell_quote(text)
    out = []
    for ch in text:
        if ch in "\\'":
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) < 0x80:
            out.append(f"\\x{ord(ch):02x}")
        elif ord(ch) < 0x10000:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return "$'" + "".join(out) + "'"


def collect_until_exit(proc: subprocess.Popen, limit_bytes: int, deadline: float) -> tuple[OutputCollector, bool]:
    """Read a one-off process's merged output until it ends; (output, finished in time).

    It ends at EOF, or when the process has exited but something it left running
    in the background still holds the pipe: then the pipe is drained and the
    process group (those leftovers) is killed, instead of waiting for the deadline."""
    out = OutputCollector(limit_bytes, b"\x00never\x00")
    fd = proc.stdout.fileno()
    os.set_blocking(fd, False)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        left_ms = (deadline - time.perf_counter()) * 1000
        if left_ms <= 0:
            return out, False
        if poller.poll(min(max(int(left_ms), 1), 50)):
            try:
                chunk = os.read(fd, 1 << 20)
            except BlockingIOError:
                continue
            if not chunk:
                return out, True
            out.feed(chunk)
        elif _exited(proc):
            with contextlib.suppress(ProcessLookupError, PermissionError):  # a zombie: its group id is not reused yet
                os.killpg(proc.pid, signal.SIGKILL)
            while time.perf_counter() < deadline:  # what it wrote before it exited
                try:
                    chunk = os.read(fd, 1 << 20)
                except BlockingIOError:
                    break
                if not chunk:
                    break
                out.feed(chunk)
            return out, True


def _exited(proc: subprocess.Popen) -> bool:
    """True once `proc` has exited, without reaping it."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


class ShellSandbox(ABC):
    """A sandbox driven through one persistent shell. Thread-safe: commands on
    one sandbox run one at a time; file operations and one-offs run alongside."""

    backend = "?"
    # Capabilities (codefleet.contracts.SANDBOXES): a backend built on this class says what it offers.
    isolated = False  # commands cannot reach the host's files, processes or network
    environments = False  # it runs an image's userland (SandboxConfig.environment)
    host_binds = True  # it can bind host paths read-only (SandboxConfig.ro_binds, e.g. a virtual environment)

    def __init__(
        self,
        sandbox_id: str,
        config: SandboxConfig,
        workspace_host_path: str,
        file_owner: tuple[int, int] | None = None,
    ):
        self.id = sandbox_id
        self.config = config
        self.files = WorkspaceFiles(workspace_host_path, file_owner)
        self._lock = threading.RLock()
        self._closed = False
        self._session: ShellSession | None = None
        self._proc: subprocess.Popen | None = None
        self.restarts = 0
        self._oom_seen = 0  # OOM kills already reported (_limit_note)

    # -- backend hooks -------------------------------------------------------------

    @abstractmethod
    def _spawn_shell(self, replay: str) -> tuple[subprocess.Popen, ShellSession]:
        """Start the shell and return it ready for commands."""

    @abstractmethod
    def _spawn_oneoff(self, argv: list[str]) -> subprocess.Popen:
        """Start argv over the workspace with stdout+stderr on one pipe."""

    @abstractmethod
    def _kill_processes(self) -> None:
        """Kill every process of the sandbox (shell, jobs, one-offs)."""

    @abstractmethod
    def _make_children(self, n: int, replay: str) -> list[ShellSandbox]:
        """n new sandboxes whose workspaces start from this one's current state."""

    @abstractmethod
    def _release(self) -> None:
        """Free the workspace and everything else (after processes are dead)."""

    @property
    @abstractmethod
    def info(self) -> SandboxInfo: ...

    # -- commands -------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosedError(f"sandbox {self.id} is closed; create a new one")

    def _start(self, replay: str = "") -> None:
        self._proc, self._session = self._spawn_shell(replay)

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run `command` in the persistent shell; cwd, env and background jobs persist."""
        with self._lock:
            self._check_open()
            restarted = False
            if not self.alive():
                self._restart()
                restarted = True
            result = self._session.run(command, self.config.timeout_s if timeout_s is None else timeout_s)
            if self._session.dead:  # restarted lazily, by the next command
                return replace(result, output=result.output + self._death_note(result))
            note = self._limit_note(result)
            if restarted:
                note += (
                    "\n[codefleet: the previous shell had died; this command ran in a fresh shell in the same "
                    "workspace]"
                )
            if restarted or note:
                return replace(result, output=result.output + note, shell_restarted=restarted)
            return result

    def _death_note(self, result: ExecResult) -> str:
        why = (
            "the command ignored the interrupt, so codefleet ended the shell"
            if result.timed_out
            else f"the shell exited (status {result.exit_code})"
        )
        return self._limit_note(result) + (
            f"\n[codefleet: {why}; the next command gets a fresh shell in the same "
            "workspace — cwd, environment and background jobs are reset]"
        )

    def _oom_kills(self) -> int | None:
        """How many of this sandbox's processes the OOM killer has killed so far; None where nobody counts."""
        return None

    def _limit_note(self, result: ExecResult) -> str:
        """A line for a command killed (137) by the sandbox's memory limit, told once per kill."""
        if result.exit_code not in (137, 9):
            return ""
        kills = self._oom_kills()
        if kills is None or kills <= self._oom_seen:
            return ""
        self._oom_seen = kills
        return f"\n[codefleet: a process was killed by the sandbox's memory limit ({self.config.memory_mb} MB)]"

    def _restart(self) -> None:
        """Replace a dead or wedged shell; the workspace is kept."""
        self._kill_processes()
        self._close_pipes()
        self.restarts += 1
        try:
            self._start()
        except Exception as e:
            raise SandboxDeadError(
                f"sandbox {self.id}: its shell died and could not be restarted ({e}); close it and create a new sandbox"
            ) from e

    def alive(self) -> bool:
        return (
            not self._closed
            and self._proc is not None
            and self._proc.poll() is None
            and self._session is not None
            and not self._session.dead
        )

    def run_oneoff(self, argv: list[str], timeout_s: float | None = None) -> ExecResult:
        """Run argv in a new process over the same workspace, outside the shell
        (no shared cwd/env; runs alongside a busy shell)."""
        self._check_open()
        timeout_s = self.config.timeout_s if timeout_s is None else timeout_s
        started = time.perf_counter()
        proc = self._spawn_oneoff(argv)
        try:
            out, finished = collect_until_exit(proc, self.config.output_limit_bytes, started + timeout_s)
            if not finished:
                self._kill_oneoff(proc)
            code = proc.wait()
        finally:
            proc.stdout.close()
        text, truncated, cut = out.result()
        if not finished:
            text += f"\n[codefleet: command timed out after {timeout_s:g} s and was killed]"
            code = 124
        return ExecResult(
            text, code if code >= 0 else 128 - code, not finished, truncated, time.perf_counter() - started, cut
        )

    def _kill_oneoff(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()

    # -- files ----------------------------------------------------------------------

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        self._check_open()
        return self.files.read_text(path, start_line, end_line)

    def read_bytes(self, path: str) -> bytes:
        """The exact bytes of `path` (contracts.ExactBytes), with read_file's path checks and size cap."""
        self._check_open()
        return self.files.read_bytes(path)

    def write_file(self, path: str, content: str | bytes) -> None:
        self._check_open()
        self.files.write(path, content)

    def list_dir(self, path: str = ".", recursive: bool = False) -> list[FileEntry]:
        self._check_open()
        return self.files.list(path, recursive)

    def search(self, pattern: str, path: str = ".", max_matches: int = 200) -> list[SearchMatch]:
        """Lines matching the extended regular expression `pattern` under `path`
        (grep -E semantics, binary files and .git skipped)."""
        self._check_open()
        rel = self.files.real_relpath(path)  # refuses paths outside the workspace; resolves symlinks
        # -H: name the file even when `path` is one file; -s: unreadable files are skipped
        # silently, so only a bad pattern prints an error; -D skip: a FIFO is never read.
        result = self.run_oneoff(
            ["grep", "-rHnIEs", "-D", "skip", "--null", "--exclude-dir=.git", "-e", pattern, "--", rel], timeout_s=30
        )
        if result.timed_out:
            raise ValueError(f"search for {pattern!r} in {path!r} timed out after 30 s; search a smaller directory")
        matches = []
        errors = []
        for line in result.output.split("\n"):  # not splitlines(): a match may contain \f or \x1c
            name, sep, rest = line.partition("\x00")
            number, sep2, text = rest.partition(":")
            if sep and sep2 and number.isdigit():
                if len(matches) < max_matches:
                    matches.append(SearchMatch(os.path.normpath(name), int(number), text))
            elif line.strip():
                errors.append(line.strip())
        if result.exit_code == 2 and errors:
            raise ValueError(
                f"search for {pattern!r} failed: {' '.join(errors)[:300]} (patterns use grep -E "
                "syntax; escape special characters such as ( [ { with a backslash)"
            )
        return matches

    # -- fork and close -------------------------------------------------------------

    _STATE_MARK = "@@codefleet-shell-state@@"

    def shell_state(self) -> str:
        """Bash lines that recreate this shell's cwd and exported variables.

        The cwd is printed with %q and the variables with `export -p` (bash's own
        re-readable form), so names with spaces or newlines survive; a marker line
        separates them from late output of background jobs."""
        result = self.exec(
            f"builtin printf '%s\\n%q\\n' {shell_quote(self._STATE_MARK)} \"$PWD\"; "
            "( builtin export -n PWD OLDPWD SHLVL 2>/dev/null; builtin export -p )",
            timeout_s=10,
        )
        _, found, state = result.output.partition(self._STATE_MARK + "\n")
        if not found or result.exit_code != 0:
            return ""
        cwd, _, exports = state.partition("\n")
        lines = [f"builtin cd -- {cwd} 2>/dev/null"]
        if exports.strip():  # a variable that cannot be set (readonly) must not fail the new shell
            lines.append("{ " + exports.rstrip("\n") + "\n} 2>/dev/null")
        return "\n".join(lines + ["builtin true"])

    def fork(self, n: int) -> list[ShellSandbox]:
        """n sandboxes whose workspaces start from this one's current filesystem
        state (copy-on-write), with this shell's cwd and exported variables."""
        if n < 1:
            raise ValueError(f"fork needs n >= 1, got {n}")
        with self._lock:
            self._check_open()
            replay = self.shell_state() if self.alive() else ""
            return self._make_children(n, replay)

    def close(self) -> None:
        """Kill everything in the sandbox and free its workspace. Idempotent. A command running in
        another thread is not waited for: its processes are killed first, so it returns at once."""
        if not self._closed:
            self._kill_processes()  # outside the lock, which a running exec holds until its shell dies
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._kill_processes()
                self._close_pipes()
            finally:
                self._release()

    def _close_pipes(self) -> None:
        if self._proc is not None:
            for pipe in (self._proc.stdin, self._proc.stdout):
                try:
                    if pipe:
                        pipe.close()
                except OSError:
                    pass
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> ShellSandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.id} {'closed' if self._closed else 'open'}>"
