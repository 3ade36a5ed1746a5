"""The procedural families: every template drafts, output is deterministic by
seed, splits hold out templates, difficulty changes size, reference patches
turn the repo into the solution. (That the checks are sound inside a
sandbox is tests/test_tasks_check.py.)"""

from __future__ import annotations

import os
import random
import re
import sys

import pytest

from codefleet.tasks.cli import main
from codefleet.tasks.families import FAMILIES, MORE_TEMPLATES, templates
from codefleet.tasks.families.base import finish
from codefleet.tasks.families.domains import DOMAINS
from codefleet.tasks.generate import generate_tasks
from codefleet.tasks.patch import apply_unified_diff, parse_unified_diff
from codefleet.tasks.spec import load_tasks


def _tree(root: str) -> dict[str, bytes]:
    out = {}
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, root)] = f.read()
    return out


def _repo_files(task) -> dict[str, str]:
    return {path: data.decode() for path, data in _tree(task.repo).items()}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_template_and_difficulty_drafts(family):
    for template in templates(family, "all"):
        for difficulty in (1, 2, 3):
            done = finish(FAMILIES[family].draft(template, random.Random(f"t/{template}/{difficulty}"), difficulty))
            assert done.fail_to_pass, (family, template)
            assert set(done.fail_to_pass).isdisjoint(done.pass_to_pass)
            assert done.files_before != done.files_after


def test_same_seed_gives_identical_files_and_another_seed_does_not(tmp_path):
    a = generate_tasks(str(tmp_path / "a"), 10, seed=7, split="all")
    b = generate_tasks(str(tmp_path / "b"), 10, seed=7, split="all")
    tree_a, tree_b = _tree(str(tmp_path / "a")), _tree(str(tmp_path / "b"))
    assert tree_a == tree_b  # task.json (repo stored relative), repos, index: byte for byte
    assert len([p for p in tree_a if p.endswith("task.json")]) == 10
    c = generate_tasks(str(tmp_path / "c"), 10, seed=8, split="all")
    assert [t.reference_patch for t in a] != [t.reference_patch for t in c]
    assert {t.metadata["family"] for t in a} == set(FAMILIES)  # round-robin over every family
    # task i does not depend on how many tasks are generated
    d = generate_tasks(str(tmp_path / "d"), 3, seed=7, split="all")
    assert [t.reference_patch for t in d] == [t.reference_patch for t in a[:3]]
    assert [b_.instruction for b_ in b] == [a_.instruction for a_ in a]


def test_splits_hold_out_templates(tmp_path):
    for family in FAMILIES:
        train, test = set(templates(family, "train")), set(templates(family, "test"))
        assert train and test and not train & test, family
        assert train | test == set(FAMILIES[family].TEMPLATES)
    train_tasks = generate_tasks(str(tmp_path / "train"), 25, seed=1, split="train")
    test_tasks = generate_tasks(str(tmp_path / "test"), 25, seed=1, split="test")
    for task in train_tasks:
        assert task.metadata["template"] in templates(str(task.metadata["family"]), "train")
        assert task.metadata["split"] == "train"
    for task in test_tasks:
        assert task.metadata["template"] in templates(str(task.metadata["family"]), "test")
        assert task.metadata["split"] == "test"
    seen_train = {(t.metadata["family"], t.metadata["template"]) for t in train_tasks}
    seen_test = {(t.metadata["family"], t.metadata["template"]) for t in test_tasks}
    assert not seen_train & seen_test


def test_more_domains_are_training_templates_that_can_be_left_out(tmp_path):
    for family in ("bugfix", "stub", "rename"):
        assert set(templates(family, "train")) >= MORE_TEMPLATES
        assert not MORE_TEMPLATES & set(templates(family, "train", more_domains=False))
        assert templates(family, "test", more_domains=False) == templates(family, "test")
    drawn = {str(t.metadata["template"]) for t in generate_tasks(str(tmp_path / "a"), 30, seed=2, split="train")}
    assert drawn & MORE_TEMPLATES
    without = generate_tasks(str(tmp_path / "b"), 30, seed=2, split="train", more_domains=False)
    assert not {str(t.metadata["template"]) for t in without} & MORE_TEMPLATES
    out = str(tmp_path / "c")
    assert main(["tasks", "generate", "--out", out, "--n", "30", "--seed", "2", "--no-more-domains"]) == 0
    assert not {str(t.metadata["template"]) for t in load_tasks(out)} & MORE_TEMPLATES


def test_difficulty_changes_size(tmp_path):
    sizes = {}
    for level in (1, 3):
        tasks = generate_tasks(str(tmp_path / f"d{level}"), 15, seed=3, difficulty=level, split="all")
        assert {t.metadata["difficulty"] for t in tasks} == {level}
        for task in tasks:
            files = _repo_files(task)
            key = (task.metadata["family"], level)
            sizes.setdefault(key, []).append((len(files), sum(len(v) for v in files.values())))
    for family in FAMILIES:
        small, big = sizes[(family, 1)], sizes[(family, 3)]
        assert sum(n for n, _ in big) > sum(n for n, _ in small), family  # more files
        assert sum(b for _, b in big) > sum(b for _, b in small), family  # more code


def test_reference_patch_makes_the_solution_and_hides_nothing_in_the_repo(tmp_path):
    for task in generate_tasks(str(tmp_path), 15, seed=5, split="all"):
        before = _repo_files(task)
        after = apply_unified_diff(before, task.reference_patch)
        assert after != before
        # replaying the patch as edit_file calls (what the scripted expert does) gives the same files
        replayed = dict(before)
        for diff in parse_unified_diff(task.reference_patch):
            if diff.is_new:
                replayed[diff.path] = diff.new_content()
                continue
            text = replayed[diff.path]
            for old, new in diff.edit_blocks(text):
                assert text.count(old) == 1
                text = text.replace(old, new)
            replayed[diff.path] = text
        assert replayed == after
        hidden_only = set(task.checks.files) - set(before)
        assert hidden_only, "every task has test files the agent never sees"
        for path in hidden_only:
            assert path not in after and os.path.basename(path) not in task.instruction
        for test_id in task.checks.fail_to_pass + task.checks.pass_to_pass:
            assert test_id.split("::")[0] in task.checks.files  # every checked test file is rewritten at check time
        assert task.test_command and "{tests}" in task.checks.command


def test_instructions_read_like_issues(tmp_path):
    for task in generate_tasks(str(tmp_path), 10, seed=11, split="all"):
        assert len(task.instruction) > 40, task.instruction
        assert task.instruction[0].isupper() or task.instruction[0] == "`", task.instruction
        assert not re.search(r"\{[a-z_]+\}", task.instruction), task.instruction  # no unfilled template field
        assert task.instruction.rstrip().endswith((".", ")")), task.instruction


def test_domain_names_are_safe():
    names = [f.name for d in DOMAINS.values() for f in d.funcs]
    assert len(names) == len(set(names)), "a function name in two domains would confuse the rename checks"
    for domain in DOMAINS.values():
        assert not set(domain.packages) & set(sys.stdlib_module_names)
        for func in domain.funcs:
            assert all(re.fullmatch(r"[a-z_]+", alias) and alias not in names for alias in func.aliases)


def test_generate_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown task families"):
        generate_tasks(str(tmp_path), 1, families=["nope"])
    with pytest.raises(ValueError, match="difficulty"):
        generate_tasks(str(tmp_path), 1, difficulty=7)
    with pytest.raises(ValueError, match="split"):
        generate_tasks(str(tmp_path), 1, split="dev")
    assert not os.path.exists(tmp_path / "tasks.jsonl")  # nothing written for a bad request


def test_generate_cli_refuses_no_tasks_and_an_unwritable_out(tmp_path, capsys):
    out = tmp_path / "tasks"
    for n in ("0", "-3"):
        assert main(["tasks", "generate", "--out", str(out), "--n", n]) == 2
        assert capsys.readouterr().err == f"codefleet tasks generate: --n must be at least 1, got {n}\n"
    assert not out.exists()
    with pytest.raises(ValueError, match="0 or more"):
        generate_tasks(str(out), -3)
    taken = tmp_path / "a-file"
    taken.write_text("not a directory\n")
    assert main(["tasks", "generate", "--out", str(taken), "--n", "1"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1
    assert captured.err.startswith(f"codefleet tasks generate: cannot write {str(taken)!r} (File exists)")
    assert "pass --out a directory you can write" in captured.err
    assert taken.read_text() == "not a directory\n"
