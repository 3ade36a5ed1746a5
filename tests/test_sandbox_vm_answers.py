"""What the host takes from a vm guest, without a VM: the agent's answers (vm_answers.answer_of), the frames on
its port (vm_qemu.AgentLink, driven by a scripted hostile guest over a socketpair) and the guest's identity
(vm_agent: a fixed uid, its own passwd and group). A guest that became root, or an image whose python3 runs the
agent, can send anything; each case here must end in one SandboxDeadError that says the guest answered
something malformed, never a ValueError, KeyError or OverflowError, and never a wait."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from dataclasses import asdict

import pytest

from codefleet.sandbox import SandboxDeadError, SandboxError
from codefleet.sandbox.bwrap import SANDBOX_UID
from codefleet.sandbox.files import MAX_READ_BYTES
from codefleet.sandbox.vm_agent import GUEST_GID, GUEST_UID, GUEST_USER, Agent, _write_identity
from codefleet.sandbox.vm_answers import _ANSWERS, MalformedAnswerError, answer_of
from codefleet.sandbox.vm_qemu import MAX_RESPONSE, AgentLink
from codefleet.types import ExecResult, FileEntry, SearchMatch

LIMIT = 1000  # the output cap the answers are checked against
GOOD_EXEC = asdict(ExecResult("hi\n", 0, duration_s=0.01))


def _exec(**changed: object) -> dict:
    return {**GOOD_EXEC, **changed}


def _entry(**changed: object) -> dict:
    return {"path": "pkg/calc.py", "kind": "file", "size_bytes": 12, **changed}


def _match(**changed: object) -> dict:
    return {"path": "pkg/calc.py", "line_number": 3, "line": "def add(a, b):", **changed}


HOSTILE = {
    "exec": [
        None,
        [],
        {},
        "output",
        {k: v for k, v in GOOD_EXEC.items() if k != "exit_code"},
        _exec(extra=1),
        _exec(output=5),
        _exec(output="x" * (LIMIT + 5000)),
        _exec(output="lone \ud800 surrogate"),
        _exec(output="escaped \udcff byte"),
        _exec(exit_code="0"),
        _exec(exit_code=True),
        _exec(exit_code=10**30),
        _exec(exit_code=-(10**30)),
        _exec(exit_code=-65),
        _exec(exit_code=256),
        _exec(exit_code=1.0),
        _exec(duration_s=float("nan")),
        _exec(duration_s=float("inf")),
        _exec(duration_s=-1.0),
        _exec(duration_s="1"),
        _exec(duration_s=10**400),
        _exec(cut_bytes=-1),
        _exec(cut_bytes=1 << 64),
        _exec(timed_out=1),
        _exec(truncated=None),
        _exec(shell_restarted="no"),
    ],
    "list": [
        None,
        {},
        [None],
        [[]],
        [_entry(kind="device")],
        [_entry(size_bytes=-1)],
        [_entry(size_bytes=10**100)],
        [_entry(size_bytes=1.5)],
        [_entry(path="")],
        [_entry(path="a\0b")],
        [_entry(path=5)],
        [_entry(path="bad \ud800")],
        [{"path": "a", "kind": "file"}],
        [_entry()] * 10_001,
    ],
    "search": [
        None,
        [_match()] * 3,
        [_match(line_number=0)],
        [_match(line_number=-2)],
        [_match(line_number="3")],
        [_match(line="\ud83d")],
        [_match(path=None)],
        [_match(line="x" * (LIMIT + 1))],
    ],
    "read": [None, 5, ["text"], {"text": "x"}, "\udcff", "x" * (MAX_READ_BYTES + 1)],
    "write": [{}, "", 0, False],
    "alive": [None, 1, "true", {}],
    "hello": [None, {}, {"started": 1}, {"started": False, "more": 1}],
    "start": [None, [], {"started": True}],
}


@pytest.mark.parametrize(
    "op,raw",
    [(op, raw) for op, answers in HOSTILE.items() for raw in answers],
    ids=lambda v: v if isinstance(v, str) and len(v) < 12 else None,
)
def test_a_malformed_answer_is_one_sandbox_dead_error(op, raw):
    with pytest.raises(MalformedAnswerError, match=f"the guest answered {op!r} with something malformed"):
        answer_of(op, raw, {"max_matches": 2}, LIMIT)
    assert issubclass(MalformedAnswerError, SandboxDeadError)


def test_what_the_agent_really_sends_is_taken_as_the_hosts_types():
    killed = asdict(ExecResult("x" * LIMIT + "\n[... 5 bytes of output cut ...]\n", 137, True, True, 3, 5, True))
    assert answer_of("exec", GOOD_EXEC, {}, LIMIT) == ExecResult("hi\n", 0, duration_s=0.01)
    assert answer_of("oneoff", killed, {}, LIMIT).exit_code == 137
    assert answer_of("exec", _exec(exit_code=-1, output="\ufffd replaced"), {}, LIMIT).exit_code == -1
    assert answer_of("exec", _exec(exit_code=-9), {}, LIMIT).exit_code == -9  # the shell itself was killed
    # a name that is not UTF-8 keeps its bytes as surrogates, as files.list gives it (and takes it back)
    listed = [asdict(FileEntry("caf\udce9.txt", "file", 3)), asdict(FileEntry("sub", "dir", 4096))]
    assert answer_of("list", listed, {}, LIMIT) == [
        FileEntry("caf\udce9.txt", "file", 3),
        FileEntry("sub", "dir", 4096),
    ]
    found = [asdict(SearchMatch("pkg/calc.py", 1, "def add(a, b):"))]
    assert answer_of("search", found, {"max_matches": 1}, LIMIT) == [SearchMatch("pkg/calc.py", 1, "def add(a, b):")]
    assert answer_of("read", "x" * MAX_READ_BYTES, {}, LIMIT) == "x" * MAX_READ_BYTES
    assert answer_of("write", None, {}, LIMIT) is None and answer_of("alive", False, {}, LIMIT) is False
    assert answer_of("hello", {"started": True}, {}, LIMIT) == {"started": True}
    assert answer_of("start", {}, {}, LIMIT) == {}


def test_every_op_of_the_agent_has_its_answer_checked():
    ops = {name.removeprefix("op_") for name in dir(Agent) if name.startswith("op_")}
    assert ops == set(_ANSWERS)


# -- frames on the agent's port, from a scripted hostile guest -----------------------------------------------


def _guest(sock: socket.socket, answer) -> None:
    """Answer each request on `sock` with the bytes `answer(request id)`."""
    buf = b""
    while True:
        try:
            chunk = sock.recv(1 << 16)
        except OSError:  # the test closed it
            return
        if not chunk:
            return
        buf += chunk
        while len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
            size = struct.unpack(">I", buf[:4])[0]
            request, buf = json.loads(buf[4 : 4 + size]), buf[4 + size :]
            sock.sendall(answer(request["id"]))


def _frame(data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + data


FRAMES = {
    "not UTF-8": lambda rid: _frame(b'{"id": %d, "ok": true, "result": "\xff\xfe"}' % rid),
    "not JSON": lambda rid: _frame(b'{"id": %d, ' % rid),
    "nested beyond the parser": lambda rid: _frame(b"[" * 200_000),
    "digits beyond int's": lambda rid: _frame(b'{"id": %d, "ok": true, "result": %s}' % (rid, b"9" * 5000)),
    "not an object": lambda rid: _frame(b"[1, 2]"),
    "a string id": lambda rid: _frame(json.dumps({"id": str(rid), "ok": True, "result": True}).encode()),
    "ok not a bool": lambda rid: _frame(json.dumps({"id": rid, "ok": "yes", "result": True}).encode()),
    "no result": lambda rid: _frame(json.dumps({"id": rid, "ok": True}).encode()),
    "an error named by a non-name": lambda rid: _frame(
        json.dumps({"id": rid, "ok": False, "error": "Value Error; rm -rf", "message": "x"}).encode()
    ),
    "an error message too long": lambda rid: _frame(
        json.dumps({"id": rid, "ok": False, "error": "OSError", "message": "x" * 5000}).encode()
    ),
    "an oversize frame": lambda rid: struct.pack(">I", MAX_RESPONSE + 1) + b"{}",
}


@pytest.mark.parametrize("kind", FRAMES)
def test_a_hostile_frame_breaks_the_link_at_once_with_one_sandbox_dead_error(kind):
    host, guest = socket.socketpair()
    threading.Thread(target=_guest, args=(guest, FRAMES[kind]), daemon=True).start()
    link = AgentLink(host)
    try:
        started = time.monotonic()
        with pytest.raises(SandboxDeadError, match="broken or hostile"):
            link.call("alive", 30)
        assert time.monotonic() - started < 10  # at once, not at the call's timeout
        assert link.broken and "broken or hostile" in link.broken
        with pytest.raises(SandboxDeadError):  # and every call after it
            link.call("alive", 30)
    finally:
        link.close()
        guest.close()


def test_a_well_formed_error_is_the_error_it_names_and_the_link_lives_on():
    answers = iter(
        [
            {"ok": False, "error": "FileNotFoundError", "message": "no such file: a.txt"},
            {"ok": False, "error": "RuntimeError", "message": "the sandbox has not been started"},
            {"ok": True, "result": True},
        ]
    )
    host, guest = socket.socketpair()
    threading.Thread(
        target=_guest, args=(guest, lambda rid: _frame(json.dumps({"id": rid, **next(answers)}).encode())), daemon=True
    ).start()
    link = AgentLink(host)
    try:
        with pytest.raises(FileNotFoundError, match="no such file"):
            link.call("read", 30)
        with pytest.raises(SandboxError, match="RuntimeError: the sandbox has not been started"):
            link.call("exec", 30)
        assert link.call("alive", 30) is True and link.broken is None
    finally:
        link.close()
        guest.close()


# -- the guest's identity --------------------------------------------------------------------------------------


def test_the_guest_user_is_fixed_and_is_a_namespace_sandboxs():
    assert (GUEST_UID, GUEST_GID) == (SANDBOX_UID, SANDBOX_UID) and GUEST_UID != 0
    assert GUEST_USER == "agent"


def test_the_guest_writes_its_own_passwd_and_group_never_through_the_images(tmp_path):
    outside = tmp_path / "outside"
    outside.write_text("untouched\n")
    etc = tmp_path / "etc"
    etc.mkdir()
    (etc / "passwd").symlink_to(outside)  # an image's /etc/passwd pointing at what the agent must not write
    (etc / "group").mkdir()
    _write_identity(str(etc))
    assert outside.read_text() == "untouched\n"
    passwd = (etc / "passwd").read_text()
    assert f"{GUEST_USER}:x:{GUEST_UID}:{GUEST_GID}:" in passwd
    assert [line.split(":")[0] for line in passwd.splitlines() if line.split(":")[2] == "0"] == ["root"]
    assert (etc / "group").is_file() and f"{GUEST_USER}:x:{GUEST_GID}:" in (etc / "group").read_text()
    linked = tmp_path / "linked-etc"
    linked.symlink_to(tmp_path / "elsewhere", target_is_directory=True)  # /etc itself a symlink: replaced
    (tmp_path / "elsewhere").mkdir()
    _write_identity(str(linked))
    assert not linked.is_symlink() and (linked / "passwd").is_file()
    assert os.listdir(tmp_path / "elsewhere") == []
