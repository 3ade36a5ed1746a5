"""The file API, on every backend: reads, writes, listings and search, all confined
to /workspace however a path (or a symlink planted inside the sandbox) tries to leave it."""

from __future__ import annotations

import os
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import BACKENDS

from codefleet.sandbox import PathEscapeError
from codefleet.types import FileEntry, SearchMatch


@pytest.fixture(params=BACKENDS)
def sandbox_backend(request):
    """Each test of a sandbox here runs against every backend (the vm one under `-m vm`)."""
    return request.param


CALC = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"


def _finishes(fn, *args):
    """Run fn in a thread and give its result; fails (instead of hanging the suite) if it blocks."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result(timeout=20)


def test_read_file_whole_and_by_line_range(sandbox):
    assert sandbox.read_file("pkg/calc.py") == CALC
    assert sandbox.read_file("pkg/calc.py", 2, 2) == "    return a + b\n"
    assert sandbox.read_file("pkg/calc.py", 5, 6) == "def sub(a, b):\n    return a - b\n"
    assert sandbox.read_file("pkg/calc.py", start_line=5) == "def sub(a, b):\n    return a - b\n"
    assert sandbox.read_file("pkg/calc.py", end_line=1) == "def add(a, b):\n"
    assert sandbox.read_file("pkg/calc.py", 50, 60) == ""


def test_read_file_errors(sandbox):
    with pytest.raises(FileNotFoundError):
        sandbox.read_file("missing.txt")
    with pytest.raises(IsADirectoryError):
        sandbox.read_file("pkg")


def test_write_file_creates_parent_directories_and_is_seen_by_the_shell(sandbox):
    sandbox.write_file("new/deeper/still/notes.txt", "first\n")
    assert sandbox.exec("cat new/deeper/still/notes.txt").output == "first\n"
    sandbox.write_file("new/deeper/still/notes.txt", "2\n")  # replaces, no leftover bytes
    assert sandbox.read_file("new/deeper/still/notes.txt") == "2\n"
    sandbox.write_file("blob.bin", b"\x00\xff\x01")
    assert sandbox.exec("od -An -tx1 blob.bin").output.split() == ["00", "ff", "01"]


def test_absolute_workspace_paths_work(sandbox):
    sandbox.write_file("/workspace/abs/a.txt", "via absolute\n")
    assert sandbox.read_file("/workspace/abs/a.txt") == "via absolute\n"
    assert sandbox.read_file("abs/a.txt") == "via absolute\n"
    assert [e.path for e in sandbox.list_dir("/workspace/abs")] == ["abs/a.txt"]
    assert sandbox.read_file("/workspace/pkg/../README.md") == "# demo\n"


def test_list_dir(sandbox):
    sandbox.exec("mkdir -p .git/objects && echo x > .git/objects/blob && ln -s pkg pkglink && mkfifo pipe")
    top = {e.path: e for e in sandbox.list_dir()}
    assert set(top) == {".git", "README.md", "pkg", "pkglink", "pipe"}
    assert top["README.md"] == FileEntry("README.md", "file", len("# demo\n"))
    assert top["pkg"].kind == "dir" and top["pkglink"].kind == "symlink" and top["pipe"].kind == "other"

    everything = [e.path for e in sandbox.list_dir(".", recursive=True)]
    assert "pkg/calc.py" in everything and "pkg/__init__.py" in everything
    assert ".git" in everything and ".git/objects" not in everything  # .git is listed, not walked
    assert [e.path for e in sandbox.list_dir("pkg")] == ["pkg/__init__.py", "pkg/calc.py"]
    assert [e.path for e in sandbox.list_dir("pkg/../pkg")] == ["pkg/__init__.py", "pkg/calc.py"]


def test_search_returns_path_line_and_text(sandbox):
    matches = sandbox.search(r"def (add|sub)")
    assert matches == [SearchMatch("pkg/calc.py", 1, "def add(a, b):"), SearchMatch("pkg/calc.py", 5, "def sub(a, b):")]
    assert sandbox.search("demo", "README.md") == [SearchMatch("README.md", 1, "# demo")]  # one file
    assert [m.line_number for m in sandbox.search("return", "pkg")] == [2, 6]
    assert sandbox.search("no such text anywhere") == []
    assert len(sandbox.search("a", max_matches=1)) == 1


def test_search_details(sandbox):
    sandbox.exec(
        "mkdir .git && echo 'needle' > .git/config && echo '-needle-' > dash.txt && "
        "echo needle > secret.txt && chmod 000 secret.txt"
    )
    assert sandbox.search("-needle") == [SearchMatch("dash.txt", 1, "-needle-")]  # a pattern may start with '-'
    # .git is skipped; an unreadable file is skipped rather than failing the search
    assert [m.path for m in sandbox.search("needle")] == ["dash.txt"]


def test_search_refuses_a_bad_regex_clearly(sandbox):
    with pytest.raises(ValueError, match=r"search for 'def \(add' failed: grep: Unmatched \( .*grep -E syntax"):
        sandbox.search("def (add")


@pytest.mark.parametrize(
    "path", ["../x", "pkg/../../x", "/etc/passwd", "/workspacex/a", "/workspace/../etc/passwd", "/", "a\x00b"]
)
def test_paths_outside_the_workspace_are_refused(sandbox, path):
    with pytest.raises(PathEscapeError):
        sandbox.read_file(path)
    with pytest.raises(PathEscapeError):
        sandbox.write_file(path, "x")
    with pytest.raises(PathEscapeError):
        sandbox.list_dir(path)
    with pytest.raises(PathEscapeError):
        sandbox.search("root", path)


def test_symlinks_pointing_out_are_refused(sandbox):
    host_target = f"/tmp/codefleet-escape-{uuid.uuid4().hex}"
    assert sandbox.exec(
        f"ln -s /etc/passwd leak && ln -s .. up && ln -s / root && ln -s /etc etcdir && "
        f"ln -s {host_target} dangling && mkdir d && ln -s ../../etc d/out"
    ).ok
    for path in ("leak", "up/etc/passwd", "root/etc/passwd", "etcdir/passwd", "d/out/passwd", "up/workspace/leak"):
        with pytest.raises(PathEscapeError):
            sandbox.read_file(path)
    with pytest.raises(PathEscapeError, match="leak"):  # the message names the path the caller gave
        sandbox.read_file("leak")
    for path in ("leak", "up/evil", "root/tmp/evil", "dangling", "d/out/evil"):
        with pytest.raises(PathEscapeError):
            sandbox.write_file(path, "pwned\n")
    for path in ("up", "root", "etcdir"):
        with pytest.raises(PathEscapeError):
            sandbox.list_dir(path)
        with pytest.raises(PathEscapeError):
            sandbox.search("root", path)
    assert not os.path.exists(host_target)
    assert sandbox.exec("readlink leak").output == "/etc/passwd\n"  # the links themselves are untouched


def test_symlinks_that_stay_inside_work(sandbox):
    assert sandbox.exec(
        "ln -s pkg/calc.py calc_link && ln -s pkg pkglink && ln -s /workspace/README.md abs_readme"
        " && mkdir d && ln -s ../README.md d/readme && ln -s ../pkg d/pkg"
    ).ok
    assert sandbox.read_file("calc_link") == CALC
    assert sandbox.read_file("pkglink/calc.py") == CALC
    assert sandbox.read_file("abs_readme") == "# demo\n"
    assert sandbox.read_file("d/readme") == "# demo\n"
    assert sandbox.read_file("d/pkg/calc.py", 1, 1) == "def add(a, b):\n"
    sandbox.write_file("d/readme", "# through a link\n")
    assert sandbox.exec("cat README.md").output == "# through a link\n"
    assert {e.path for e in sandbox.list_dir("pkglink")} == {"pkg/__init__.py", "pkg/calc.py"}
    assert [m.path for m in sandbox.search("def add", "pkglink")] == ["pkg/calc.py"]


def test_fifos_never_hang_the_file_api(sandbox):
    assert sandbox.exec("mkfifo pipe").ok
    with pytest.raises(ValueError, match="not a regular file"):
        _finishes(sandbox.read_file, "pipe")
    with pytest.raises(ValueError, match="not a regular file"):
        _finishes(sandbox.write_file, "pipe", "x")
    assert _finishes(sandbox.search, "x") == []
    assert _finishes(sandbox.search, "x", "pipe") == []
