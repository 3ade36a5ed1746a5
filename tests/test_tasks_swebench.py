"""The SWE-bench-style loader on a small local fixture: a git checkout made
here and a JSONL with one good row and several bad ones."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile

import pytest

from codefleet.tasks.checks import check_task
from codefleet.tasks.cli import main
from codefleet.tasks.patch import make_unified_diff
from codefleet.tasks.spec import load_tasks, save_tasks
from codefleet.tasks.swebench import LoadError, load_swebench

MOD = "def clamp(x, lo, hi):\n    return max(lo, min(x, lo))\n"  # the bug: `lo` instead of `hi`
MOD_FIXED = "def clamp(x, lo, hi):\n    return max(lo, min(x, hi))\n"
TESTS = "from pkg.mod import clamp\n\n\ndef test_low():\n    assert clamp(-5, 0, 10) == 0\n"
TESTS_AFTER = TESTS + "\n\ndef test_high():\n    assert clamp(50, 0, 10) == 10\n"
NEW_TEST = "from pkg.mod import clamp\n\n\ndef test_inside():\n    assert clamp(-1, 0, 10) == 0\n"


def _git(cwd, *args):
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


@pytest.fixture
def fixture(tmp_path):
    repos = tmp_path / "repos"
    checkout = repos / "acme__clampy"
    (checkout / "pkg").mkdir(parents=True)
    (checkout / "tests").mkdir()
    (checkout / "pkg" / "__init__.py").write_text("")
    (checkout / "pkg" / "mod.py").write_text(MOD)
    (checkout / "tests" / "test_mod.py").write_text(TESTS)
    (checkout / "pyproject.toml").write_text('[tool.pytest.ini_options]\npythonpath = ["."]\n')
    _git(checkout, "init", "-q")
    _git(checkout, "add", "-A")
    _git(checkout, "commit", "-qm", "base")
    base = _git(checkout, "rev-parse", "HEAD")
    (checkout / "LATER.md").write_text("a later commit, not part of the task\n")
    _git(checkout, "add", "-A")
    _git(checkout, "commit", "-qm", "later")

    test_patch = make_unified_diff(
        {"tests/test_mod.py": TESTS}, {"tests/test_mod.py": TESTS_AFTER, "tests/test_new.py": NEW_TEST}
    )
    patch = make_unified_diff({"pkg/mod.py": MOD}, {"pkg/mod.py": MOD_FIXED})
    good = {
        "instance_id": "acme__clampy-1",
        "repo": "acme/clampy",
        "base_commit": base,
        "problem_statement": "clamp() ignores the upper bound.",
        "version": "1.0",
        "FAIL_TO_PASS": json.dumps(["tests/test_mod.py::test_high"]),
        "PASS_TO_PASS": ["tests/test_mod.py::test_low", "tests/test_new.py::test_inside"],
        "test_patch": test_patch,
        "patch": patch,
    }
    rows = [
        json.dumps(good),  # 1 good
        "{not json",  # 2
        json.dumps({k: v for k, v in good.items() if k != "base_commit"} | {"instance_id": "b3"}),  # 3
        json.dumps(good | {"instance_id": "b4", "FAIL_TO_PASS": "tests/x.py::t"}),  # 4
        json.dumps(good | {"instance_id": "b5", "repo": "acme/elsewhere"}),  # 5
        json.dumps(good | {"instance_id": "b6", "base_commit": "0" * 40}),  # 6
        json.dumps(good | {"instance_id": "b7", "test_patch": test_patch.replace("test_low", "test_lo")}),  # 7
        json.dumps(good),  # 8 duplicate
        "",  # 9 blank: skipped
        json.dumps(good | {"instance_id": "b10", "FAIL_TO_PASS": []}),  # 10
    ]
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text("\n".join(rows) + "\n")
    return str(jsonl), str(repos), base


def test_good_row_loads_and_bad_rows_say_why(fixture, tmp_path):
    jsonl, repos, base = fixture
    tasks, errors = load_swebench(jsonl, repos, str(tmp_path / "out"))
    assert [t.id for t in tasks] == ["acme__clampy-1"]
    assert all(isinstance(e, LoadError) for e in errors)
    by_line = {e.line: e.reason for e in errors}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 8, 10]
    assert "not valid JSON" in by_line[2]
    assert "base_commit" in by_line[3]
    assert "FAIL_TO_PASS" in by_line[4]
    assert "no checkout of acme/elsewhere" in by_line[5]
    assert "not in" in by_line[6] and "fetch" in by_line[6]
    assert "test_patch does not apply" in by_line[7]
    assert "duplicate" in by_line[8]
    assert "FAIL_TO_PASS is empty" in by_line[10]
    assert str(errors[0]).startswith("line 2")

    task = tasks[0]
    assert task.checks.fail_to_pass == ["tests/test_mod.py::test_high"]
    assert task.checks.files == {"tests/test_mod.py": TESTS_AFTER, "tests/test_new.py": NEW_TEST}
    assert task.metadata["base_commit"] == base and task.metadata["version"] == "1.0"
    with tarfile.open(task.repo) as tar:  # base_commit exported, not HEAD, and no hidden test in it
        names = tar.getnames()
        assert "pkg/mod.py" in names and "LATER.md" not in names and "tests/test_new.py" not in names
        assert tar.extractfile("pkg/mod.py").read().decode() == MOD


def test_imported_task_is_sound_and_survives_save_load(fixture, tmp_path, config):
    jsonl, repos, _ = fixture
    out = str(tmp_path / "out")
    tasks, _ = load_swebench(jsonl, repos, out)
    save_tasks(tasks, out)
    (loaded,) = load_tasks(out)
    assert loaded.repo == os.path.join(out, "acme__clampy-1", "repo.tar")  # stored relative, loaded absolute
    report = check_task(loaded, config, cache_dir=str(tmp_path / "cache"))
    assert report.sound, report.problems
    assert report.untouched[0].per_test == {
        "tests/test_mod.py::test_high": False,
        "tests/test_mod.py::test_low": True,
        "tests/test_new.py::test_inside": True,
    }


def test_rows_of_the_wrong_shape_are_row_errors_not_a_crash(fixture, tmp_path):
    jsonl, repos, _ = fixture
    with open(jsonl, "rb") as f:
        good_line = f.readline()
    good = json.loads(good_line)
    rows = tmp_path / "shapes.jsonl"
    rows.write_bytes(
        json.dumps(good | {"instance_id": ["a", "b"]}).encode()
        + b"\n"  # 1: unhashable id
        + json.dumps(good | {"instance_id": "x\n"}).encode()
        + b"\n"  # 2: id ending in newline
        + b'{"instance_id": "caf\xe9"}\n'  # 3: Latin-1, not UTF-8
        + good_line
    )  # 4: still loads
    tasks, errors = load_swebench(str(rows), repos, str(tmp_path / "out"))
    assert [t.id for t in tasks] == ["acme__clampy-1"]
    by_line = {e.line: e.reason for e in errors}
    assert sorted(by_line) == [1, 2, 3]
    assert "instance_id" in by_line[1] and "non-string" in by_line[1]
    assert "instance_id 'x\\n' must be letters" in by_line[2]
    assert "not UTF-8 text" in by_line[3]


def test_import_cli_names_a_missing_jsonl(tmp_path, capsys):
    missing = str(tmp_path / "nope.jsonl")
    assert (
        main(["tasks", "import-swebench", "--jsonl", missing, "--repos", str(tmp_path), "--out", str(tmp_path / "out")])
        == 2
    )
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"codefleet tasks import-swebench: cannot read {missing!r} (No such file")


def test_a_row_that_names_its_image_runs_in_that_saved_archive(fixture, tmp_path):
    jsonl, repos, _ = fixture
    good = json.loads(open(jsonl).readline())
    images = tmp_path / "images"
    images.mkdir()
    (images / "acme_clampy_1.0.tar").write_bytes(b"an image archive")  # imported when a sandbox is made
    rows = [
        good | {"image_name": "acme/clampy:1.0"},
        good | {"instance_id": "b2", "docker_image": "acme/other"},
        good | {"instance_id": "b3"},
    ]
    jsonl2 = tmp_path / "imaged.jsonl"
    jsonl2.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tasks, errors = load_swebench(
        str(jsonl2), repos, str(tmp_path / "out"), environment="sha256:abcd", images_dir=str(images)
    )
    assert [(t.id, t.environment) for t in tasks] == [
        ("acme__clampy-1", str(images / "acme_clampy_1.0.tar")),
        ("b3", "sha256:abcd"),
    ]  # no image named: every task's
    assert [e.line for e in errors] == [2] and "'acme/other' is not saved in" in errors[0].reason


@pytest.mark.parametrize(
    "member, says", [("../outside.txt", "outside the tree"), ("/etc/codefleet-planted", "outside the tree")]
)
def test_a_task_repo_tarball_that_leaves_its_tree_is_refused_at_set_up(tmp_path, member, says):
    """A task directory is anyone's: its repository tarball unpacks under the same caps and rules as a mined
    archive, so a member outside the tree is a set-up error naming the task's repo, and nothing lands outside."""
    import io
    import tarfile

    from codefleet.tasks.checks import TaskSetupError, materialize_repo

    archive = tmp_path / "repo.tar"
    with tarfile.open(archive, "w") as tar:
        data = b"planted\n"
        info = tarfile.TarInfo(member)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    cache = tmp_path / "cache"
    with pytest.raises(TaskSetupError, match=f"task repo '{archive}'.*{says}"):
        materialize_repo(str(archive), cache_dir=str(cache))
    assert not (cache / "outside.txt").exists() and not os.path.exists("/etc/codefleet-planted")
    assert not (cache / "task-repos").exists() or os.listdir(cache) == []


def test_a_task_repo_tarball_bomb_is_refused_at_its_cap(tmp_path):
    """300 MiB of zeros in a tarball of a few hundred KiB: refused at the unpacking cap, nothing kept."""
    import tarfile

    from codefleet.tasks.checks import TaskSetupError, materialize_repo

    class Zeros:
        def __init__(self, n):
            self.left = n

        def read(self, size=-1):
            size = self.left if size < 0 else min(size, self.left)
            self.left -= size
            return b"\0" * size

    archive = tmp_path / "repo.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        info = tarfile.TarInfo("big")
        info.size = 300 << 20
        tar.addfile(info, Zeros(info.size))
    assert archive.stat().st_size < 2 << 20
    with pytest.raises(TaskSetupError, match="task repo .*MiB"):
        materialize_repo(str(archive), cache_dir=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []
