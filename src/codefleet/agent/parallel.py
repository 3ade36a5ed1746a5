"""Executing one turn's tool calls concurrently, results in call order.

A model that reads four files in one turn should wait for one read, not
four. All calls of a turn start at once on a thread pool; the results come
back in the order the model wrote the calls, so each `tool` message follows
its `tool_call_id`.

Two exceptions keep the outcome well defined: calls that change the same file
(`edit_file`, `write_file` on one path) run one after another in call order,
since two edits racing on one file would lose one of them; and when a turn
holds several `run` calls, they run as separate processes (see tools.py),
because one persistent shell runs one command at a time.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from codefleet.agent.tools import Toolbox
from codefleet.types import ToolCall, ToolResult

MAX_WORKERS = 16


def _chain_key(index: int, call: ToolCall) -> str:
    """Calls with the same key run in order on one thread; others run side by side."""
    path = (call.arguments or {}).get("path")
    if call.name in ("edit_file", "write_file") and isinstance(path, str):
        path = path.removeprefix("/workspace/").lstrip("/")
        return "file:" + os.path.normpath(path or ".")
    return f"call:{index}"


def execute_calls(toolbox: Toolbox, calls: list[ToolCall], max_timeout_s: float | None = None) -> list[ToolResult]:
    """Execute `calls` concurrently against the toolbox's sandbox; never raises."""
    n_runs = sum(1 for c in calls if c.name == "run" and c.arguments is not None)
    parallel_runs = n_runs > 1
    state = ""
    if parallel_runs:
        try:
            state = toolbox.shell_state()
        except Exception:  # a dead or closed sandbox: the calls themselves will say so
            state = ""
    chains: dict[str, list[int]] = {}
    for i, call in enumerate(calls):
        chains.setdefault(_chain_key(i, call), []).append(i)
    results: list[ToolResult | None] = [None] * len(calls)

    def work(indices: list[int]) -> None:
        for i in indices:
            results[i] = toolbox.execute(
                calls[i], parallel=parallel_runs, shell_state=state, max_timeout_s=max_timeout_s
            )

    if len(chains) <= 1:
        for indices in chains.values():
            work(indices)
    else:
        with ThreadPoolExecutor(max_workers=min(len(chains), MAX_WORKERS), thread_name_prefix="tool") as pool:
            for future in [pool.submit(work, indices) for indices in chains.values()]:
                future.result()
    return [r for r in results if r is not None]
