"""Unified diffs: parse them into edits, apply them in memory, make them.

Reference solutions are unified diffs (what `git diff` prints). Three users:

- the scripted expert replays a reference patch as agent tool calls: each
  hunk becomes one `edit_file(path, old_text, new_text)`, a new file one
  `write_file`. So a `Hunk` keeps its context lines and `old_text` /
  `new_text` are the *exact* contiguous blocks of the file before and after
  (line endings and a missing final newline included);
- the SWE-bench loader applies a `test_patch` to the base files in memory to
  get the hidden test files (`apply_file_diff`);
- the procedural families make their reference patch from the files before
  and after (`make_unified_diff`, difflib), in the `diff --git a/ b/` form
  that `git apply` accepts.

Binary patches (`GIT binary patch`, `Binary files ... differ`) are parsed as
a `FileDiff` with `is_binary` and no hunks; they cannot be replayed as edits.
"""

from __future__ import annotations

import codecs
import difflib
import re
from dataclasses import dataclass, field

_HUNK_RE = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
_NO_NEWLINE = "\\ No newline at end of file"


def split_lines(text: str) -> list[str]:
    """Lines of `text` with their "\\n" kept. Unlike str.splitlines, only "\\n"
    ends a line (a form feed or "\\r" inside a line stays where it is)."""
    parts = text.split("\n")
    lines = [part + "\n" for part in parts[:-1]]
    if parts[-1]:
        lines.append(parts[-1])
    return lines


class PatchError(ValueError):
    """A diff that cannot be parsed or does not apply; the message says where."""


@dataclass
class Hunk:
    """One `@@` block. Lines keep their line terminators; context lines are
    in both lists, so `old_text` and `new_text` are contiguous blocks."""

    old_start: int  # 1-based first line of the block in the old file (0 when the old block is empty)
    old_lines: list[str] = field(default_factory=list)
    new_lines: list[str] = field(default_factory=list)
    new_start: int = 0

    @property
    def old_text(self) -> str:
        return "".join(self.old_lines)

    @property
    def new_text(self) -> str:
        return "".join(self.new_lines)


@dataclass
class FileDiff:
    """The changes to one file. Paths are without the `a/` `b/` prefixes;
    `old_path` is None for a new file and `new_path` None for a deleted one."""

    old_path: str | None
    new_path: str | None
    hunks: list[Hunk] = field(default_factory=list)
    is_new: bool = False
    is_deleted: bool = False
    is_binary: bool = False

    @property
    def path(self) -> str:
        """The file's path after the change (before it, for a deletion)."""
        return self.new_path or self.old_path or ""

    @property
    def is_rename(self) -> bool:
        return bool(self.old_path and self.new_path and self.old_path != self.new_path)

    def old_text_blocks(self) -> list[tuple[str, str]]:
        """(old_text, new_text) for each hunk, in file order: the arguments of
        one `edit_file` each. Hunks do not overlap, so they can be applied
        one after another. See `edit_blocks` for blocks made unique."""
        return [(h.old_text, h.new_text) for h in self.hunks]

    def new_content(self) -> str:
        """Whole content of a new file (for `write_file`)."""
        if not self.is_new:
            raise PatchError(f"{self.path}: new_content() is only defined for a new file")
        return "".join(h.new_text for h in self.hunks)

    def edit_blocks(self, current_text: str) -> list[tuple[str, str]]:
        """(old_text, new_text) pairs that each occur exactly once when applied
        in order to `current_text` (the file before this diff). Each is the
        smallest such edit: the hunk's unchanged context lines are dropped, and
        a block that is not unique (or empty) is widened by lines of the file
        around it until it is; that is what an agent calling `edit_file` has
        to send."""
        text = current_text
        out: list[tuple[str, str]] = []
        shift = 0  # how far earlier edits moved line numbers
        for hunk in self.hunks:
            lines = split_lines(text)
            start = _locate(
                lines, hunk.old_lines, hunk.old_start - 1 + shift if hunk.old_lines else hunk.old_start + shift
            )
            if start is None:
                raise PatchError(f"{self.path}: hunk at line {hunk.old_start} does not match the file")
            lead, trail = _shared_context(hunk.old_lines, hunk.new_lines)
            core_old = hunk.old_lines[lead : len(hunk.old_lines) - trail]
            core_new = "".join(hunk.new_lines[lead : len(hunk.new_lines) - trail])
            lo, hi = start + lead, start + lead + len(core_old)
            before, after = "", ""
            while True:
                old = before + "".join(core_old) + after
                if old and _occurs_once(text, old):
                    break
                if lo == 0 and hi >= len(lines):
                    break  # the whole file: unique by definition (or empty)
                if lo > 0:
                    lo -= 1
                    before = lines[lo] + before
                if hi < len(lines):
                    after = after + lines[hi]
                    hi += 1
            new = before + core_new + after
            out.append((old, new))
            index = text.find(old) if old else 0
            text = text[:index] + new + text[index + len(old) :]
            shift += len(hunk.new_lines) - len(hunk.old_lines)
        return out


def _shared_context(old: list[str], new: list[str]) -> tuple[int, int]:
    """How many leading and trailing lines the two sides of a hunk share (its unchanged context)."""
    lead = 0
    while lead < min(len(old), len(new)) and old[lead] == new[lead]:
        lead += 1
    trail = 0
    while trail < min(len(old), len(new)) - lead and old[-1 - trail] == new[-1 - trail]:
        trail += 1
    return lead, trail


def _occurs_once(text: str, block: str) -> bool:
    """Exactly one occurrence, overlapping ones counted (str.count does not)."""
    first = text.find(block)
    return first >= 0 and text.find(block, first + 1) < 0


def _locate(lines: list[str], block: list[str], expected: int) -> int | None:
    """Index where `block` occurs in `lines`, the one nearest `expected` first."""
    if not block:
        return max(0, min(expected, len(lines)))
    n = len(block)
    for delta in range(len(lines) + 1):
        for at in (expected - delta, expected + delta) if delta else (expected,):
            if 0 <= at <= len(lines) - n and lines[at : at + n] == block:
                return at
    return None


def _strip_prefix(path: str) -> str | None:
    path = path.split("\t")[0].strip()
    if path == "/dev/null":
        return None
    if len(path) > 1 and path.startswith('"') and path.endswith('"'):  # git's C-style quoting
        path = codecs.escape_decode(path[1:-1].encode())[0].decode("utf-8", "replace")
    if path[:2] in ("a/", "b/"):
        return path[2:]
    return path


def parse_unified_diff(text: str) -> list[FileDiff]:
    """Parse a unified diff (`git diff` or `diff -u` output) into FileDiffs."""
    lines = split_lines(text)
    files: list[FileDiff] = []
    current: FileDiff | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("diff --git "):
            m = re.match(r"^diff --git (\"?a/.*?\"?) (\"?b/.*\"?)$", line.rstrip("\r\n"))
            old, new = (_strip_prefix(m.group(1)), _strip_prefix(m.group(2))) if m else (None, None)
            current = FileDiff(old, new)
            files.append(current)
            i += 1
            continue
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            old, new = _strip_prefix(line[4:].rstrip("\r\n")), _strip_prefix(lines[i + 1][4:].rstrip("\r\n"))
            if current is None or current.hunks or current.is_binary:
                current = FileDiff(old, new)
                files.append(current)
            else:
                current.old_path, current.new_path = old, new
            current.is_new = current.is_new or old is None
            current.is_deleted = current.is_deleted or new is None
            i += 2
            continue
        if current is not None and not current.hunks:
            if line.startswith("new file mode"):
                current.is_new = True
                current.old_path = None
            elif line.startswith("deleted file mode"):
                current.is_deleted = True
                current.new_path = None
            elif line.startswith("rename from "):
                current.old_path = line[len("rename from ") :].rstrip("\r\n")
            elif line.startswith("rename to "):
                current.new_path = line[len("rename to ") :].rstrip("\r\n")
            elif line.startswith(("GIT binary patch", "Binary files ")):
                current.is_binary = True
        m = _HUNK_RE.match(line)
        if m:
            if current is None:
                raise PatchError(f"line {i + 1}: hunk header before any file header (--- / +++)")
            i = _parse_hunk(lines, i, m, current)
            continue
        i += 1
    for f in files:
        if not f.old_path and not f.new_path:
            raise PatchError("a file header without paths (expected `--- a/PATH` and `+++ b/PATH`)")
    return files


def _parse_hunk(lines: list[str], i: int, m: re.Match, current: FileDiff) -> int:
    old_len = int(m.group(2)) if m.group(2) is not None else 1
    new_len = int(m.group(4)) if m.group(4) is not None else 1
    hunk = Hunk(int(m.group(1)), [], [], int(m.group(3)))
    current.hunks.append(hunk)
    header_line = i + 1
    i += 1
    old_seen = new_seen = 0
    last: str = ""
    while i < len(lines) and (old_seen < old_len or new_seen < new_len or lines[i].startswith("\\")):
        line = lines[i]
        tag, body = line[:1], line[1:]
        if line.startswith("\\"):
            if line.rstrip("\r\n") != _NO_NEWLINE and not line.startswith("\\ "):
                raise PatchError(f"line {i + 1}: unexpected line {line.rstrip()!r} in hunk")
            sides = {"-": (hunk.old_lines,), "+": (hunk.new_lines,)}.get(last, (hunk.old_lines, hunk.new_lines))
            for side in sides:  # the line before the marker has no newline in that file
                if side and side[-1].endswith("\n"):
                    side[-1] = side[-1][:-1]
        elif tag == " " or line == "\n":  # some tools drop the space of empty context lines
            body = body if tag == " " else line
            hunk.old_lines.append(body)
            hunk.new_lines.append(body)
            old_seen += 1
            new_seen += 1
        elif tag == "-":
            hunk.old_lines.append(body)
            old_seen += 1
        elif tag == "+":
            hunk.new_lines.append(body)
            new_seen += 1
        else:
            break
        last = tag
        i += 1
    if old_seen != old_len or new_seen != new_len:
        raise PatchError(
            f"line {header_line}: hunk {m.group(0)!r} promises {old_len} old and {new_len} new "
            f"lines but has {old_seen} and {new_seen}"
        )
    return i


def apply_file_diff(old_text: str, diff: FileDiff) -> str:
    """The file after `diff`, given its text before (\"\" for a new file).
    Hunks must match exactly; a hunk found a few lines away from its stated
    position is accepted (like `git apply`)."""
    if diff.is_binary:
        raise PatchError(f"{diff.path}: binary patches cannot be applied in memory")
    lines = split_lines(old_text)
    out: list[str] = []
    pos = 0
    for hunk in diff.hunks:
        expected = hunk.old_start - 1 if hunk.old_lines else hunk.old_start
        at = _locate(lines[pos:], hunk.old_lines, expected - pos)
        if at is None:
            raise PatchError(
                f"{diff.path}: hunk @@ -{hunk.old_start} does not match the file "
                f"(first expected line: {hunk.old_lines[0].rstrip()!r})"
            )
        at += pos
        out.extend(lines[pos:at])
        out.extend(hunk.new_lines)
        pos = at + len(hunk.old_lines)
    out.extend(lines[pos:])
    return "".join(out)


def apply_unified_diff(files: dict[str, str], text: str) -> dict[str, str]:
    """`files` (path -> text) after the diff `text`; new files added, deleted removed."""
    result = dict(files)
    for diff in parse_unified_diff(text):
        if diff.is_new:
            if diff.new_path in result:
                raise PatchError(f"{diff.new_path}: the diff creates it but it already exists")
            result[diff.new_path] = apply_file_diff("", diff)
            continue
        if diff.old_path not in result:
            raise PatchError(f"{diff.old_path}: the diff changes it but it does not exist")
        old = result.pop(diff.old_path)
        if not diff.is_deleted:
            result[diff.new_path] = apply_file_diff(old, diff)
    return result


# -- making diffs ---------------------------------------------------------------------


def _range(start: int, length: int) -> str:
    """difflib's unified range: 1-based start, `start,len`, the line before an empty block."""
    first = start + 1
    if length == 1:
        return str(first)
    if length == 0:
        first -= 1
    return f"{first},{length}"


def _diff_lines(line: str, tag: str) -> list[str]:
    if line.endswith("\n"):
        return [tag + line]
    return [tag + line + "\n", _NO_NEWLINE + "\n"]


def make_unified_diff(files_before: dict[str, str], files_after: dict[str, str], context_lines: int = 3) -> str:
    """A `git apply`-able unified diff (`diff --git a/P b/P` headers, sorted by
    path) that turns `files_before` into `files_after` (path -> text)."""
    chunks: list[str] = []
    for path in sorted(set(files_before) | set(files_after)):
        before, after = files_before.get(path), files_after.get(path)
        if before == after:
            continue
        a = split_lines(before or "")
        b = split_lines(after or "")
        header = [f"diff --git a/{path} b/{path}\n"]
        if before is None:
            header += ["new file mode 100644\n", "--- /dev/null\n", f"+++ b/{path}\n"]
        elif after is None:
            header += ["deleted file mode 100644\n", f"--- a/{path}\n", "+++ /dev/null\n"]
        else:
            header += [f"--- a/{path}\n", f"+++ b/{path}\n"]
        body: list[str] = []
        matcher = difflib.SequenceMatcher(None, a, b, autojunk=False)
        for group in matcher.get_grouped_opcodes(context_lines):
            i1, i2, j1, j2 = group[0][1], group[-1][2], group[0][3], group[-1][4]
            body.append(f"@@ -{_range(i1, i2 - i1)} +{_range(j1, j2 - j1)} @@\n")
            for tag, ai1, ai2, bj1, bj2 in group:
                if tag == "equal":
                    for line in a[ai1:ai2]:
                        body += _diff_lines(line, " ")
                    continue
                for line in a[ai1:ai2]:
                    body += _diff_lines(line, "-")
                for line in b[bj1:bj2]:
                    body += _diff_lines(line, "+")
        chunks.append("".join(header + body))
    return "".join(chunks)
