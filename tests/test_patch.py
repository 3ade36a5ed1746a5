"""Unified diffs: parse, replay as edits, apply, make — checked against git itself."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import read_tree

from codefleet.tasks.patch import (
    PatchError,
    apply_file_diff,
    apply_unified_diff,
    make_unified_diff,
    parse_unified_diff,
    split_lines,
)

COMMENTS = "".join(f"# {i}\n" for i in range(20))
BEFORE = {
    "pkg/a.py": "def f(x):\n    return x + 1\n\n\ndef g(x):\n    return x * 2\n"
    + COMMENTS
    + "def h():\n    return 3\n",
    "pkg/gone.py": "X = 1\n",
    "notes.txt": "no newline at end",
    "form.py": "a = 1\n\x0c\nb = 2\n",
}
AFTER = {
    "pkg/a.py": "def f(x):\n    return x - 1\n\n\ndef g(x):\n    return x * 2\n"
    + COMMENTS
    + "def h():\n    return 4\n",
    "pkg/new.py": "Y = 2\n",
    "notes.txt": "no newline at end, still",
    "form.py": "a = 1\n\x0c\nb = 3\n",
}


def _git(cwd: str, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def _write(root: str, files: dict[str, str]) -> None:
    for path, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, path)) or root, exist_ok=True)
        with open(os.path.join(root, path), "w", newline="") as f:
            f.write(text)


def test_made_diff_applies_with_git_and_in_memory(tmp_path):
    diff = make_unified_diff(BEFORE, AFTER)
    root = str(tmp_path)
    _git(root, "init", "-q")
    _write(root, BEFORE)
    (tmp_path / "d.patch").write_text(diff)
    _git(root, "apply", "--check", "d.patch")
    _git(root, "apply", "d.patch")
    os.remove(tmp_path / "d.patch")
    assert read_tree(root) == AFTER
    assert apply_unified_diff(BEFORE, diff) == AFTER


def test_parse_git_diff_output(tmp_path):
    root = str(tmp_path)
    _git(root, "init", "-q")
    _write(root, BEFORE)
    _git(root, "add", "-A")
    _git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "base")
    for path in BEFORE:
        os.remove(os.path.join(root, path))
    _write(root, AFTER)
    _git(root, "add", "-A")
    text = _git(root, "diff", "--cached", "--no-renames")
    files = {f.path: f for f in parse_unified_diff(text)}
    assert set(files) == {"pkg/a.py", "pkg/gone.py", "pkg/new.py", "notes.txt", "form.py"}
    assert files["pkg/new.py"].is_new and files["pkg/new.py"].new_content() == "Y = 2\n"
    assert files["pkg/gone.py"].is_deleted and files["pkg/gone.py"].new_path is None
    # two separate hunks in a.py: the blocks are exact, contiguous pieces of the file
    blocks = files["pkg/a.py"].old_text_blocks()
    assert len(blocks) == 2
    for old, new in blocks:
        assert old in BEFORE["pkg/a.py"] and new in AFTER["pkg/a.py"]
    assert "return x + 1" in blocks[0][0] and "return x - 1" in blocks[0][1]
    # the missing final newline survives the round trip
    ((old, new),) = files["notes.txt"].old_text_blocks()
    assert (old, new) == (BEFORE["notes.txt"], AFTER["notes.txt"])
    # a form feed inside a file is not a line break
    assert apply_file_diff(BEFORE["form.py"], files["form.py"]) == AFTER["form.py"]
    assert apply_unified_diff(BEFORE, text) == AFTER


def test_edit_blocks_widen_until_unique():
    before = "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny = 2\nz = 3\n"
    after = "x = 1\ny = 2\nx = 1\ny = 20\nx = 1\ny = 2\nz = 3\n"
    diff = make_unified_diff({"f.py": before}, {"f.py": after}, context_lines=0)
    (fd,) = parse_unified_diff(diff)
    assert fd.old_text_blocks() == [("y = 2\n", "y = 20\n")]  # not unique on its own
    edits = fd.edit_blocks(before)
    text = before
    for old, new in edits:
        assert text.find(old) >= 0 and text.find(old, text.find(old) + 1) < 0
        text = text.replace(old, new)
    assert text == after


def test_edit_blocks_drop_the_hunks_unchanged_context():
    before = "".join(f"setting_{i} = {i}\n" for i in range(10))
    after = before.replace("setting_5 = 5\n", "setting_5 = 50\n")
    (fd,) = parse_unified_diff(make_unified_diff({"f.py": before}, {"f.py": after}))  # 3 lines of context
    assert fd.edit_blocks(before) == [("setting_5 = 5\n", "setting_5 = 50\n")]
    inserted = before.replace("setting_5 = 5\n", "setting_5 = 5\nextra = 1\n")
    (fd,) = parse_unified_diff(make_unified_diff({"f.py": before}, {"f.py": inserted}))
    ((old, new),) = fd.edit_blocks(before)  # a pure insertion is anchored on the lines around it
    assert before.count(old) == 1 and before.replace(old, new) == inserted and len(old.splitlines()) <= 2


def test_edit_blocks_for_several_hunks_apply_in_order():
    before = "".join(f"line {i}\n" for i in range(40))
    after = before.replace("line 3\n", "line three\n").replace("line 30\n", "").replace("line 39\n", "last\n")
    (fd,) = parse_unified_diff(make_unified_diff({"f": before}, {"f": after}))
    text = before
    for old, new in fd.edit_blocks(before):
        assert text.find(old) >= 0 and text.find(old, text.find(old) + 1) < 0
        text = text.replace(old, new)
    assert text == after


def test_rename_and_binary_headers():
    text = (
        "diff --git a/old.py b/new.py\nsimilarity index 90%\nrename from old.py\nrename to new.py\n"
        "--- a/old.py\n+++ b/new.py\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/img.png b/img.png\nindex 1..2 100644\nBinary files a/img.png and b/img.png differ\n"
    )
    ren, binary = parse_unified_diff(text)
    assert ren.is_rename and (ren.old_path, ren.new_path) == ("old.py", "new.py")
    assert binary.is_binary and not binary.hunks
    with pytest.raises(PatchError, match="binary"):
        apply_file_diff("", binary)


def test_bad_hunk_counts_and_mismatch_are_errors():
    with pytest.raises(PatchError, match="promises 2 old"):
        parse_unified_diff("--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n-a\n+b\n")
    (fd,) = parse_unified_diff("--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n")
    with pytest.raises(PatchError, match="does not match"):
        apply_file_diff("zzz\n", fd)


def test_split_lines_only_on_newline():
    assert split_lines("a\x0cb\r\nc") == ["a\x0cb\r\n", "c"]
    assert split_lines("") == []
