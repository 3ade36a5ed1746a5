"""The `local` backend (no isolation) keeps the same contract as the default one."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
from helpers import tree_digest

from codefleet.sandbox import PathEscapeError, create_sandbox
from codefleet.sandbox import local as local_backend
from codefleet.types import SearchMatch


@pytest.fixture
def local_config(config):
    return dataclasses.replace(config, backend="local")


@pytest.fixture
def local(repo, local_config):
    sb = create_sandbox(repo, local_config)
    yield sb
    sb.close()


def test_it_says_once_that_it_is_not_isolated(repo, local_config, capfd, monkeypatch):
    monkeypatch.setattr(local_backend, "_said", threading.Event())
    first, second = create_sandbox(repo, local_config), create_sandbox(repo, local_config)
    try:
        said = capfd.readouterr().err.splitlines()
        assert len(said) == 1 and "WITHOUT isolation" in said[0]
        assert first.info.backend == second.info.backend == "local"
        assert first.info.isolated is False
        assert first.info.workspace != repo
    finally:
        first.close()
        second.close()


def test_persistent_shell(local):
    local.exec("cd pkg; export X='x y'; f() { echo fn; }; sleep 60 &")
    result = local.exec('basename "$PWD"; echo "$X"; f; jobs | wc -l')
    assert result.output == "pkg\nx y\nfn\n1\n"
    assert local.exec("echo out; echo err >&2; (exit 4)").output == "out\nerr\n"
    assert local.exec("(exit 4)").exit_code == 4


def test_control_characters_and_large_commands(local):
    text = "A\tB\x01C\x7fD\x1b[AE"
    assert local.exec(f"printf %s '{text}' > ctl.txt").ok
    assert local.read_file("ctl.txt") == text
    assert local.exec(f"printf %s '{'y' * 100_000}' | wc -c").output.strip() == "100000"


def test_exit_then_fresh_shell(local):
    local.exec("cd pkg")
    assert local.exec("exit 3").exit_code == 3
    after = local.exec('basename "$PWD"')
    assert after.shell_restarted
    assert after.output.startswith("workspace\n")


def test_timeout_keeps_the_shell(local):
    local.exec("cd pkg")
    result = local.exec("sleep 60", timeout_s=1)
    assert result.timed_out and result.exit_code == 124
    assert local.exec('basename "$PWD"').output == "pkg\n"


def test_run_oneoff(local):
    local.exec("cd pkg")
    assert local.run_oneoff(["sh", "-c", 'basename "$PWD"']).output == "workspace\n"
    held = local.run_oneoff(["sh", "-c", "sleep 60 & echo started"], timeout_s=20)
    assert held.output == "started\n" and not held.timed_out and held.exit_code == 0
    assert local.run_oneoff(["sleep", "60"], timeout_s=1).exit_code == 124


def test_files(local):
    local.write_file("a/b/c.txt", "one\ntwo\n")
    assert local.exec("cat a/b/c.txt").output == "one\ntwo\n"
    assert local.read_file("a/b/c.txt", 2, 2) == "two\n"
    assert local.read_file("/workspace/a/b/c.txt") == "one\ntwo\n"
    assert [e.path for e in local.list_dir("a", recursive=True)] == ["a/b", "a/b/c.txt"]
    assert local.search("two") == [SearchMatch("a/b/c.txt", 2, "two")]
    with pytest.raises(ValueError):
        local.search("(unclosed")
    local.exec("ln -s /etc/passwd leak && ln -s .. up && mkfifo pipe")
    for path in ("../x", "/etc/passwd", "leak", "up/etc/passwd"):
        with pytest.raises(PathEscapeError):
            local.read_file(path)
    with pytest.raises(ValueError):
        local.read_file("pipe")


def test_fork(local):
    local.exec("rm README.md; mkfifo pipe; mkdir -p sub && cd sub && export K=v")
    a, b = local.fork(2)
    try:
        assert (
            a.exec('basename "$PWD"; echo $K; test -e ../README.md || echo gone; test -p ../pipe && echo fifo').output
            == "sub\nv\ngone\nfifo\n"
        )
        assert a.exec("pwd").output.startswith(a.info.workspace)  # the cwd moved to the child's own copy
        a.write_file("only_a.txt", "a")
        local.write_file("only_parent.txt", "p")
        assert b.exec("test -e only_a.txt || test -e only_parent.txt").exit_code == 1
        assert local.exec("test -e ../only_a.txt").exit_code == 1
    finally:
        a.close()
        b.close()


def test_repository_untouched_and_workspace_removed(repo, local_config):
    before = tree_digest(repo)
    sb = create_sandbox(repo, local_config)
    sb.exec("echo x > README.md; rm -r pkg; mkdir new")
    workspace = sb.info.workspace
    sb.close()
    assert tree_digest(repo) == before
    assert not os.path.exists(workspace)
