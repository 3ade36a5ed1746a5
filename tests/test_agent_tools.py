"""The seven tools against a real sandbox: results, refusals, caps, and parallel execution."""

from __future__ import annotations

import json
import time

import pytest

from codefleet.agent.parallel import execute_calls
from codefleet.agent.policy import parse_tool_call
from codefleet.agent.tools import TOOL_SPECS, Toolbox, ToolConfig, tool_schemas
from codefleet.types import ToolCall


def tc(name: str, id: str = "c1", **args) -> ToolCall:
    return parse_tool_call(id, name, json.dumps(args))


@pytest.fixture
def tools(sandbox) -> Toolbox:
    return Toolbox(sandbox, ToolConfig(max_output_chars=4000, max_argument_chars=20_000))


def test_schemas_have_exactly_the_contract_names_and_arguments():
    schemas = {s["function"]["name"]: s["function"]["parameters"] for s in tool_schemas()}
    assert set(schemas) == {"search", "read_file", "edit_file", "write_file", "list_dir", "run", "submit"}
    expected = {
        "search": (["pattern", "path"], ["pattern"]),
        "read_file": (["path", "start_line", "end_line"], ["path"]),
        "edit_file": (["path", "old_text", "new_text"], ["path", "old_text", "new_text"]),
        "write_file": (["path", "content"], ["path", "content"]),
        "list_dir": (["path"], []),
        "run": (["command", "timeout"], ["command"]),
        "submit": (["summary"], []),
    }
    for name, (props, required) in expected.items():
        assert list(schemas[name]["properties"]) == props, name
        assert schemas[name]["required"] == required, name
        assert all(s["type"] == "function" for s in tool_schemas())
    json.dumps(tool_schemas())  # serialisable as sent over HTTP


def test_search_read_and_list(tools):
    found = tools.execute(tc("search", pattern=r"def (add|sub)"))
    assert found.ok and found.output.splitlines() == ["pkg/calc.py:1:def add(a, b):", "pkg/calc.py:5:def sub(a, b):"]
    assert "no matches" in tools.execute(tc("search", pattern="nothing_like_this")).output
    bad = tools.execute(tc("search", pattern="(unclosed"))
    assert not bad.ok and bad.output.startswith("error:") and "grep -E" in bad.output

    text = tools.execute(tc("read_file", path="pkg/calc.py")).output
    assert text.splitlines()[0] == "     1\tdef add(a, b):" and text.splitlines()[-1] == "     6\t    return a - b"
    assert (
        tools.execute(tc("read_file", path="pkg/calc.py", start_line=5, end_line=5)).output == "     5\tdef sub(a, b):"
    )
    past = tools.execute(tc("read_file", path="pkg/calc.py", start_line=40))
    assert not past.ok and "has 6 lines" in past.output
    missing = tools.execute(tc("read_file", path="pkg/nope.py"))
    assert not missing.ok and "nope.py" in missing.output

    listing = tools.execute(tc("list_dir")).output.splitlines()
    assert "pkg/" in listing and "  pkg/calc.py  (66 B)" in listing and "README.md  (7 B)" in listing


def test_edit_file_replaces_one_occurrence_and_refuses_missing_or_ambiguous(tools, sandbox):
    ok = tools.execute(tc("edit_file", path="pkg/calc.py", old_text="    return a + b", new_text="    return b + a"))
    assert ok.ok and "line 2" in ok.output
    assert "return b + a" in sandbox.read_file("pkg/calc.py")

    before = sandbox.read_file("pkg/calc.py")
    missing = tools.execute(tc("edit_file", path="pkg/calc.py", old_text="return a * b", new_text="x"))
    assert not missing.ok and "not found" in missing.output
    ambiguous = tools.execute(tc("edit_file", path="pkg/calc.py", old_text="(a, b):", new_text="(x, y):"))
    assert not ambiguous.ok and "occurs 2 times" in ambiguous.output
    assert sandbox.read_file("pkg/calc.py") == before  # refused edits change nothing
    same = tools.execute(tc("edit_file", path="pkg/calc.py", old_text="def", new_text="def"))
    assert not same.ok and "identical" in same.output


def test_write_file_run_and_submit(tools, sandbox):
    wrote = tools.execute(tc("write_file", path="new/dir/x.py", content="A = 1\nB = 2\n"))
    assert wrote.ok and "2 lines" in wrote.output
    assert sandbox.read_file("new/dir/x.py") == "A = 1\nB = 2\n"

    ran = tools.execute(tc("run", command="echo hi; (exit 3)"))
    assert ran.output == "hi\n[exit code 3]" and not ran.ok
    tools.execute(tc("run", command="cd pkg && export FOO=bar"))
    assert tools.execute(tc("run", command="pwd; echo $FOO")).output.splitlines()[1:] == ["bar", "[exit code 0]"]
    started = time.perf_counter()
    slow = tools.execute(tc("run", command="sleep 5", timeout=0.5))
    assert time.perf_counter() - started < 4 and "timed out" in slow.output and not slow.ok

    assert tools.execute(tc("submit", summary="done")).output == "submitted"


def test_paths_outside_the_workspace_become_error_observations(tools, sandbox):
    for call in [
        tc("read_file", path="../../../etc/passwd"),
        tc("read_file", path="/etc/passwd"),
        tc("write_file", path="/tmp/evil", content="x"),
        tc("list_dir", path=".."),
        tc("search", pattern="root", path="/etc"),
        tc("edit_file", path="../x", old_text="a", new_text="b"),
    ]:
        result = tools.execute(call)
        assert not result.ok and result.output.startswith("error:") and "workspace" in result.output, call
    sandbox.exec("ln -s /etc/passwd link")
    through_link = tools.execute(tc("read_file", path="link"))
    assert not through_link.ok and "outside the workspace" in through_link.output


@pytest.mark.parametrize(
    "call, expect",
    [
        (ToolCall("c", "read_file", "{nope", error="not json"), "not json"),
        (parse_tool_call("c", "read_file", "{nope"), "not valid JSON"),
        (parse_tool_call("c", "read_file", "[1, 2]"), "must be a JSON object"),
        (tc("frobnicate", path="x"), "unknown tool 'frobnicate'"),
        (tc("read_file"), "needs the argument 'path'"),
        (tc("read_file", path="README.md", start_line="2"), "'start_line' of read_file must be a integer"),
        (tc("read_file", path="README.md", start_line=True), "must be a integer"),
        (tc("run", command=["ls"]), "'command' of run must be a string"),
        (tc("list_dir", path=".", recursive=True), "unknown argument(s) 'recursive'"),
        (tc("write_file", path="big.txt", content="x" * 30_000), "over the cap of 20000"),
        (tc("edit_file", path="README.md", old_text="", new_text="x"), "non-empty old_text"),
        (tc("read_file", path="README.md", start_line=3, end_line=1), "start_line <= end_line"),
        (tc("run", command="ls", timeout=-1), "timeout must be positive"),
        (parse_tool_call("c", "run", '{"command": "sleep 1", "timeout": NaN}'), "must be a finite number, got nan"),
        (parse_tool_call("c", "run", '{"command": "sleep 1", "timeout": Infinity}'), "must be a finite number"),
    ],
)
def test_malformed_calls_become_error_observations(tools, call, expect):
    result = tools.execute(call)
    assert not result.ok and result.output.startswith("error: ") and expect in result.output


def test_null_optional_arguments_mean_not_given(tools):
    result = tools.execute(tc("read_file", path="README.md", start_line=None, end_line=None))
    assert result.ok and result.output == "     1\t# demo"


def test_outputs_are_capped(tools, sandbox):
    flood = tools.execute(tc("run", command="python3 -c \"print('x' * 50000); print('END')\""))
    assert len(flood.output) < 4300 and "characters cut" in flood.output and flood.output.endswith("[exit code 0]")
    sandbox.write_file("long.txt", "".join(f"line {i}\n" for i in range(2000)))
    long = tools.execute(tc("read_file", path="long.txt"))
    assert len(long.output) <= 4000 and "read on with start_line=" in long.output
    last = long.output.splitlines()[-2].split("\t")[0].strip()
    assert f"start_line={int(last) + 1}]" in long.output


def test_a_turns_calls_run_concurrently_in_call_order(tools, sandbox):
    tools.execute(tc("run", command="cd pkg && export GREETING=hello"))
    calls = [
        tc("run", "r1", command="sleep 0.6; echo one $GREETING; pwd"),
        tc("run", "r2", command="sleep 0.6; echo two $GREETING"),
        tc("read_file", "r3", path="calc.py"),  # a path relative to the workspace, not the shell cwd
        tc("read_file", "r4", path="pkg/calc.py", end_line=1),
    ]
    started = time.perf_counter()
    results = execute_calls(tools, calls)
    elapsed_s = time.perf_counter() - started
    assert [r.call_id for r in results] == ["r1", "r2", "r3", "r4"]
    assert elapsed_s < 1.1, elapsed_s  # two 0.6 s commands side by side
    assert all(r.duration_s >= 0.6 for r in results[:2])
    assert results[0].output.splitlines()[:2] == ["one hello", sandbox.exec("pwd").output.strip()]
    assert results[1].output.startswith("two hello")
    assert not results[2].ok and results[3].output == "     1\tdef add(a, b):"


def test_edits_of_one_file_in_one_turn_apply_in_call_order(tools, sandbox):
    calls = [
        tc("edit_file", f"e{i}", path="pkg/calc.py", old_text=old, new_text=new)
        for i, (old, new) in enumerate(
            [("def add", "def plus"), ("def plus(a, b)", "def plus(x, y)"), ("def sub", "def minus")]
        )
    ]
    results = execute_calls(tools, calls)
    assert all(r.ok for r in results), [r.output for r in results]
    text = sandbox.read_file("pkg/calc.py")
    assert "def plus(x, y):" in text and "def minus(a, b):" in text
    assert set(TOOL_SPECS) >= {c.name for c in calls}


def test_line_numbers_follow_newlines_only_and_crlf_files_can_be_edited(tools, sandbox):
    sandbox.write_file("dos.txt", b"one\r\ntwo\x0cstill two\r\nthree\r\n")
    assert tools.execute(tc("read_file", path="dos.txt")).output.split("\n") == [
        "     1\tone",
        "     2\ttwo\x0cstill two",
        "     3\tthree",
    ]
    edited = tools.execute(tc("edit_file", path="dos.txt", old_text="one\ntwo", new_text="uno\ndos"))
    assert edited.ok, edited.output
    assert sandbox.read_file("dos.txt") == "uno\r\ndos\x0cstill two\r\nthree\r\n"


def test_edit_file_keeps_bytes_that_are_not_utf8_intact(tools, sandbox):
    sandbox.write_file("latin.txt", b"caf\xe9 au lait\nprice = 1\nna\xefve\n")
    assert tools.execute(tc("read_file", path="latin.txt")).output.split("\n")[0] == "     1\tcaf\ufffd au lait"
    edited = tools.execute(tc("edit_file", path="latin.txt", old_text="price = 1", new_text="price = 2"))
    assert edited.ok, edited.output
    raw = sandbox.exec('python3 -c \'print(open("latin.txt", "rb").read())\'').output.strip()
    assert raw == repr(b"caf\xe9 au lait\nprice = 2\nna\xefve\n")  # only the edited line changed
    replaced = tools.execute(tc("edit_file", path="latin.txt", old_text="caf\ufffd", new_text="coffee"))
    assert not replaced.ok and "not UTF-8" in replaced.output


def test_search_and_list_dir_leave_out_the_harness_directory(sandbox):
    from codefleet.agent import workspace

    tools = Toolbox(sandbox, ToolConfig(max_search_matches=5))
    workspace.snapshot(sandbox)
    sandbox.write_file(".codefleet/git/notes.txt", "needle\n" * 40)  # more lines than the cap
    sandbox.write_file("pkg/hay.py", "needle = 1\n")
    assert tools.execute(tc("search", pattern="needle")).output == "pkg/hay.py:1:needle = 1"
    assert "codefleet" not in tools.execute(tc("search", pattern="HEAD|ref|exclude")).output
    listing = tools.execute(tc("list_dir")).output
    assert "pkg/" in listing and ".codefleet" not in listing
