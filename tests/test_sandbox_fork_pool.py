"""fork(n) and the warm pool, on every backend: children start from the parent's
current state, nobody shares later changes, and the repository itself is never written."""

from __future__ import annotations

import pytest
from helpers import BACKENDS, namespace_only, tree_digest

from codefleet.sandbox import SandboxClosedError, SandboxPool, create_sandbox


@pytest.fixture(params=BACKENDS)
def sandbox_backend(request):
    """Each test of a sandbox here runs against every backend (the vm one under `-m vm`)."""
    return request.param


def _close_all(sandboxes):
    for sb in sandboxes:
        sb.close()


def test_children_start_from_the_parents_current_filesystem(sandbox):
    assert sandbox.exec(
        "rm README.md && mkdir -p newdir/sub && echo n > newdir/sub/f && "
        "rm -rf pkg && mkdir pkg && echo fresh > pkg/only.txt"
    ).ok
    children = sandbox.fork(2)
    try:
        for child in children:
            with pytest.raises(FileNotFoundError):
                child.read_file("README.md")  # a deleted repo file stays deleted (whiteout)
            assert child.exec("test -e README.md").exit_code == 1
            assert child.read_file("newdir/sub/f") == "n\n"
            assert [e.path for e in child.list_dir("pkg")] == ["pkg/only.txt"]  # a replaced dir hides the old one
    finally:
        _close_all(children)


def test_children_are_independent_of_each_other_and_of_the_parent(sandbox):
    sandbox.write_file("shared.txt", "before fork\n")
    a, b = sandbox.fork(2)
    try:
        a.write_file("shared.txt", "changed by a\n")
        a.exec("rm pkg/calc.py")
        sandbox.write_file("later.txt", "parent after fork\n")
        sandbox.exec("echo parent >> shared.txt")
        assert b.read_file("shared.txt") == "before fork\n"
        assert b.read_file("pkg/calc.py").startswith("def add")
        assert b.exec("test -e later.txt").exit_code == 1
        assert a.exec("test -e later.txt").exit_code == 1
        assert sandbox.read_file("shared.txt") == "before fork\nparent\n"  # the parent keeps working
        assert sandbox.read_file("pkg/calc.py").startswith("def add")
        assert len({sandbox.id, a.id, b.id}) == 3
    finally:
        _close_all([a, b])


def test_children_inherit_cwd_and_exported_variables(sandbox):
    sandbox.exec("mkdir -p 'sub dir' && cd 'sub dir' && export FOO='a b' MULTI=$'line1\\nline2' QUOTE=\"it's\"")
    (child,) = sandbox.fork(1)
    try:
        result = child.exec('pwd; printf "%s|%s|%s\\n" "$FOO" "$MULTI" "$QUOTE"')
        assert result.output == "/workspace/sub dir\na b|line1\nline2|it's\n"
        assert not result.shell_restarted
    finally:
        child.close()
    assert sandbox.exec("pwd").output == "/workspace/sub dir\n"


def test_fork_of_a_fork(sandbox):
    sandbox.write_file("gen.txt", "0\n")
    (child,) = sandbox.fork(1)
    child.exec("echo 1 >> gen.txt && cd pkg")
    grandchildren = child.fork(2)
    try:
        for g in grandchildren:
            assert g.read_file("gen.txt") == "0\n1\n"
            assert g.exec("pwd").output == "/workspace/pkg\n"
        grandchildren[0].write_file("gen.txt", "mine\n")
        assert grandchildren[1].read_file("gen.txt") == "0\n1\n"
        assert child.read_file("gen.txt") == "0\n1\n"
        assert sandbox.read_file("gen.txt") == "0\n"
    finally:
        _close_all(grandchildren + [child])


def test_closing_the_parent_does_not_break_children(repo, config):
    parent = create_sandbox(repo, config)
    parent.write_file("from_parent.txt", "kept\n")
    children = parent.fork(2)
    parent.close()
    try:
        for child in children:
            assert child.read_file("from_parent.txt") == "kept\n"
            assert child.exec("cat from_parent.txt && echo more >> from_parent.txt").ok
        (grandchild,) = children[0].fork(1)
        assert grandchild.read_file("from_parent.txt") == "kept\nmore\n"
        grandchild.close()
    finally:
        _close_all(children)


@pytest.mark.slow
@namespace_only  # a vm's fork copies a disk image, never host files; its children are tested above
def test_fork_copies_safely_while_the_parent_churns_its_files(sandbox, tmp_path):
    """fork() copies the parent's changes while its processes still run: one that renames,
    deletes and swaps directories for symlinks to host paths meanwhile must neither fail the
    fork nor get a host file copied into the children."""
    secret_dir = tmp_path / "host-only"
    secret_dir.mkdir()
    (secret_dir / "secret.txt").write_text("HOST-SECRET\n")
    assert sandbox.exec("mkdir big && (cd big && python3 -c \"\nfor i in range(2000): open(str(i), 'w')\n\")").ok
    sandbox.write_file(
        "churn.py",
        f"""
import os
names = ["r%d" % i for i in range(8)]
for n in names:
    os.mkdir(n)
while True:
    for n in names:
        os.rename(n, n + ".real"); os.symlink({str(secret_dir)!r}, n); os.unlink(n); os.rename(n + ".real", n)
""",
    )
    assert sandbox.exec("python3 churn.py >/tmp/churn.log 2>&1 & sleep 0.3").ok
    for _ in range(8):
        (child,) = sandbox.fork(1)
        try:
            assert child.exec("grep -rl HOST-SECRET . ; ls -R r* 2>/dev/null | grep secret").output == ""
        finally:
            child.close()
    assert sandbox.exec("kill %1").ok, sandbox.exec("cat /tmp/churn.log").output


def test_fork_needs_a_positive_count(sandbox):
    with pytest.raises(ValueError):
        sandbox.fork(0)


def test_the_repository_is_never_modified(repo, config):
    before = tree_digest(repo)
    sb = create_sandbox(repo, config)
    sb.exec(
        "echo x >> README.md && rm pkg/calc.py && chmod 700 pkg && mkdir new && ln -s README.md link && "
        "touch pkg/__init__.py"
    )
    sb.write_file("pkg/__init__.py", "changed")
    children = sb.fork(2)
    children[0].exec("rm -rf pkg README.md && echo y > z")
    children[1].write_file("README.md", "overwritten")
    sb.close()
    _close_all(children)
    assert tree_digest(repo) == before


def _recording_factory(created):
    def factory(repo, config):
        sb = create_sandbox(repo, config)
        created.append(sb)
        return sb

    return factory


def test_pool_hands_out_ready_sandboxes_and_refills(repo, config):
    created = []
    with SandboxPool(repo, config, size=2, factory=_recording_factory(created)) as pool:
        assert pool.wait_full(30)
        a = pool.acquire()
        b = pool.acquire()
        try:
            assert a.alive() and b.alive() and a is not b
            assert a.exec("cat README.md").output == "# demo\n"
            a.write_file("mine.txt", "a\n")
            assert b.exec("test -e mine.txt").exit_code == 1
            assert pool.wait_full(30)  # refilled in the background
            assert pool.ready_count() == 2
            assert len(created) == 4
        finally:
            _close_all([a, b])


def test_pool_drops_sandboxes_that_died_while_waiting(repo, config):
    created = []
    with SandboxPool(repo, config, size=2, factory=_recording_factory(created)) as pool:
        assert pool.wait_full(30)
        dead = created[0]
        dead.exec("exit 0")
        assert not dead.alive()
        got = [pool.acquire(), pool.acquire()]
        try:
            assert dead not in got
            assert all(sb.alive() for sb in got)
            with pytest.raises(SandboxClosedError):  # the pool closed the one it dropped
                dead.exec("true")
        finally:
            _close_all(got)


def test_pool_close_closes_waiting_sandboxes(repo, config):
    created = []
    pool = SandboxPool(repo, config, size=2, factory=_recording_factory(created))
    assert pool.wait_full(30)
    taken = pool.acquire()
    pool.close()
    try:
        waiting = [sb for sb in created if sb is not taken]
        assert waiting
        for sb in waiting:
            with pytest.raises(SandboxClosedError):
                sb.exec("true")
        assert taken.exec("echo still mine").output == "still mine\n"
        with pytest.raises(SandboxClosedError):
            pool.acquire()
    finally:
        taken.close()
