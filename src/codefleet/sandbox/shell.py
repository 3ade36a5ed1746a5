"""The persistent shell: one bash per sandbox, driven over two pipes.

Protocol. The host writes one line per command (shown here on two):

    \\builtin : ; \\builtin eval -- '<command>' </dev/null >/dev/stdout 2>&1;
    \\builtin printf '\\036<nonce>:<seq>:%d\\036' $?

eval runs in the shell itself, so `cd`, `export` and background jobs
persist; `2>&1` merges stderr into stdout in write order; stdin is
/dev/null so a command can never eat the protocol. stdout is opened anew,
so that bash saves it and puts it back after the command: an `exec
>/dev/null` or `exec >&-` of the command's cannot swallow the marker.
Every word of the line's own is a quoted `\\builtin` (or a redirection), so
no alias or function the command defines (`printf() {...}`, `alias
'{'=...`) can stand in for it (one named `builtin` itself can: then the
timeout replaces the shell). The leading `: ;` is there because a command
that is a syntax error (`grep 'abc`, an unclosed `$((`) leaves interactive
bash reading the next line out of command position: a line that began with
`{` would then be a syntax error too, its marker would never come, and the
next command would hang until its timeout.
The host reads until the marker with this command's sequence number and
takes the exit code from it.

Timeouts. bash runs *interactive* (`-i`, with no terminal and no prompt):
an interactive bash abandons the current command line on SIGINT, which is
the only way to stop a loop made of shell builtins without killing the
shell. On a timeout the host interrupts the shell, interrupts and then kills
every process the command started (processes that existed before it, such as
earlier background jobs, are spared), and resynchronises with a fresh marker.
Once the shell is back, whatever the command started that is still there is
killed too, and what it wrote before dying counts as this command's output,
not the next one's. A shell that still does not answer is declared wedged
and the owner restarts it. Interactive bash echoes its input to stderr; the
shell's own stderr is therefore discarded (commands get `2>&1` instead), but
what it prints while a command's redirections are in place cannot be: its
complaint that it cannot reset a terminal it never had is dropped from the
output.

Output is capped: the first and last `limit/2` bytes are kept and a marker
line says how many bytes were cut in between. Bytes are decoded at the end
with invalid UTF-8 replaced, so binary output never breaks anything.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import select
import signal
import time
from collections.abc import Callable

from codefleet.sandbox.base import SandboxDeadError
from codefleet.types import ExecResult

_PIPE_BYTES = 1 << 20  # ask the kernel for 1 MiB pipes: fewer wakeups on big outputs
_READ_BYTES = 1 << 20
# An interactive bash without a terminal prints this each time a foreground
# command dies of a signal (`yes | head`, a timeout, the OOM killer): it tries
# to restore the terminal settings it never had. It is the shell's noise.
_NOISE = re.compile(rb"bash: \[\d{1,10}: \d{1,10} \(-?\d{1,10}\)\] tcsetattr: Inappropriate ioctl for device\n")
_NOISE_TEXT = b"] tcsetattr: Inappropriate ioctl for device"
_NOISE_MAX_BYTES = 128


def shell_quote(text: str) -> str:
    """Single-quote `text` for bash."""
    return "'" + text.replace("'", "'\\''") + "'"


class OutputCollector:
    """Keeps the head and the tail of a byte stream and finds the end marker.

    The marker is `marker_prefix`, an exit code and \\x1e. Bytes that are not
    the command's are dropped before they are counted: markers of earlier,
    interrupted commands arriving late, and the shell's terminal noise
    (_NOISE). The last bytes of the stream, as many as a marker or a
    noise line could be long, are held back until later bytes show what they
    are: so neither is ever stored in part, whatever the size of the cap.
    """

    def __init__(self, limit_bytes: int, marker_prefix: bytes):
        self.head_limit = max(limit_bytes // 2, 0)
        self.tail_limit = max(limit_bytes - self.head_limit, 0)
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0
        self.marker_prefix = marker_prefix
        self._marker = re.compile(re.escape(marker_prefix) + rb"(-?\d{1,12})\x1e")
        self._marker_start = marker_prefix.split(b":")[0] + b":"  # what every marker, stale or not, begins with
        self._stale = re.compile(re.escape(self._marker_start) + rb"\d{1,12}:-?\d{1,12}\x1e")
        self._hold = max(len(marker_prefix) + 26, _NOISE_MAX_BYTES)
        self._held = b""
        self.exit_code: int | None = None
        self.leftover = b""  # bytes after the marker (late background output)

    def feed(self, chunk: bytes) -> bool:
        """Add bytes; return True once the end marker has been seen."""
        window = self._held + chunk
        found = self._marker.search(window) if self._marker_start in window else None
        body = self._drop_junk(window[: found.start()] if found else window)
        if found:
            self.exit_code = int(found.group(1))
            self._store(body)
            self._held = b""
            self.leftover = window[found.end() :]
            return True
        split = max(len(body) - self._hold, 0)
        self._store(body[:split])
        self._held = body[split:]
        return False

    def take_late_output(self, data: bytes) -> None:
        """Count what came after the marker (and `data`) as this command's output."""
        self._store(self._drop_junk(self.leftover + data))
        self.leftover = b""

    def _drop_junk(self, data: bytes) -> bytes:
        # A plain substring test first: scanning with the patterns is several times slower.
        if self._marker_start in data:
            data = self._stale.sub(b"", data)
        if _NOISE_TEXT in data:
            data = _NOISE.sub(b"", data)
        return data

    def _store(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if len(data) >= self.tail_limit:
            self.tail = bytearray(data[len(data) - self.tail_limit :])
        elif data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_limit:
                del self.tail[: len(self.tail) - self.tail_limit]

    def result(self) -> tuple[str, bool, int]:
        """(text, truncated, cut_bytes), invalid UTF-8 replaced. Bytes still held
        back are output: the stream ended, or was given up on, without the marker."""
        self._store(self._held)
        self._held = b""
        tail = bytes(self.tail[-self.tail_limit :]) if self.tail_limit else b""
        cut = self.total - len(self.head) - len(tail)
        if cut <= 0:
            return (bytes(self.head) + tail).decode("utf-8", "replace"), False, 0
        note = f"\n[... {cut} bytes of output cut ...]\n".encode()
        return (bytes(self.head) + note + tail).decode("utf-8", "replace"), True, cut


class ShellSession:
    """Drives one interactive bash over pipes. Not thread-safe: one command at a time.

    `shell_pid` is the bash process (as seen from the host), used to
    interrupt it; `list_procs()` returns the host pids of every process in
    the sandbox other than init and the shell, used to kill what a timed-out
    command left behind.
    """

    def __init__(
        self,
        stdin_fd: int,
        stdout_fd: int,
        shell_pid: int,
        list_procs: Callable[[], set[int]],
        exit_status: Callable[[], int],
        output_limit_bytes: int,
    ):
        self._exit_status = exit_status
        self._w = stdin_fd
        self._r = stdout_fd
        self.shell_pid = shell_pid
        self._list_procs = list_procs
        self._limit = output_limit_bytes
        self._nonce = secrets.token_hex(6).encode()
        self._seq = 0
        self._pending = b""  # background output that arrived between commands
        self.dead = False
        for fd in (self._r, self._w):
            try:
                fcntl.fcntl(fd, 1031, _PIPE_BYTES)  # F_SETPIPE_SZ
            except OSError:
                pass
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    # -- public --------------------------------------------------------------

    def wait_ready(self, setup_script: str, timeout_s: float = 10.0) -> None:
        """Send the setup lines and wait until the shell answers."""
        result = self.run(setup_script, timeout_s)
        if result.exit_code != 0:
            raise SandboxDeadError(f"the sandbox shell failed to start: {result.output.strip()[:500]}")

    def run(self, command: str, timeout_s: float) -> ExecResult:
        if self.dead:
            raise SandboxDeadError("the sandbox shell has exited")
        started = time.perf_counter()
        self._seq += 1
        prefix = b"\x1e" + self._nonce + b":%d:" % self._seq
        line = (
            "\\builtin : ; \\builtin eval -- " + shell_quote(command) + " </dev/null >/dev/stdout 2>&1; "
            "\\builtin printf '\\036" + self._nonce.decode() + ":" + str(self._seq) + ":%d\\036' $?\n"
        ).encode()
        before = self._list_procs()
        out = OutputCollector(self._limit, prefix)
        if self._pending:
            out.feed(self._pending)
            self._pending = b""
        done = self._pump(line, out, started + timeout_s)
        timed_out = False
        if not done and not self.dead:
            timed_out = True
            done = self._interrupt(out, before)
        text, truncated, cut = out.result()
        if done:
            self._pending = out.leftover
        duration = time.perf_counter() - started
        if timed_out:
            text += f"\n[codefleet: command timed out after {timeout_s:g} s; the processes it started were killed" + (
                "; the shell is still alive]" if done else "]"
            )
            return ExecResult(text, 124, True, truncated, duration, cut)
        if not done:  # the shell exited (e.g. `exit 3`) or was killed
            return ExecResult(text, self._exit_status(), False, truncated, duration, cut)
        return ExecResult(text, out.exit_code if out.exit_code is not None else -1, False, truncated, duration, cut)

    def kill_started_since(self, before: set[int], sig: int) -> int:
        victims = self._list_procs() - before
        for pid in victims:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return len(victims)

    # -- internals -------------------------------------------------------------

    def _pump(self, to_write: bytes, out: OutputCollector, deadline: float) -> bool:
        """Write `to_write` and read until the marker, EOF or the deadline."""
        poller = select.poll()
        poller.register(self._r, select.POLLIN)
        view = memoryview(to_write)
        if view:
            view = self._write_some(view)
            if view:
                poller.register(self._w, select.POLLOUT)
        while True:
            wait_ms = (deadline - time.perf_counter()) * 1000
            if wait_ms <= 0:
                return False
            for fd, ev in poller.poll(max(int(wait_ms), 1) if wait_ms > 1 else 1):
                if fd == self._w:
                    if ev & (select.POLLERR | select.POLLHUP):
                        poller.unregister(self._w)
                        continue
                    view = self._write_some(view)
                    if not view:
                        poller.unregister(self._w)
                    continue
                try:
                    chunk = os.read(self._r, _READ_BYTES)
                except BlockingIOError:
                    continue
                if not chunk:
                    self.dead = True
                    return False
                if out.feed(chunk):
                    return True

    def _write_some(self, view: memoryview) -> memoryview:
        try:
            n = os.write(self._w, view)
        except BlockingIOError:
            return view
        except (BrokenPipeError, OSError) as e:
            if isinstance(e, BrokenPipeError) or e.errno == errno.EPIPE:
                return view[len(view) :]
            raise
        return view[n:]

    def _signal_shell(self, sig: int) -> None:
        try:
            os.kill(self.shell_pid, sig)
        except ProcessLookupError:
            pass

    def _interrupt(self, out: OutputCollector, before: set[int]) -> bool:
        """Stop a timed-out command; True if the shell came back to its prompt
        (if not, it is declared dead and the owner's restart kills the rest)."""
        back = self._stop_command(out, before)
        if back:
            self._kill_leftovers(before)
            # What they wrote before they died is still in the pipe: it is this
            # command's output, not the next one's.
            out.take_late_output(self._drain())
        return back

    def _stop_command(self, out: OutputCollector, before: set[int]) -> bool:
        """SIGINT first, to the shell and to every process the command started:
        bash abandons the rest of the command line when its child dies of
        SIGINT. The marker of an abandoned line never comes, so a second line
        asks for it. Processes that ignore SIGINT get SIGKILL."""
        self._signal_shell(signal.SIGINT)
        self.kill_started_since(before, signal.SIGINT)
        if self._pump(b"", out, time.perf_counter() + 0.02):
            return True
        sync = ("\\builtin printf '\\036" + self._nonce.decode() + ":" + str(self._seq) + ":124\\036'\n").encode()
        if self._pump(sync, out, time.perf_counter() + 0.2):
            return True
        give_up = time.perf_counter() + 3.0
        while time.perf_counter() < give_up and not self.dead:
            self.kill_started_since(before, signal.SIGKILL)
            self._signal_shell(signal.SIGINT)
            if self._pump(b"", out, time.perf_counter() + 0.1):
                return True
        if not self.dead:
            self._signal_shell(signal.SIGKILL)
            self.dead = True
        return False

    def _drain(self, max_reads: int = 16) -> bytes:
        """What the pipe holds now, without waiting (bounded: a job may write forever)."""
        data = b""
        for _ in range(max_reads):
            try:
                chunk = os.read(self._r, _READ_BYTES)
            except BlockingIOError:
                break
            if not chunk:
                self.dead = True
                break
            data += chunk
        return data

    def _kill_leftovers(self, before: set[int], timeout_s: float = 2.0) -> None:
        """SIGKILL what the command started and is still there once the shell is
        back: background children, processes that handled SIGINT and went on,
        a fork bomb's newest forks. Repeated until none is left."""
        give_up = time.perf_counter() + timeout_s
        while self.kill_started_since(before, signal.SIGKILL) and time.perf_counter() < give_up:
            time.sleep(0.005)
