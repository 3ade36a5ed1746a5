"""Generate a task directory from the bundled families.

    tasks = generate_tasks("out/tasks", n=50, seed=0, families=["bugfix", "stub"], split="train")

Task i uses family `families[i % len(families)]` and its own random stream
`Random("codefleet-tasks/<seed>/<i>")`, which picks the template (among the
split's), the difficulty (unless fixed) and everything inside the task. So
the same arguments always give byte-identical task files and repositories,
and task i does not change when n grows. Ids are
`<family>-<template>-s<seed>-<i>`. Instructions in `exclude` (another set's
tasks) are drawn again from the same stream, so a set of new instances
holds none of those.

Every file, directory and removal goes through codefleet.store.safe_files:
nothing below `root` (the directory the user named: `--out`, or the run
directory whose tasks/ this is) is reached through a symlink. A task's old
directory is removed before it is written again, a link planted there as the
link itself; a link on the way, or planted as the index, is refused.
"""

from __future__ import annotations

import os
import random

from codefleet.store import safe_files
from codefleet.tasks.families import FAMILIES, templates
from codefleet.tasks.families.base import CHECK_COMMAND, DIFFICULTIES, TEST_COMMAND, DraftError, finish
from codefleet.tasks.patch import make_unified_diff
from codefleet.tasks.spec import save_task, write_index
from codefleet.types import Budgets, HiddenChecks, Task

GENERATOR = "codefleet-families/1"
_ATTEMPTS = 20


def _write_repo(root: str, repo: str, files: dict[str, str]) -> None:
    for path, text in sorted(files.items()):
        safe_files.write_file_beneath(root, os.path.join(repo, path), text, mode=0o644)


def generate_task(
    out_dir: str,
    family: str,
    index: int,
    seed: int,
    difficulty: int | None = None,
    split: str = "train",
    more_domains: bool = True,
    exclude: frozenset[str] = frozenset(),
    root: str | None = None,
) -> Task:
    """Task number `index` of the set (out_dir, seed): its repo under out_dir/<id>/repo. `root`: the directory
    the user named (default `out_dir`), below which no link is followed (the module docstring)."""
    rng = random.Random(f"codefleet-tasks/{seed}/{index}")
    module = FAMILIES[family]
    choices = templates(family, split, more_domains)
    for _ in range(_ATTEMPTS):
        template = rng.choice(choices)
        level = difficulty if difficulty is not None else rng.choice(DIFFICULTIES)
        try:
            draft = module.draft(template, rng, level)
            if draft.instruction in exclude:
                continue  # a task the excluded set already has
            done = finish(draft)
            break
        except DraftError:
            continue  # this draw has no usable bug or case; the stream moves on deterministically
    else:
        raise RuntimeError(f"{family}: no valid task after {_ATTEMPTS} draws (seed {seed}, index {index})")
    task_id = f"{family}-{template}-s{seed}-{index:04d}"
    root = os.path.abspath(root or out_dir)
    task_dir = os.path.join(out_dir, task_id)
    # a link there is removed itself, a tree never descended through one
    safe_files.remove_beneath(root, os.path.abspath(task_dir))
    repo = os.path.join(task_dir, "repo")
    _write_repo(root, os.path.abspath(repo), done.files_before)
    task = Task(
        id=task_id,
        repo=repo,
        instruction=draft.instruction,
        checks=HiddenChecks(
            command=CHECK_COMMAND,
            fail_to_pass=done.fail_to_pass,
            pass_to_pass=done.pass_to_pass,
            files=done.check_files,
        ),
        setup_commands=[],
        test_command=TEST_COMMAND,
        budgets=Budgets(),
        metadata={
            "family": family,
            "template": template,
            "difficulty": level,
            "split": module.TEMPLATES[template],
            "seed": seed,
            "index": index,
            "generator": GENERATOR,
        },
        reference_patch=make_unified_diff(done.files_before, done.files_after),
    )
    save_task(task, out_dir, root)
    return task


def generate_tasks(
    out_dir: str,
    n: int,
    seed: int = 0,
    families: list[str] | None = None,
    difficulty: int | None = None,
    split: str = "train",
    more_domains: bool = True,
    exclude: frozenset[str] = frozenset(),
    root: str | None = None,
) -> list[Task]:
    """`n` tasks into `out_dir` (one sub-directory each, plus tasks.jsonl).
    `difficulty` 1-3 fixes it; None draws it per task. `split` is "train",
    "test" or "all" (templates of both). `more_domains=False` leaves out the
    six training domains of `families/more_domains.py`. `root`: the directory the user named (default
    `out_dir`; a run directory for its tasks/): no link below it is followed."""
    if n < 0:
        raise ValueError(f"n must be a number of tasks (0 or more), got {n}")
    families = list(families or FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        raise ValueError(f"unknown task families {unknown}; choose from {', '.join(FAMILIES)}")
    if difficulty is not None and difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES} (or None for a mix), got {difficulty!r}")
    for family in families:
        if not templates(family, split):
            raise ValueError(f"family {family!r} has no templates in split {split!r}")
    root = os.path.abspath(root or out_dir)
    safe_files.makedirs_beneath(root, os.path.abspath(out_dir))
    tasks = [
        generate_task(out_dir, families[i % len(families)], i, seed, difficulty, split, more_domains, exclude, root)
        for i in range(n)
    ]
    write_index(tasks, out_dir, root)
    return tasks
