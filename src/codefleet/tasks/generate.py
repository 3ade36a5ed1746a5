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
"""

from __future__ import annotations

import os
import random
import shutil

from codefleet.tasks.families import FAMILIES, templates
from codefleet.tasks.families.base import CHECK_COMMAND, DIFFICULTIES, TEST_COMMAND, DraftError, finish
from codefleet.tasks.patch import make_unified_diff
from codefleet.tasks.spec import INDEX_FILE, index_line, save_task
from codefleet.types import Budgets, HiddenChecks, Task

GENERATOR = "codefleet-families/1"
_ATTEMPTS = 20


def _write_repo(root: str, files: dict[str, str]) -> None:
    for path, text in sorted(files.items()):
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8", newline="") as f:
            f.write(text)


def generate_task(out_dir: str, family: str, index: int, seed: int, difficulty: int | None = None,
                  split: str = "train", more_domains: bool = True, exclude: frozenset[str] = frozenset()) -> Task:
    """Task number `index` of the set (out_dir, seed): its repo under out_dir/<id>/repo."""
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
    task_dir = os.path.join(out_dir, task_id)
    if os.path.isdir(task_dir):
        shutil.rmtree(task_dir)
    repo = os.path.join(task_dir, "repo")
    _write_repo(repo, done.files_before)
    task = Task(
        id=task_id, repo=repo, instruction=draft.instruction,
        checks=HiddenChecks(command=CHECK_COMMAND, fail_to_pass=done.fail_to_pass, pass_to_pass=done.pass_to_pass,
                            files=done.check_files),
        setup_commands=[], test_command=TEST_COMMAND, budgets=Budgets(),
        metadata={"family": family, "template": template, "difficulty": level, "split": module.TEMPLATES[template],
                  "seed": seed, "index": index, "generator": GENERATOR},
        reference_patch=make_unified_diff(done.files_before, done.files_after),
    )
    save_task(task, out_dir)
    return task


def generate_tasks(out_dir: str, n: int, seed: int = 0, families: list[str] | None = None,
                   difficulty: int | None = None, split: str = "train", more_domains: bool = True,
                   exclude: frozenset[str] = frozenset()) -> list[Task]:
    """`n` tasks into `out_dir` (one sub-directory each, plus tasks.jsonl).
    `difficulty` 1-3 fixes it; None draws it per task. `split` is "train",
    "test" or "all" (templates of both). `more_domains=False` leaves out the
    six training domains of `families/more_domains.py`."""
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
    os.makedirs(out_dir, exist_ok=True)
    tasks = [generate_task(out_dir, families[i % len(families)], i, seed, difficulty, split, more_domains, exclude)
             for i in range(n)]
    with open(os.path.join(out_dir, INDEX_FILE), "w", encoding="utf-8") as f:
        f.writelines(index_line(task) + "\n" for task in tasks)
    return tasks
