"""A scripted expert: solves a task from its reference patch, acting like an agent.

For demonstrations (SFT data), tests and baselines we want trajectories that
look like a good agent's — explore, read, edit, test, submit — and always
solve the task. The expert knows the task's reference patch and replays it
through the ordinary Policy interface, writing the same tool-call JSON a
model would:

    turn 0  list_dir(".") and a search for the first name the instruction puts in
            backticks (parallel; list_dir alone when it names none)
    turn 1  read_file of every file the patch changes (parallel when several)
    turn 2  one edit_file per hunk, computed from what read_file showed
            (widened until unique, tasks.patch.FileDiff.edit_blocks);
            write_file for new files; `rm` (run) for deleted ones
    turn 3  run the visible test command (if the task has one)
    turn 4  submit

When the patch is a pure rename (every changed line is its old line with one
identifier replaced by another as a whole word, in exactly the Python files
that hold it: `pure_rename`), turns 1-2 become one shell
command, the way a fast engineer renames (`rename_command`: `grep -rlw
--include='*.py' 'OLD' . | xargs sed -i 's/\bOLD\b/NEW/g'`). With `explore=False` the expert skips
turn 0 when the instruction already names what to change (every file it
reads, or both names of a rename); it explores anyway when the files are not
named, since acting on a path the task never showed teaches a policy to
guess paths. With `chain_tests=True` a rename runs the visible tests in the
same command (`... && python3 -m pytest -q tests`), one turn instead of two.
Demonstrations mix these habits (`recipe.demos`) so that RL, whose reward costs
turns, can learn which is faster.

Names and paths in its text are in backticks and quoted in shell commands,
as instructions write them: a byte-level BPE gives `name` after a space other
tokens than after a backtick or quote (' node' vs 'node'), and a policy
learning from these demonstrations copies a name far sooner when it is the
same tokens in the instruction and in its answer (docs/experiments/).

The expert is stateless: which step comes next is the number of assistant
messages so far, and the edits are computed from the read_file results in
the transcript. So one instance serves any number of concurrent episodes,
and a correction or a plan in the context does not derail it. Token counts
are estimates (characters / 4); there are no token ids or logprobs.
"""

from __future__ import annotations

import json
import keyword
import os
import re
import shlex

from codefleet.agent.policy import parse_tool_call
from codefleet.tasks.patch import FileDiff, PatchError, apply_file_diff, parse_unified_diff
from codefleet.types import PolicyOutput, Task

_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{3,}")
# `name` or `name(...)` in an instruction: a function or constant it talks about (not a path, not a value)
_NAMED = re.compile(r"`([A-Za-z_][A-Za-z0-9_]{2,})[`(]")


class ScriptedExpert:
    def __init__(self, task: Task, explore: bool = True, chain_tests: bool = False):
        if not task.reference_patch.strip():
            raise ValueError(f"task {task.id!r} has no reference patch; the scripted expert replays one")
        self.task = task
        self.name = f"scripted-expert:{task.id}"
        self.diffs = parse_unified_diff(task.reference_patch)
        self.rename = pure_rename(self.diffs, task.repo)
        self.to_read = (
            [] if self.rename else [d for d in self.diffs if not d.is_new and not d.is_deleted and not d.is_binary]
        )
        named = bool(self.rename) or (bool(self.to_read) and all(d.old_path in task.instruction for d in self.to_read))
        self.chain_tests = chain_tests and bool(self.rename) and bool(task.test_command)
        self.steps = (["explore"] if explore or not named else []) + (["read"] if self.to_read else []) + ["edit"]
        self.steps += (["test"] if task.test_command and not self.chain_tests else []) + ["submit"]

    def generate(self, messages: list[dict], tools: list[dict]) -> PolicyOutput:
        index = sum(1 for m in messages if m.get("role") == "assistant")
        step = self.steps[index] if index < len(self.steps) else "done"
        text, calls = getattr(self, "_" + step)(messages, index)
        tool_calls = [
            parse_tool_call(f"call_{index}_{i}", name, json.dumps(args)) for i, (name, args) in enumerate(calls)
        ]
        return PolicyOutput(
            text=text,
            tool_calls=tool_calls,
            model=self.name,
            prompt_tokens=len(json.dumps(messages)) // 4,
            completion_tokens=(len(text) + sum(len(c.raw_arguments) for c in tool_calls)) // 4,
            finish_reason="tool_calls" if tool_calls else "stop",
        )

    # -- steps ---------------------------------------------------------------------------

    def _explore(self, messages: list[dict], index: int) -> tuple[str, list[tuple[str, dict]]]:
        calls: list[tuple[str, dict]] = [("list_dir", {"path": "."})]
        term = self._search_term()
        if term:
            calls.append(("search", {"pattern": term, "path": "."}))
        return "Let me look at the repository layout and find the relevant code.", calls

    def _read(self, messages: list[dict], index: int) -> tuple[str, list[tuple[str, dict]]]:
        paths = [d.old_path for d in self.to_read]
        return f"Reading {', '.join(f'`{p}`' for p in paths)}.", [("read_file", {"path": p}) for p in paths]

    def _edit(self, messages: list[dict], index: int) -> tuple[str, list[tuple[str, dict]]]:
        if self.rename:
            return rename_step(*self.rename, self.task.test_command if self.chain_tests else "")
        seen = self._read_results(messages)
        calls: list[tuple[str, dict]] = []
        for diff in self.diffs:
            if diff.is_new:
                calls.append(("write_file", {"path": diff.new_path, "content": diff.new_content()}))
            elif diff.is_deleted:
                calls.append(("run", {"command": f"rm -f {shlex.quote(diff.old_path)}"}))
            elif diff.is_rename:
                content = apply_file_diff(seen.get(diff.old_path, ""), diff)
                calls.append(("write_file", {"path": diff.new_path, "content": content}))
                calls.append(("run", {"command": f"rm -f {shlex.quote(diff.old_path)}"}))
            elif not diff.is_binary:
                for old, new in _edit_blocks(diff, seen.get(diff.old_path)):
                    calls.append(("edit_file", {"path": diff.new_path, "old_text": old, "new_text": new}))
        return "Making the change.", calls

    def _test(self, messages: list[dict], index: int) -> tuple[str, list[tuple[str, dict]]]:
        return "Running the tests.", [("run", {"command": self.task.test_command, "timeout": 300})]

    def _submit(self, messages: list[dict], index: int) -> tuple[str, list[tuple[str, dict]]]:
        if self.rename:
            return "Done.", [("submit", {"summary": f"Renamed `{self.rename[0]}` to `{self.rename[1]}`."})]
        files = ", ".join(f"`{d.path}`" for d in self.diffs)
        return "Done.", [("submit", {"summary": f"Changed {files} as the task asks."})]

    def _done(self, messages: list[dict], index: int) -> tuple[str, list[tuple[str, dict]]]:
        return "The task is done.", []

    # -- helpers -------------------------------------------------------------------------

    def _search_term(self) -> str:
        """The first name the instruction puts in backticks, as a policy would search for it: a search
        term read off the patch instead would teach a policy to guess what it cannot see."""
        if self.rename:
            return self.rename[0]
        names = [n for n in _NAMED.findall(self.task.instruction) if not keyword.iskeyword(n)]
        return names[0] if names else ""

    def _read_results(self, messages: list[dict]) -> dict[str, str]:
        """Path -> file text, reconstructed from the read_file calls and their results in the transcript."""
        paths: dict[str, str] = {}  # call id -> path
        for m in messages:
            for tc in m.get("tool_calls") or []:
                if tc["function"]["name"] == "read_file":
                    args = json.loads(tc["function"]["arguments"] or "{}")
                    paths[tc["id"]] = args.get("path", "")
        out: dict[str, str] = {}
        for m in messages:
            if m.get("role") == "tool" and m.get("tool_call_id") in paths:
                content = m.get("content") or ""
                if content.startswith("[") and content.endswith(" is empty]"):
                    out[paths[m["tool_call_id"]]] = ""
                elif not content.startswith("error:") and "[output capped" not in content:
                    lines = [ln.split("\t", 1)[1] if "\t" in ln else "" for ln in content.split("\n")]
                    out[paths[m["tool_call_id"]]] = "\n".join(lines) + "\n"
        return out


def _edit_blocks(diff: FileDiff, seen: str | None) -> list[tuple[str, str]]:
    """edit_file arguments for a diff, made unique against the file as read (with or without a final newline)."""
    if seen is not None:
        for text in (seen, seen[:-1]):
            try:
                return diff.edit_blocks(text)
            except PatchError:
                continue
    return diff.old_text_blocks()


def rename_command(old: str, new: str) -> str:
    """One shell command replacing the word `old` by `new` in every Python file under the working directory."""
    return f"grep -rlw --include='*.py' '{old}' . | xargs sed -i 's/\\b{old}\\b/{new}/g'"


def rename_step(old: str, new: str, test_command: str = "") -> tuple[str, list[tuple[str, dict]]]:
    """The expert's turn for a pure rename: its text and its one `run` call (then the tests, if given)."""
    if test_command:
        return (
            f"Renaming `{old}` to `{new}` everywhere and running the tests.",
            [("run", {"command": f"{rename_command(old, new)} && {test_command}", "timeout": 300})],
        )
    return f"Renaming `{old}` to `{new}` everywhere.", [("run", {"command": rename_command(old, new)})]


def pure_rename(diffs: list[FileDiff], repo: str | None = None) -> tuple[str, str] | None:
    """(old, new) when the patch is what `rename_command(old, new)` does: every changed line is its old line
    with the identifier `old` replaced by `new` as a whole word, only Python files change (nothing is added,
    deleted or moved), and, given the task's `repo`, no other Python file there holds `old`. Else None.

    A config task that turns `"INFO"` into `"DEBUG"` in a JSON file is a word swap but no rename: the
    command would edit every Python file that says INFO (a test among them) and leave the JSON alone."""
    pairs = []
    for diff in diffs:
        if diff.is_new or diff.is_deleted or diff.is_binary or diff.is_rename or not diff.old_path.endswith(".py"):
            return None
        for hunk in diff.hunks:
            removed = [ln for ln in hunk.old_lines if ln not in hunk.new_lines]
            added = [ln for ln in hunk.new_lines if ln not in hunk.old_lines]
            if len(removed) != len(added) or len(hunk.old_lines) != len(hunk.new_lines):
                return None
            pairs += zip(removed, added)
    if not pairs:
        return None
    gone = set(_IDENT.findall(pairs[0][0])) - set(_IDENT.findall(pairs[0][1]))
    came = set(_IDENT.findall(pairs[0][1])) - set(_IDENT.findall(pairs[0][0]))
    if len(gone) != 1 or len(came) != 1:
        return None
    old, new = gone.pop(), came.pop()
    word = re.compile(rf"\b{re.escape(old)}\b")
    if not all(word.sub(new, a) == b for a, b in pairs):
        return None
    if repo is not None and _python_files_holding(repo, word) - {d.old_path for d in diffs}:
        return None
    return old, new


def _python_files_holding(repo: str, word: re.Pattern) -> set[str]:
    """The repo-relative paths of the Python files under `repo` in which `word` matches."""
    found = set()
    for root, dirs, files in os.walk(repo):
        dirs[:] = [d for d in dirs if d != ".git"]
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py"):
                with open(path, encoding="utf-8", errors="replace") as f:
                    if word.search(f.read()):
                        found.add(os.path.relpath(path, repo))
    return found
