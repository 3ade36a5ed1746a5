"""Inputs that must get one clear line of error, or just work, and never a traceback or a dead episode:
bad limits and timeouts on the command line, a --repo that is a file, file names that are not UTF-8,
a very deep tree, and a line range of a file too large to read whole."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
import subprocess
import sys

import pytest
from helpers import BACKENDS
from openai_stub import OpenAIStub, call, reply

from codefleet.agent import AgentLoop, build_messages
from codefleet.agent.clients import OpenAIConfig, OpenAIPolicy
from codefleet.agent.policy import parse_tool_call
from codefleet.agent.tools import Toolbox
from codefleet.config import load_config
from codefleet.sandbox import SandboxConfig, create_sandbox
from codefleet.sandbox.files import MAX_READ_BYTES
from codefleet.sandbox.layers import copy_layer, mount, remove_tree, umount


@pytest.fixture(params=BACKENDS)
def sandbox_backend(request):
    """Each test of a sandbox here runs against every backend (the vm one under `-m vm`)."""
    return request.param


def run_cli(state_dir: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CODEFLEET_STATE_DIR=state_dir)
    return subprocess.run(
        [sys.executable, "-m", "codefleet.cli", *args], capture_output=True, text=True, env=env, timeout=120
    )


def assert_one_line_error(result: subprocess.CompletedProcess, *phrases: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    for phrase in phrases:
        assert phrase in result.stderr


# -- the command line ----------------------------------------------------------------------------


@pytest.mark.parametrize("timeout", ["-1", "0", "nan", "inf"])
def test_a_timeout_that_is_not_a_positive_number_is_refused(state_dir, timeout):
    result = run_cli(state_dir, "sandbox", "run", "--timeout", timeout, "--", "true")
    assert_one_line_error(result, "--timeout must be a positive number of seconds, got")
    assert "timed out" not in result.stdout + result.stderr


@pytest.mark.parametrize(
    "args, phrase",
    [
        (["--set", "workspace_mb=-1"], "SandboxConfig.workspace_mb is -1; it must be a whole number greater than 0"),
        (["--memory-mb", "0"], "SandboxConfig.memory_mb is 0; it must be a whole number greater than 0"),
        (["--set", "timeout_s=.nan"], "SandboxConfig.timeout_s is nan; it must be a finite number greater than 0"),
    ],
)
def test_a_limit_that_is_not_positive_is_refused_naming_the_field(state_dir, args, phrase):
    result = run_cli(state_dir, "sandbox", "run", *args, "--", "true")
    assert_one_line_error(result, phrase)
    assert "ro_binds" not in result.stderr  # --memory-mb 0 used to be blamed on it


def test_a_repository_that_is_a_file_is_named_as_such(tmp_path, state_dir):
    path = tmp_path / "notes.txt"
    path.write_text("not a directory\n")
    result = run_cli(state_dir, "sandbox", "run", "--repo", str(path), "--", "true")
    assert_one_line_error(result, f"repository directory {str(path)!r} is not a directory")
    assert "does not exist" not in result.stderr


_LIMITS = [
    "timeout_s",
    "output_limit_bytes",
    "memory_mb",
    "max_processes",
    "cpu_cores",
    "cpu_time_s",
    "workspace_mb",
    "tmp_mb",
    "max_file_mb",
]


@pytest.mark.parametrize("field", _LIMITS)
@pytest.mark.parametrize("value", [0, -1, True, math.nan, math.inf])
def test_every_limit_of_the_config_must_be_a_positive_number(field, value):
    with pytest.raises(ValueError, match=rf"^SandboxConfig\.{field} is {value!r}; it must be a "):
        SandboxConfig(**{field: value})
    with pytest.raises(ValueError, match=rf"SandboxConfig\.{field}"):  # also when a config is changed
        dataclasses.replace(SandboxConfig(), **{field: value})


def test_positive_limits_are_accepted_and_whole_numbers_stay_whole():
    cfg = load_config(SandboxConfig, None, ["cpu_cores=0.25", "timeout_s=0.5", "memory_mb=1", "tmp_mb=1"])
    assert (cfg.cpu_cores, cfg.timeout_s, cfg.memory_mb, cfg.tmp_mb) == (0.25, 0.5, 1, 1)
    with pytest.raises(ValueError, match=r"SandboxConfig\.memory_mb is 1\.5; it must be a whole number"):
        SandboxConfig(memory_mb=1.5)  # type: ignore[arg-type]


# -- file names that are not UTF-8 -------------------------------------------------------------------

BAD_NAMES = "touch $'\\xff\\xfe.txt' && mkdir $'sub\\xff' && echo hi > $'sub\\xff/in.txt'"


def test_names_that_are_not_utf8_are_listed_and_the_paths_listed_work(sandbox):
    assert sandbox.exec(BAD_NAMES).exit_code == 0
    entries = {os.fsencode(e.path): e.kind for e in sandbox.list_dir(".", recursive=True)}
    assert entries[b"\xff\xfe.txt"] == "file" and entries[b"sub\xff"] == "dir" and entries[b"sub\xff/in.txt"] == "file"
    sub = next(e.path for e in sandbox.list_dir() if e.kind == "dir" and os.fsencode(e.path) == b"sub\xff")
    assert [os.fsencode(e.path) for e in sandbox.list_dir(sub)] == [b"sub\xff/in.txt"]  # given back as listed
    assert sandbox.read_file(sub + "/in.txt") == "hi\n"


def test_the_agent_tools_show_names_that_are_not_utf8_as_escapes(sandbox):
    assert sandbox.exec(BAD_NAMES).exit_code == 0
    tools = Toolbox(sandbox)
    listing = tools.execute(parse_tool_call("c1", "list_dir", "{}"))
    assert listing.ok, listing.output
    listing.output.encode("utf-8")  # what a model client sends; a surrogate here raised UnicodeEncodeError
    lines = listing.output.splitlines()
    assert "\\xff\\xfe.txt  (0 B)" in lines and "sub\\xff/" in lines and "  sub\\xff/in.txt  (3 B)" in lines
    found = tools.execute(parse_tool_call("c2", "search", json.dumps({"pattern": "^hi$"})))
    assert found.ok and found.output.endswith("in.txt:1:hi"), found.output
    found.output.encode("utf-8")


def test_an_episode_goes_on_after_listing_names_that_are_not_utf8(sandbox):
    assert sandbox.exec(BAD_NAMES).exit_code == 0
    script = [reply("", call("list_dir", {}, id="a")), reply("", call("submit", {"summary": "looked"}, id="b"))]
    with OpenAIStub(script) as stub:
        trajectory = AgentLoop(OpenAIPolicy(OpenAIConfig(base_url=stub.base_url, timeout_s=10)), sandbox).run(
            build_messages("look around")
        )
    assert trajectory.stop_reason == "submit", trajectory.metadata
    seen = [m["content"] for m in stub.requests[1]["messages"] if m["role"] == "tool"]
    assert len(seen) == 1 and "\\xff\\xfe.txt  (0 B)" in seen[0].splitlines()


# -- a very deep tree -----------------------------------------------------------------------------------


def test_a_recursive_listing_of_a_tree_3000_directories_deep(sandbox, sandbox_backend):
    depth = 3000
    made = sandbox.exec(
        "mkdir -p .git/objects && touch .git/objects/blob && mkdir deep && touch deep/e.txt && "
        "cd deep && python3 -c 'import os\n"
        f'for _ in range({depth}): os.mkdir("d"); os.chdir("d")\n'
        'open("leaf.txt", "w").close()\''
    )
    assert made.exit_code == 0, made.output
    chain = ["deep/" + "/".join(["d"] * k) for k in range(1, depth + 1)]
    expected = [
        ".git",
        "README.md",
        "deep",
        *chain,
        chain[-1] + "/leaf.txt",
        "deep/e.txt",
        "pkg",
        "pkg/__init__.py",
        "pkg/calc.py",
    ]  # sorted, depth first, .git not entered; back up 3000 levels before deep/e.txt
    assert [e.path for e in sandbox.list_dir(".", recursive=True)] == expected
    if sandbox_backend == "namespace":  # its file API runs here, and can be asked for a short listing
        assert [e.path for e in sandbox.files.list(".", recursive=True, max_entries=50)] == expected[:50]
    assert [e.path for e in sandbox.list_dir("deep/d", recursive=True)] == [*chain[1:], chain[-1] + "/leaf.txt"]


DEEP_TREE = (
    'python3 -c \'import os\nfor _ in range(3000): os.mkdir("d"); os.chdir("d")\n'
    'open("leaf.txt", "w").write("bottom")\''
)


@pytest.mark.parametrize("sandbox_backend", [*BACKENDS, "local"])
def test_a_tree_3000_directories_deep_forks_and_closes(repo, config):
    sb = create_sandbox(repo, config)
    assert sb.exec(DEEP_TREE).exit_code == 0
    kids = sb.fork(2)
    assert [kid.exec("find . -name leaf.txt -execdir cat {} +").output for kid in kids] == ["bottom", "bottom"]
    dirs = [sb.dir] + [kid.dir for kid in kids]
    for box in [*kids, sb]:
        box.close()
    assert not any(os.path.exists(d) for d in dirs)


def test_removing_a_tree_stops_at_mount_points_and_symlinks(open_tmp):
    if os.geteuid() != 0:
        pytest.skip("mounts a tmpfs")
    keep = open_tmp / "keep"
    keep.mkdir()
    (keep / "precious").write_text("x")
    doomed = open_tmp / "doomed"
    (doomed / "a" / "mnt").mkdir(parents=True)
    (doomed / "a" / "link").symlink_to(keep)
    mount("tmpfs", str(doomed / "a" / "mnt"), "tmpfs", "size=1m")
    try:
        (doomed / "a" / "mnt" / "inside").write_text("y")
        remove_tree(str(doomed))
        assert (doomed / "a" / "mnt" / "inside").read_text() == "y"  # another filesystem: not entered
        assert not (doomed / "a" / "link").exists()
    finally:
        umount(str(doomed / "a" / "mnt"))
    assert (keep / "precious").read_text() == "x"  # the symlink was removed, not followed
    remove_tree(str(doomed))
    assert not doomed.exists()


def test_a_copy_stacks_layers_the_upper_one_winning(tmp_path):
    lower, upper, out = tmp_path / "lower", tmp_path / "upper", tmp_path / "out"
    (lower / "was_dir").mkdir(parents=True)
    (lower / "was_dir" / "f").write_text("lower")
    (lower / "kept").write_text("lower")
    (lower / "ro").mkdir()
    (lower / "ro" / "f").write_text("lower")
    (lower / "ro").chmod(0o555)
    upper.mkdir()
    (upper / "was_dir").write_text("now a file")
    (upper / "ro").mkdir()
    (upper / "ro" / "g").write_text("upper")
    (upper / "ro").chmod(0o555)
    copy_layer(str(lower), str(out))
    copy_layer(str(upper), str(out))
    assert (out / "was_dir").read_text() == "now a file" and (out / "kept").read_text() == "lower"
    assert sorted(os.listdir(out / "ro")) == ["f", "g"] and stat.S_IMODE((out / "ro").stat().st_mode) == 0o555


# -- a line range of a file too large to read whole -----------------------------------------------------


def test_a_line_range_is_read_from_a_file_too_large_to_read_whole(sandbox):
    filler = MAX_READ_BYTES // 10 + 100_000  # lines of 10 bytes: the file is 1 MB over the cap
    made = sandbox.exec(
        f"{{ printf 'first\\nsecond\\n'; yes xxxxxxxxx | head -n {filler}; printf 'last\\n'; }} > big.txt"
    )
    assert made.exit_code == 0, made.output
    last = 2 + filler + 1
    assert sandbox.read_file("big.txt", 1, 2) == "first\nsecond\n"
    assert sandbox.read_file("big.txt", 2, 3) == "second\nxxxxxxxxx\n"
    assert sandbox.read_file("big.txt", last - 1) == "xxxxxxxxx\nlast\n"
    assert sandbox.read_file("big.txt", last + 1, last + 5) == ""
    with pytest.raises(ValueError, match="larger than"):  # the whole file, as before
        sandbox.read_file("big.txt")
    with pytest.raises(ValueError, match=f"lines 1 to {last} of 'big.txt' are larger than {MAX_READ_BYTES}"):
        sandbox.read_file("big.txt", 1, last)


def test_the_read_file_tool_reads_a_range_of_a_file_too_large_to_read_whole(sandbox):
    made = sandbox.exec(f"{{ yes xxxxxxxxx | head -n {MAX_READ_BYTES // 10 + 1000}; echo tail; }} > big.txt")
    assert made.exit_code == 0, made.output
    tools = Toolbox(sandbox)
    result = tools.execute(
        parse_tool_call("c1", "read_file", json.dumps({"path": "big.txt", "start_line": 3, "end_line": 4}))
    )
    assert result.ok and result.output == "     3\txxxxxxxxx\n     4\txxxxxxxxx", result.output
    last = MAX_READ_BYTES // 10 + 1001
    result = tools.execute(parse_tool_call("c2", "read_file", json.dumps({"path": "big.txt", "start_line": last})))
    assert result.ok and result.output == f"{last:>6}\ttail", result.output
    result = tools.execute(parse_tool_call("c3", "read_file", json.dumps({"path": "big.txt", "start_line": last + 1})))
    assert not result.ok and "past the end" in result.output


def test_a_line_range_counts_lines_as_sed_does(sandbox):
    sandbox.write_file("odd.txt", b"a\rb\x0cc\r\nd\n\xffe")
    assert sandbox.read_file("odd.txt", 1, 1) == "a\rb\x0cc\r\n"  # \r and \f do not end a line; \n does
    assert sandbox.read_file("odd.txt", 2) == "d\n\ufffde"
    assert sandbox.exec("sed -n 2p odd.txt").output == "d\n"
