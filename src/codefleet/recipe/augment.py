"""Fresh names for demonstrations: the same episode in a repository whose names were never seen.

A policy that sees the same few dozen demonstrations every epoch lowers its loss fastest by
memorising their names (`passed_count`, `parcelpost/rates.py`) instead of copying them from the
task and the tool results, and then writes a memorised name on every held-out task.
`fresh_names(messages, rng)` renames, consistently across the whole conversation (the task, the
assistant's text and tool-call arguments, the tool results), every name the task message puts in
backticks: a function or constant (`name`, `name(...)`) and each directory and module of a path
(`pkg/module.py`). Renaming is whole-word (a name right after a regex's `\\b` counts as whole),
so the result is the same episode in a renamed repository: the same tool calls solve it. Each SFT
epoch draws new names for every demonstration, so only copying lowers the loss on them.

Not renamed: test files and test ids, Python keywords and builtins, names shorter than 3 characters,
anything outside the task's backticks.
"""

from __future__ import annotations

import builtins
import keyword
import random
import re

WORDS = [
    "add",
    "count",
    "total",
    "price",
    "stock",
    "value",
    "item",
    "list",
    "box",
    "day",
    "week",
    "time",
    "slot",
    "shift",
    "parse",
    "format",
    "text",
    "word",
    "vowel",
    "grade",
    "score",
    "mark",
    "fee",
    "rate",
    "cost",
    "zone",
    "parcel",
    "weight",
    "area",
    "side",
    "edge",
    "point",
    "line",
    "path",
    "node",
    "tree",
    "leaf",
    "key",
    "map",
    "row",
    "col",
    "sum",
    "mean",
    "max",
    "min",
    "avg",
    "top",
    "low",
    "high",
    "fast",
    "slow",
    "new",
    "old",
    "next",
    "prev",
    "first",
    "last",
    "order",
    "ship",
    "load",
    "pack",
    "sort",
    "find",
    "make",
    "build",
    "read",
    "write",
    "send",
    "fetch",
    "store",
    "cache",
    "queue",
    "task",
    "job",
    "user",
    "name",
    "file",
    "dir",
    "size",
    "kind",
    "type",
    "mode",
    "flag",
    "level",
    "limit",
    "range",
    "span",
    "gap",
    "open",
    "close",
    "start",
    "stop",
    "run",
    "test",
    "check",
    "clean",
    "split",
    "join",
    "merge",
    "trim",
    "pad",
    "hash",
]

_BACKTICKED = re.compile(r"`([^`\n]+)`")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEEP = set(keyword.kwlist) | set(dir(builtins)) | {"tests", "test", "self", "src", "py"}


def identifier(rng: random.Random) -> str:
    """A made-up snake_case name of 2-3 common words (`node_time`, `fee_split_top`)."""
    return "_".join(rng.sample(WORDS, rng.choice((2, 2, 3))))


def task_names(text: str) -> list[str]:
    """The names `fresh_names` renames: identifiers and path parts the text puts in backticks, in order."""
    names: list[str] = []
    for span in _BACKTICKED.findall(text):
        if "::" in span:  # a test id
            continue
        if "/" in span or span.endswith(".py"):
            parts = [p.rsplit(".", 1)[0] if p.endswith(".py") else p for p in span.split("/")]
        else:
            head = _IDENT.match(span)
            parts = [head.group(0)] if head and span[head.end() : head.end() + 1] in ("", "(") else []
        names += [
            p for p in parts if _IDENT.fullmatch(p) and len(p) >= 3 and p not in _KEEP and not p.startswith("test")
        ]
    return list(dict.fromkeys(names))


def _task_text(messages: list[dict]) -> str:
    return next((m.get("content") or "" for m in messages if m.get("role") == "user"), "")


def fresh_names(messages: list[dict], rng: random.Random) -> list[dict]:
    """A copy of the conversation with every name of its task message renamed (see the module docstring)."""
    names = task_names(_task_text(messages))
    if not names:
        return messages
    taken = set(names)
    mapping: dict[str, str] = {}
    for name in names:
        new = identifier(rng)
        while new in taken:
            new = identifier(rng)
        taken.add(new)
        mapping[name] = new
    words = "|".join(re.escape(n) for n in sorted(mapping, key=len, reverse=True))
    pattern = re.compile(rf"(?:(?<=\\b)|(?<![A-Za-z0-9_]))({words})(?![A-Za-z0-9_])")

    def rename(text):
        return pattern.sub(lambda m: mapping[m.group(1)], text) if isinstance(text, str) else text

    out = []
    for m in messages:
        m = dict(m, content=rename(m.get("content")))
        if m.get("tool_calls"):
            m["tool_calls"] = [
                dict(tc, function=dict(tc["function"], arguments=rename(tc["function"]["arguments"])))
                for tc in m["tool_calls"]
            ]
        out.append(m)
    return out
