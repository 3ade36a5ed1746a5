"""What every `codefleet bench ...` prints: progress on stderr, a title and a
short table, then one JSON object as the last line of stdout (`--json`: the
JSON object only)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

Log = Callable[[str], None]


def report(run: Callable[[Log], dict], title: Callable[[dict], str], table: Callable[[dict], str],
           as_json: bool, note_key: str | None = None) -> int:
    def log(msg: str) -> None:
        if not as_json:
            print(msg, file=sys.stderr, flush=True)

    r = run(log)
    if not as_json:
        print(title(r))
        print(table(r))
        if note_key and r.get(note_key):
            print(f"note: {r[note_key]}")
    print(json.dumps(r))
    return 0
