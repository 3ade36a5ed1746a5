"""Every `codefleet` command says what it does in one line, and its help costs no heavy import."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from codefleet.cli import COMMANDS, build_parser


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    """(path, parser, help line) of every subcommand below `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield (*path, name), sub, helps.get(name)
                yield from _commands(sub, (*path, name))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_each_command_and_subcommand_has_a_one_line_help(command):
    parser = build_parser([command])
    found = [(path, sub, line) for path, sub, line in _commands(parser) if path[0] == command]
    assert found
    for path, sub, line in found:
        assert line and "\n" not in line, f"codefleet {' '.join(path)} has no one-line help"
        assert sub.description or len(path) == 1 or sub._subparsers, (
            f"codefleet {' '.join(path)} --help: no description"
        )
    assert found[0][2] == COMMANDS[command][1], "cli.COMMANDS and the command's own parser disagree on its help"


def test_the_top_level_help_lists_every_command_with_its_line(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser(["--help"]).parse_args(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name in (*COMMANDS, "sandbox", "bench"):
        assert name in out


def test_codefleet_help_and_sandbox_help_import_neither_torch_nor_ray():
    code = (
        "import sys; from codefleet.cli import build_parser; build_parser(['sandbox', 'run']); "
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
