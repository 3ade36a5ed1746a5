"""Mining bug-fix tasks from a library's own tests: a tiny library written here, real sandboxes,
real pytest runs; the mined tasks are checked sound and load for `codefleet eval`."""

from __future__ import annotations

import dataclasses
import os
import pathlib

import pytest

from codefleet.sandbox import SandboxConfig
from codefleet.tasks.checks import check_tasks
from codefleet.tasks.cli import main
from codefleet.tasks.mine import KINDS, MineError, file_mutations, mine_library
from codefleet.tasks.patch import apply_unified_diff
from codefleet.tasks.spec import load_tasks

STATS = '''"""Small numeric helpers."""


def clamp(value, low=0, high=10):
    if value < low:
        return low
    if value > high:
        return high
    return value


def total(items, start=0):
    result = start
    for item in items:
        result += item
    return result


def window(items, size=2):
    out = []
    for i in range(len(items) - size + 1):
        out.append(items[i:i + size])
    return out


def percent(part, whole):
    return round(divide(part, whole) * 100, 1)


def divide(a, b):
    return a / b


def distance(a, b):  # no test calls it
    if a > b:
        return a - b
    return b - a
'''

TESTS = """from minilib.stats import clamp, percent, total, window


def test_clamp_low():
    assert clamp(-5) == 0


def test_clamp_high():
    assert clamp(50) == 10


def test_clamp_edges():
    assert clamp(10) == 10
    assert clamp(0) == 0


def test_clamp_inside():
    assert clamp(5) == 5


def test_total():
    assert total([1, 2, 3]) == 6


def test_total_start():
    assert total([1], start=5) == 6


def test_percent():
    assert percent(1, 4) == 25.0


def test_window():
    assert window([1, 2, 3]) == [[1, 2], [2, 3]]
"""


def write_library(root: pathlib.Path, tests: str = TESTS) -> str:
    (root / "minilib").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: minilib\nVersion: 0.1.0\n")
    (root / "minilib" / "__init__.py").write_text("")
    (root / "minilib" / "stats.py").write_text(STATS)
    (root / "tests" / "test_stats.py").write_text(tests)
    return str(root)


@pytest.fixture(scope="module")
def mined(tmp_path_factory, state_dir):
    base = tmp_path_factory.mktemp("mine")
    library = write_library(base / "minilib-0.1.0")
    out = str(base / "tasks")
    report = mine_library(
        library, out, seed=0, max_tasks=4, config=dataclasses.replace(SandboxConfig(), state_dir=state_dir)
    )
    return library, out, report


def test_mined_tasks_are_real_bugs(mined, state_dir):
    library, out, report = mined
    tasks = load_tasks(out)  # what codefleet eval reads
    assert [t.id for t in tasks] == [t.id for t in report.tasks] and 2 <= len(tasks) <= 4
    assert not report.unsound
    assert len({t.metadata["mutation"] for t in tasks}) >= 2
    original = (pathlib.Path(library) / "minilib" / "stats.py").read_text()
    for task in tasks:
        assert task.metadata["family"] == "mined" and task.metadata["library"] == "minilib"
        assert task.metadata["version"] == "0.1.0" and task.metadata["seed"] == 0
        assert task.metadata["mutation"] in KINDS
        assert task.metadata["function"] != "minilib.stats.distance"  # no test covers it
        assert task.checks.fail_to_pass and "tests/test_stats.py" in task.checks.files
        assert not set(task.checks.fail_to_pass) & set(task.checks.pass_to_pass)
        buggy = pathlib.Path(task.repo, "minilib", "stats.py").read_text()
        assert buggy != original
        assert apply_unified_diff({"minilib/stats.py": buggy}, task.reference_patch)["minilib/stats.py"] == original
        name = task.checks.fail_to_pass[0].split("::")[-1]
        assert name in task.instruction
        changed = [line for line in buggy.splitlines() if line not in original.splitlines()]
        for secret in [task.metadata["mutation"], task.metadata["mutation"].replace("_", " "), *changed]:
            assert secret.strip() not in task.instruction, secret
    reports = check_tasks(tasks, dataclasses.replace(SandboxConfig(), state_dir=state_dir), runs=1)
    assert all(r.sound for r in reports), [r.line() for r in reports]


def test_same_seed_same_tasks(mined, tmp_path, capsys):
    library, out, _ = mined
    again = str(tmp_path / "again")
    assert main(["tasks", "mine", library, "--out", again, "--seed", "0", "--max-tasks", "4"]) == 0
    captured = capsys.readouterr()
    assert "minilib 0.1.0:" in captured.err and "kept" in captured.err and "mined" in captured.out

    def files(top: str) -> dict[str, bytes]:
        return {
            os.path.relpath(os.path.join(d, f), top): open(os.path.join(d, f), "rb").read()
            for d, _, names in os.walk(top)
            for f in names
        }

    assert files(again) == files(out)


def test_mutations_are_minimal_edits():
    source = STATS.encode()
    per_function = file_mutations(source, "minilib/stats.py", "minilib.stats")
    assert set(per_function) == {
        "minilib.stats.clamp",
        "minilib.stats.total",
        "minilib.stats.window",
        "minilib.stats.percent",
        "minilib.stats.divide",
        "minilib.stats.distance",
    }
    kinds = {m.kind for ms in per_function.values() for m in ms}
    assert kinds == set(KINDS)
    for mutations in per_function.values():
        for mutation in mutations:
            mutant = mutation.apply(source)
            assert mutant[: mutation.start] == STATS[: mutation.start]  # ASCII: bytes and characters agree
            assert mutant.endswith(STATS[mutation.end :])


@pytest.mark.parametrize("case", ["empty-dir", "not-a-tarball", "suite-fails", "missing"])
def test_bad_input_is_one_clear_error(case, tmp_path, capsys):
    if case == "empty-dir":
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "README.md").write_text("nothing here\n")
        source, expected = str(tmp_path / "src"), "not a Python source tree with tests"
    elif case == "not-a-tarball":
        (tmp_path / "lib-1.0.tar.gz").write_text("not gzip\n")
        source, expected = str(tmp_path / "lib-1.0.tar.gz"), "not a readable tarball"
    elif case == "suite-fails":
        source = write_library(
            tmp_path / "broken",
            "from minilib.stats import total\n\n\ndef test_total():\n    assert total([1, 2]) == 4\n",
        )
        expected = "fails on the original source"
    else:
        source, expected = str(tmp_path / "nowhere"), "is not a source distribution"
    assert main(["tasks", "mine", source, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and err.startswith("codefleet tasks mine: ")
    with pytest.raises(MineError):
        mine_library(source, str(tmp_path / "out2"))
