"""Coding tasks: the spec, loaders, procedural families and the hidden checks.

    from codefleet.tasks import generate_tasks, load_tasks, prepare_sandbox, workspace_diff, run_checks

    tasks = generate_tasks("out/tasks", n=20, seed=0)        # or load_tasks(dir), load_swebench(...)
    sb = prepare_sandbox(tasks[0], config)                    # repo + setup + git baseline; nothing hidden inside
    ...                                                       # the agent works in sb
    diff = workspace_diff(sb)
    result = run_checks(sb, tasks[0])                         # CheckResult (all_passed, fraction, per_test)

Modules: spec.py (the JSON format, docs/tasks.md), patch.py (unified diffs),
checks.py (sandbox preparation, diff, hidden checks, soundness),
swebench.py (SWE-bench-style JSONL), families/ (procedural tasks),
generate.py, cli.py (`codefleet tasks ...`).
"""

from __future__ import annotations

from codefleet.tasks.checks import (
    PatchApplyError,
    TaskCheckReport,
    TaskSetupError,
    apply_patch,
    check_task,
    check_tasks,
    prepare_sandbox,
    run_checks,
    workspace_diff,
)
from codefleet.tasks.generate import generate_tasks
from codefleet.tasks.patch import FileDiff, Hunk, PatchError, make_unified_diff, parse_unified_diff
from codefleet.tasks.spec import TaskSpecError, load_task, load_tasks, save_task, save_tasks, validate_task
from codefleet.tasks.swebench import LoadError, load_swebench

__all__ = [
    "FileDiff",
    "Hunk",
    "LoadError",
    "PatchApplyError",
    "PatchError",
    "TaskCheckReport",
    "TaskSetupError",
    "TaskSpecError",
    "apply_patch",
    "check_task",
    "check_tasks",
    "generate_tasks",
    "load_swebench",
    "load_task",
    "load_tasks",
    "make_unified_diff",
    "parse_unified_diff",
    "prepare_sandbox",
    "run_checks",
    "save_task",
    "save_tasks",
    "validate_task",
    "workspace_diff",
]
