"""What the host accepts from a vm guest's agent: each answer checked to be exactly what vm_agent sends.

The guest is the untrusted side of the vm backend: a command that became root in the guest (a kernel
exploit, an image's setuid program) can kill the agent and answer in its place. So nothing it sends is
taken on trust. vm_qemu.AgentLink checks the frame (its size, that it is JSON, its envelope) and
`answer_of` checks the answer to each op: its keys, the type of each value (a bool is not an int), the
range of each number (no NaN, no exit status of 10**30), the size of each text (a command's output
within its cap) and that text is Unicode (no lone surrogates, which fail later, far from here, when
encoded). Anything else is one MalformedAnswerError, a SandboxDeadError: the sandbox is broken,
close it and create another.
"""

from __future__ import annotations

import dataclasses

from codefleet.sandbox.base import SandboxDeadError
from codefleet.sandbox.files import MAX_READ_BYTES
from codefleet.types import ExecResult, FileEntry, SearchMatch


class MalformedAnswerError(SandboxDeadError):
    """The guest answered something that is not what its agent sends: it is broken or hostile."""


_KINDS = ("file", "dir", "symlink", "other")  # FileEntry.kind
_MAX_INT = (1 << 63) - 1
_MIN_STATUS = -64  # a shell killed by signal N answers -N (SIGRTMAX is 64); -1: no status at all
_NOTES_CHARS = 4096  # what the agent adds to a command's capped output: the cut marker, codefleet's notes
_MAX_LIST = 10_000  # files.list's max_entries


def answer_of(op: str, raw: object, args: dict, output_limit_bytes: int) -> object:
    """The agent's answer `raw` to `op` (asked with `args`) as the host's types, checked to be exactly what the
    agent sends: keys, types, ranges, sizes, text that is Unicode. Anything else raises MalformedAnswerError
    naming what was wrong; nothing a guest sends raises another error here."""
    try:
        return _ANSWERS[op](raw, args, output_limit_bytes)
    except _Wrong as e:
        raise MalformedAnswerError(f"the guest answered {op!r} with something malformed ({e})") from None


class _Wrong(Exception):
    pass


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise _Wrong(what)


def _record(raw: object, keys: tuple[str, ...], what: str) -> dict:
    _expect(type(raw) is dict and sorted(raw) == sorted(keys), f"{what} is not an object with exactly {keys}")
    return raw


def _int(value: object, low: int, high: int, what: str) -> int:
    _expect(type(value) is int and low <= value <= high, f"{what} is not an integer in [{low}, {high}]")
    return value


def _bool(value: object, what: str) -> bool:
    _expect(type(value) is bool, f"{what} is not true or false")
    return value


def _text(value: object, max_chars: int, what: str, errors: str = "strict") -> str:
    """A string of at most `max_chars` that is Unicode: no lone surrogates, but with `errors="surrogateescape"`
    those a name that is not UTF-8 keeps its bytes as (os.listdir's)."""
    _expect(type(value) is str and len(value) <= max_chars, f"{what} is not a string of at most {max_chars} characters")
    try:
        value.encode("utf-8", errors)
    except UnicodeEncodeError:
        raise _Wrong(f"{what} is not Unicode text") from None
    return value


def _path(value: object, what: str) -> str:
    path = _text(value, 1 << 20, what, "surrogateescape")
    _expect(path != "" and "\0" not in path, f"{what} is not a path")
    return path


def _exec_answer(raw: object, args: dict, output_limit_bytes: int) -> ExecResult:
    r = _record(raw, tuple(f.name for f in dataclasses.fields(ExecResult)), "the result")
    duration = r["duration_s"]
    _expect(type(duration) in (int, float) and 0 <= duration <= 1e7, "duration_s is not a duration")  # NaN fails
    return ExecResult(
        _text(r["output"], output_limit_bytes + _NOTES_CHARS, "the output"),
        _int(r["exit_code"], _MIN_STATUS, 255, "exit_code"),
        _bool(r["timed_out"], "timed_out"),
        _bool(r["truncated"], "truncated"),
        float(duration),
        _int(r["cut_bytes"], 0, _MAX_INT, "cut_bytes"),
        _bool(r["shell_restarted"], "shell_restarted"),
    )


def _list_answer(raw: object, args: dict, output_limit_bytes: int) -> list[FileEntry]:
    _expect(type(raw) is list and len(raw) <= _MAX_LIST, f"the listing is not a list of at most {_MAX_LIST} entries")
    entries = []
    for row in raw:
        r = _record(row, ("path", "kind", "size_bytes"), "an entry")
        _expect(r["kind"] in _KINDS, f"an entry's kind is not one of {_KINDS}")
        entries.append(
            FileEntry(
                _path(r["path"], "an entry's path"),
                r["kind"],
                _int(r["size_bytes"], 0, _MAX_INT, "an entry's size_bytes"),
            )
        )
    return entries


def _search_answer(raw: object, args: dict, output_limit_bytes: int) -> list[SearchMatch]:
    most = args["max_matches"]
    _expect(type(raw) is list and len(raw) <= most, f"the matches are not a list of at most {most}")
    matches = []
    for row in raw:
        r = _record(row, ("path", "line_number", "line"), "a match")
        matches.append(
            SearchMatch(
                _text(r["path"], 1 << 20, "a match's path"),
                _int(r["line_number"], 1, _MAX_INT, "a match's line_number"),
                _text(r["line"], output_limit_bytes, "a match's line"),
            )
        )
    return matches


def _hello_answer(raw: object, args: dict, output_limit_bytes: int) -> dict:
    _bool(_record(raw, ("started",), "the greeting")["started"], "started")
    return raw


_ANSWERS = {
    "hello": _hello_answer,
    "start": lambda raw, args, limit: _record(raw, (), "the answer"),
    "exec": _exec_answer,
    "oneoff": _exec_answer,
    "read": lambda raw, args, limit: _text(raw, MAX_READ_BYTES, "the file's text"),
    "write": lambda raw, args, limit: _expect(raw is None, "the answer is not null"),
    "list": _list_answer,
    "search": _search_answer,
    "alive": lambda raw, args, limit: _bool(raw, "the answer"),
}
