"""What every `codefleet bench ...` prints: progress on stderr, a title and a
short table, then one JSON object as the last line of stdout (`--json`: the
JSON object only).

A benchmark that cannot run (no bubblewrap or user namespaces, a dead Ray
actor, a missing package) says why in one sentence on stderr and exits 1,
with no table, no JSON and no traceback (`CODEFLEET_DEBUG=1` re-raises)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable

Log = Callable[[str], None]


def failure_sentence(name: str, e: BaseException) -> str:
    """`codefleet bench NAME` failed, in one line: the error's own first line, or its type."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    why = lines[0] if lines else type(e).__name__
    return f"codefleet bench {name} could not run: {why}"


def report(
    run: Callable[[Log], dict],
    title: Callable[[dict], str],
    table: Callable[[dict], str],
    as_json: bool,
    note_key: str | None = None,
    name: str = "",
) -> int:
    def log(msg: str) -> None:
        if not as_json:
            print(msg, file=sys.stderr, flush=True)

    try:
        r = run(log)
    except Exception as e:
        if os.environ.get("CODEFLEET_DEBUG"):
            raise
        print(failure_sentence(name, e), file=sys.stderr, flush=True)
        return 1
    if not as_json:
        print(title(r))
        print(table(r))
        if note_key and r.get(note_key):
            print(f"note: {r[note_key]}")
    print(json.dumps(r))
    return 0
