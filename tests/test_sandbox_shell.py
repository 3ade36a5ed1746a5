"""The persistent shell, on every backend: state between commands, exit codes,
output, command text of every shape, timeouts and shell restarts."""

from __future__ import annotations

import dataclasses
import re

import pytest
from helpers import BACKENDS

from codefleet.sandbox import SandboxClosedError, SandboxConfig, create_sandbox
from codefleet.sandbox.shell import OutputCollector


@pytest.fixture(params=BACKENDS)
def sandbox_backend(request):
    """Each test of a sandbox here runs against every backend (the vm one under `-m vm`)."""
    return request.param


def test_cwd_env_and_functions_persist_between_commands(sandbox):
    assert sandbox.exec("cd pkg && export GREETING='hello world' && LOCAL=kept").ok
    assert sandbox.exec('greet() { echo "$GREETING from $(basename $PWD)"; }').ok
    result = sandbox.exec("pwd; echo $LOCAL; greet")
    assert result.output == "/workspace/pkg\nkept\nhello world from pkg\n"
    assert result.exit_code == 0 and not result.timed_out and not result.shell_restarted


def test_background_jobs_survive_between_commands(sandbox):
    assert sandbox.exec("sleep 60 & echo $! > /tmp/job.pid").ok
    result = sandbox.exec("kill -0 $(cat /tmp/job.pid) && echo running; jobs")
    assert result.output.startswith("running\n")
    assert "sleep 60" in result.output
    assert sandbox.exec("kill %1; wait %1; jobs | wc -l").output.strip() == "0"


def test_exit_codes(sandbox):
    assert sandbox.exec("true").exit_code == 0
    assert sandbox.exec("false").exit_code == 1
    assert sandbox.exec("(exit 42)").exit_code == 42
    assert sandbox.exec("sh -c 'kill -9 $$'").exit_code == 137
    failed = sandbox.exec("ls /no/such/dir")
    assert failed.exit_code == 2 and not failed.ok
    assert "No such file or directory" in failed.output


def test_stdout_and_stderr_are_merged_in_write_order(sandbox):
    assert sandbox.exec("echo 1; echo 2 >&2; echo 3; echo 4 >&2").output == "1\n2\n3\n4\n"
    script = (
        "import sys\nfor i in range(3):\n"
        "    print(f'out{i}', flush=True)\n    print(f'err{i}', file=sys.stderr, flush=True)"
    )
    result = sandbox.exec(f'python3 -c "{script}"')
    assert result.output == "out0\nerr0\nout1\nerr1\nout2\nerr2\n"


def test_multiline_commands_and_quoting(sandbox):
    command = 'for f in a b; do\n  echo "item $f"\ndone\nif true; then\n  echo yes\nfi'
    assert sandbox.exec(command).output == "item a\nitem b\nyes\n"
    quoted = sandbox.exec("""echo "it's" 'say "hi"' $'tab\\there' "back\\\\slash" '}' '{ eval'""")
    assert quoted.output == 'it\'s say "hi" tab\there back\\slash } { eval\n'


@pytest.mark.parametrize(
    "broken", ["grep -rl 'abc .", "echo $((1 +", "if true; then echo x", 'echo "abc', "( echo x", "case x in"]
)
def test_a_syntax_error_answers_at_once_and_the_next_command_runs(sandbox, broken):
    """A syntax error once left interactive bash parsing the next protocol line out of command position: that
    command's marker never came and it hung until its timeout (a policy's unbalanced quote cost 60 s)."""
    result = sandbox.exec(broken, timeout_s=5)
    assert not result.timed_out and result.exit_code == 2 and "unexpected" in result.output
    for command in ("echo after", "{ echo grouped; }"):
        after = sandbox.exec(command, timeout_s=5)
        assert not after.timed_out and after.exit_code == 0 and after.output.strip() in ("after", "grouped")


def test_heredocs(sandbox):
    literal = sandbox.exec("cat <<'EOF'\n$HOME 'single' \"double\" `date` \\\nEOF")
    assert literal.output == "$HOME 'single' \"double\" `date` \\\n"
    expanded = sandbox.exec("X=42\ncat <<EOF\nvalue=$X\nEOF")
    assert expanded.output == "value=42\n"
    sandbox.exec("cat > script.py <<'PY'\nimport sys\nprint('from heredoc', sys.argv[1])\nPY")
    assert sandbox.exec("python3 script.py ok").output == "from heredoc ok\n"


def test_control_characters_reach_the_command_unedited(sandbox):
    # TAB, ^A, DEL, ESC sequences, ^X^X and CR once were eaten by the shell's line editor.
    text = "A\tB\x01C\x7fD\x1b[AE\x18\x18F\rG\x04H"
    result = sandbox.exec(f"printf %s '{text}' > ctl.txt; echo done")
    assert result.output == "done\n"
    assert sandbox.read_file("ctl.txt") == text
    assert sandbox.exec("echo still alive").output == "still alive\n"


def test_commands_starting_with_a_dash_are_commands(sandbox):
    result = sandbox.exec("-x")
    assert result.exit_code == 127
    assert "-x: command not found" in result.output
    assert sandbox.exec("--help; echo after").output.endswith("after\n")


def test_stdin_is_empty(sandbox):
    result = sandbox.exec("cat; read line; echo read=$? line=$line")
    assert result.output == "read=1 line=\n"


def test_exit_reports_its_status_and_the_next_command_gets_a_fresh_shell(sandbox):
    sandbox.exec("cd pkg && export KEEP=1 && echo saved > /workspace/kept.txt")
    result = sandbox.exec("echo bye; exit 3")
    assert result.exit_code == 3
    assert not result.timed_out
    assert result.output.startswith("bye\n")
    assert "shell exited (status 3)" in result.output
    assert not sandbox.alive()

    after = sandbox.exec("pwd; echo KEEP=$KEEP; cat kept.txt")
    assert after.shell_restarted
    assert after.exit_code == 0
    assert after.output.startswith("/workspace\nKEEP=\nsaved\n")  # cwd and env reset, files kept
    assert sandbox.alive()
    assert not sandbox.exec("true").shell_restarted


@pytest.mark.parametrize(
    "command",
    [
        "printf() { echo fake; }",
        "eval() { echo evil; }",
        ":() { echo colon; }",
        "alias printf=echo",
        "alias eval=echo",
        "alias '{'=echo",
        "exec >/dev/null",
        "exec 1>&-",
        "exec 2>&- 0<&-",
    ],
)
def test_the_commands_own_functions_aliases_and_redirections_leave_the_protocol_alone(sandbox, command):
    """A command may redefine printf or eval, alias `{` or redirect the shell's own stdout for good:
    the next command still runs, at once, in the same shell (cwd kept)."""
    assert sandbox.exec("cd pkg").ok
    sandbox.exec(command, timeout_s=5)
    result = sandbox.exec("echo ping; pwd", timeout_s=5)
    assert result.output == "ping\n/workspace/pkg\n", result.output
    assert result.exit_code == 0 and not result.timed_out and not result.shell_restarted


def test_a_killed_shell_is_replaced(sandbox):
    sandbox.exec("kill -9 $$")
    result = sandbox.exec("echo back")
    assert result.shell_restarted and result.output.startswith("back\n")


def test_run_oneoff_runs_outside_the_shell(sandbox):
    sandbox.exec("cd pkg && export ONLY_IN_SHELL=1 && echo new > /workspace/made_in_shell.txt")
    result = sandbox.run_oneoff(["sh", "-c", "pwd; echo var=$ONLY_IN_SHELL; cat made_in_shell.txt"])
    assert result.output == "/workspace\nvar=\nnew\n"
    assert sandbox.run_oneoff(["sh", "-c", "exit 5"]).exit_code == 5
    assert sandbox.exec("pwd").output == "/workspace/pkg\n"  # the shell is untouched


def test_run_oneoff_returns_when_the_process_exits_even_if_a_child_holds_the_pipe(sandbox):
    result = sandbox.run_oneoff(["sh", "-c", "sleep 60 & echo started"], timeout_s=20)
    assert result.output == "started\n"
    assert result.exit_code == 0 and not result.timed_out


def test_run_oneoff_timeout(sandbox):
    result = sandbox.run_oneoff(["sleep", "60"], timeout_s=1)
    assert result.timed_out and result.exit_code == 124
    assert "timed out" in result.output


def test_large_command_text(sandbox):
    payload = "x" * 100_000
    assert sandbox.exec(f"printf %s '{payload}' | wc -c").output.strip() == "100000"
    lines = "\n".join(f"line {i} with 'quotes' and \"doubles\" and $dollars" for i in range(2500))
    assert len(lines) > 100_000
    result = sandbox.exec(f"cat > big.txt <<'EOF'\n{lines}\nEOF\nwc -l < big.txt")
    assert result.output.strip() == "2500"
    assert sandbox.read_file("big.txt") == lines + "\n"


def test_timeout_kills_the_command_and_keeps_the_shell(sandbox):
    sandbox.exec("cd pkg; export STATE=kept; sleep 60 &")
    for command in ("sleep 60", "while true; do :; done"):
        result = sandbox.exec(command, timeout_s=1)
        assert result.timed_out and result.exit_code == 124
        assert "timed out" in result.output
    after = sandbox.exec("pwd; echo $STATE; jobs | wc -l")
    assert after.output == "/workspace/pkg\nkept\n1\n"  # the earlier background job was spared
    assert not after.shell_restarted


def test_long_output_keeps_head_and_tail(repo, config):
    with create_sandbox(repo, dataclasses.replace(config, output_limit_bytes=1000)) as sb:
        result = sb.exec("seq 1 100000")
    assert result.truncated and result.cut_bytes > 0
    assert result.output.startswith("1\n2\n3\n")
    assert result.output.endswith("99999\n100000\n")
    assert "bytes of output cut" in result.output
    assert len(result.output) < 2000


def test_binary_output_is_decoded_with_replacement(sandbox):
    result = sandbox.exec("printf '\\377\\376 ok \\303\\251\\n'")
    assert result.output == "\ufffd\ufffd ok é\n"


def test_config_env_is_exported(repo, config):
    env = {"PLAIN": "a b", "TRICKY": "it's\ta\nmulti-line $value"}
    with create_sandbox(repo, dataclasses.replace(config, env=env)) as sb:
        assert sb.exec('printf "%s|%s" "$PLAIN" "$TRICKY"').output == "a b|it's\ta\nmulti-line $value"


@pytest.mark.filterwarnings("ignore:codefleet local sandbox")
@pytest.mark.parametrize("name", ["A B", "X=1; echo injected; B", "1ST", "", "PATH\n"])
def test_config_env_names_must_be_variable_names(repo, config, name):
    with pytest.raises(ValueError, match=f"SandboxConfig.env: {re.escape(repr(name))} is not a variable name"):
        SandboxConfig(env={name: "v"})
    with pytest.raises(ValueError, match="not a variable name"):
        dataclasses.replace(config, env={"OK_1": "v", name: "v"})
    for backend in ("auto", "local", config.backend):
        changed = dataclasses.replace(config, backend=backend, env={})
        changed.env[name] = "v"  # changed after the config was checked: refused before any shell sees it
        with pytest.raises(ValueError, match="not a variable name"):
            create_sandbox(repo, changed)


def test_info_reports_isolation(sandbox, sandbox_backend):
    assert sandbox.info.backend == sandbox_backend
    assert sandbox.info.isolated
    assert sandbox.info.workspace == "/workspace"


def test_a_closed_sandbox_refuses_commands(repo, config):
    sb = create_sandbox(repo, config)
    sb.close()
    sb.close()  # idempotent
    assert not sb.alive()
    with pytest.raises(SandboxClosedError):
        sb.exec("true")
    with pytest.raises(SandboxClosedError):
        sb.read_file("README.md")


# -- the protocol -----------------------------------------------------------------------


def test_stdout_and_stderr_are_merged_in_order(make_sandbox):
    sb = make_sandbox()
    result = sb.exec("for i in 1 2 3; do echo out$i; echo err$i >&2; done; ls /nonexistent")
    assert result.output == (
        "out1\nerr1\nout2\nerr2\nout3\nerr3\nls: cannot access '/nonexistent': No such file or directory\n"
    )
    assert result.exit_code == 2


def test_exit_codes_of_signals_pipes_and_exit(make_sandbox):
    sb = make_sandbox()
    assert [sb.exec(c).exit_code for c in ("true", "false", "(exit 42)", "sh -c 'kill -9 $$'", "yes | head -1")] == [
        0,
        1,
        42,
        137,
        0,
    ]
    assert sb.exec("yes | head -n 2").output == "y\ny\n"  # no shell noise when yes dies of SIGPIPE
    gone = sb.exec("exit 3")
    assert gone.exit_code == 3 and "the shell exited (status 3)" in gone.output
    back = sb.exec("echo back")
    assert back.shell_restarted and back.output.startswith("back\n")
    sb.exec("trap '' INT")  # the shell itself ignores the interrupt (set first: not raced by the timeout)
    stuck = sb.exec("while :; do :; done", timeout_s=1)
    assert stuck.timed_out and "ignored the interrupt, so codefleet ended the shell" in stuck.output
    assert "the shell exited" not in stuck.output and sb.exec("echo back").shell_restarted


@pytest.mark.parametrize("limit", [10, 101, 1000, 65536])
def test_output_cap_keeps_head_and_tail(make_sandbox, limit):
    sb = make_sandbox(output_limit_bytes=limit)
    full = "".join(f"{i}\n" for i in range(1, 100001)).encode()
    result = sb.exec("seq 1 100000")
    head, tail = full[: limit // 2], full[len(full) - (limit - limit // 2) :]
    cut = len(full) - limit
    assert (result.truncated, result.cut_bytes) == (True, cut)
    assert result.output == (head + f"\n[... {cut} bytes of output cut ...]\n".encode() + tail).decode()


def test_output_cap_with_the_marker_split_anywhere():
    """The end marker may arrive cut at any byte: the output is the same."""
    prefix = b"\x1eabcdef:7:"
    body = bytes(range(32, 127)) * 3
    stream = body + prefix + b"-12\x1elate"
    for limit in (8, 64, 10_000):
        expected = OutputCollector(limit, prefix)
        assert expected.feed(stream)
        want = expected.result()
        for split in range(1, len(stream)):
            out = OutputCollector(limit, prefix)
            if out.feed(stream[:split]):
                late = out.leftover + stream[split:]
            else:
                assert out.feed(stream[split:])
                late = out.leftover
            assert out.exit_code == -12 and late == b"late"
            assert out.result() == want, (limit, split)
    assert want == (body.decode(), False, 0)


def test_invalid_utf8_is_replaced(make_sandbox):
    sb = make_sandbox()
    result = sb.exec(r"printf 'caf\303\251 \377\376 end\n'")
    assert result.output == "café \ufffd\ufffd end\n"


def test_the_sandbox_can_be_interrupted_when_codefleet_runs_with_sigint_ignored(make_sandbox):
    """`nohup codefleet train &` starts codefleet with SIGINT ignored, which exec passes on; the sandbox's shell
    must still be interruptible, or a timed-out command in the shell itself cannot be stopped."""
    import signal

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        sb = make_sandbox()
        ignored = int(sb.exec("sed -n 's/^SigIgn:[[:space:]]*//p' /proc/$$/status").output.strip(), 16)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not ignored & (1 << (signal.SIGINT - 1))  # (an interactive bash ignores SIGQUIT itself)
    sb.exec("trap '' INT")
    assert "ignored the interrupt" in sb.exec("while :; do :; done", timeout_s=1).output  # trap works again
