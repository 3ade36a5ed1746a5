"""The agent's tools, as OpenAI function schemas, executed against a Sandbox.

The seven tools and their arguments are the same everywhere (product CLI,
RL rollouts, demonstrations): `search`, `read_file`, `edit_file`,
`write_file`, `list_dir`, `run`, `submit`. Each call comes back as a
ToolResult whose `output` is what the model reads next.

Nothing a model writes can crash the harness: unknown tools, missing,
mistyped or unknown arguments, oversized arguments, paths outside the
workspace and failing file operations all become an error observation
(`ok=False`, output starting with "error:") that says what to do instead.
Every output is capped (`ToolConfig.max_output_chars`) so one `cat` of a log
cannot flood the model's context, and is valid UTF-8 (`printable`: a file
name that is not shows its bytes as \\xNN escapes).

`run` goes through the sandbox's persistent shell (cwd and environment
persist between calls). When one turn holds several `run` calls they must
run side by side, which one shell cannot do, so each runs as a separate
process that starts from the shell's cwd and exported environment
(`parallel=True`); changes they make to cwd or environment do not persist.
"""

from __future__ import annotations

import math
import shlex
import time
from dataclasses import dataclass

from codefleet.contracts import ExactBytes, Sandbox
from codefleet.sandbox.base import SandboxError
from codefleet.sandbox.files import FileTooLargeError
from codefleet.types import ToolCall, ToolResult


@dataclass
class ToolConfig:
    """Caps on what goes into and comes out of tools."""

    max_output_chars: int = 16_000  # per tool result, head and tail kept
    max_argument_chars: int = 256_000  # the raw JSON arguments of one call
    default_run_timeout_s: float = 120.0
    max_run_timeout_s: float = 900.0
    max_search_matches: int = 100
    max_list_entries: int = 400


@dataclass(frozen=True)
class Param:
    type: str  # JSON schema type: "string" | "integer" | "number"
    description: str
    required: bool = False


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    params: dict[str, Param]

    def schema(self) -> dict:
        """The OpenAI function-calling schema of this tool."""
        properties = {k: {"type": p.type, "description": p.description} for k, p in self.params.items()}
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": {
                    "type": "object",
                    "properties": properties,
                    "required": [k for k, p in self.params.items() if p.required],
                    "additionalProperties": False,
                },
            },
        }


_PATH = "Path relative to the repository root (the workspace)."
TOOL_SPECS: dict[str, ToolSpec] = {
    s.name: s
    for s in [
        ToolSpec(
            "search",
            "Search file contents for a regular expression (grep -E syntax), recursively. Returns "
            "matching lines as path:line:text.",
            {
                "pattern": Param("string", "Extended regular expression to look for.", True),
                "path": Param("string", "File or directory to search in (default: the whole repository)."),
            },
        ),
        ToolSpec(
            "read_file",
            "Read a text file. Each line is prefixed with its number and a tab (the prefix is not "
            "part of the file). Use start_line/end_line for long files.",
            {
                "path": Param("string", _PATH, True),
                "start_line": Param("integer", "First line to read, 1-based (default 1)."),
                "end_line": Param("integer", "Last line to read, inclusive (default: the end)."),
            },
        ),
        ToolSpec(
            "edit_file",
            "Replace exactly one occurrence of old_text with new_text in a file. old_text must "
            "match the file exactly (whitespace included) and occur exactly once; include surrounding lines to "
            "make it unique.",
            {
                "path": Param("string", _PATH, True),
                "old_text": Param("string", "The exact text to replace (without line-number prefixes).", True),
                "new_text": Param("string", "The text to put in its place.", True),
            },
        ),
        ToolSpec(
            "write_file",
            "Create a file, or replace its whole content. Parent directories are created.",
            {
                "path": Param("string", _PATH, True),
                "content": Param("string", "The complete new content of the file.", True),
            },
        ),
        ToolSpec(
            "list_dir",
            "List a directory and its subdirectories one level down (.git and caches skipped).",
            {"path": Param("string", "Directory to list (default: the repository root).")},
        ),
        ToolSpec(
            "run",
            "Run a bash command in the repository (a persistent shell: cd and export persist). "
            "Returns its output and exit code. Several run calls in one turn run in parallel.",
            {
                "command": Param("string", "The bash command line.", True),
                "timeout": Param("number", "Seconds before the command is killed (default 120)."),
            },
        ),
        ToolSpec(
            "submit",
            "Finish: call this when the task is done. Your changes to the files are the result.",
            {"summary": Param("string", "A short summary of what you changed and why.")},
        ),
    ]
}

_SKIP_DIRS = {".git", "__pycache__", "node_modules", ".venv", ".mypy_cache", ".pytest_cache", ".tox"}
# `.codefleet` at the workspace root is the harness's own (workspace.py: the git directory that the diff is
# taken with); search and list_dir leave it out. Its text files hold a handful of lines, which search asks
# for on top of its cap so that they cannot crowd out real matches.
PRIVATE_DIR = ".codefleet"
_PRIVATE_LINES = 50


def _private(path: str) -> bool:
    return path == PRIVATE_DIR or path.startswith(PRIVATE_DIR + "/")


def tool_schemas(names: list[str] | None = None) -> list[dict]:
    """The OpenAI `tools` list, for all tools or the ones named."""
    return [TOOL_SPECS[n].schema() for n in (names or list(TOOL_SPECS))]


# Lines read from a file over the file API's size limit when no end_line is given (the output is capped anyway).
_BIG_FILE_LINES = 2000


class ToolError(Exception):
    """A call the tool refuses; the message goes back to the model."""


def printable(text: str) -> str:
    """`text` as valid UTF-8, which every model client, tokenizer and log needs: the bytes of a file name
    that is not UTF-8 (which Python keeps as surrogates, as the file API gives them) become \\xNN escapes
    (in bash, `$'\\xff.txt'` names such a file); any other lone surrogate becomes \\udNNN."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that stands for no byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def cap_text(text: str, max_chars: int) -> str:
    """`text` cut to about max_chars, keeping its head and tail with a marker in between."""
    if len(text) <= max_chars:
        return text
    head = max_chars * 2 // 3
    tail = max_chars - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n[... {cut} characters cut; narrow the command or read a line range ...]\n{text[-tail:]}"


def validate(call: ToolCall, config: ToolConfig) -> dict:
    """The call's arguments, checked against its tool's schema; raises ToolError saying what is wrong."""
    spec = TOOL_SPECS.get(call.name)
    if spec is None and call.error and not call.name:  # a call block the parser could not read at all
        raise ToolError(call.error)
    if spec is None:
        raise ToolError(f"unknown tool {call.name!r}; the tools are {', '.join(TOOL_SPECS)}")
    if len(call.raw_arguments) > config.max_argument_chars:
        raise ToolError(
            f"the arguments of {call.name} are {len(call.raw_arguments)} characters, over the cap of "
            f"{config.max_argument_chars}; make smaller changes (edit_file) or split the work"
        )
    if call.error or call.arguments is None:
        raise ToolError(call.error or f"the arguments of {call.name!r} could not be read")
    args = {k: v for k, v in call.arguments.items() if v is not None}  # null means "not given"
    unknown = sorted(set(args) - set(spec.params))
    if unknown:
        raise ToolError(
            f"{call.name} got unknown argument(s) {', '.join(map(repr, unknown))}; it takes "
            f"{', '.join(spec.params) or 'no arguments'}"
        )
    for key, param in spec.params.items():
        if key not in args:
            if param.required:
                raise ToolError(f"{call.name} needs the argument {key!r} ({param.type}): {param.description}")
            continue
        value = args[key]
        ok = {
            "string": isinstance(value, str),
            "integer": isinstance(value, int) and not isinstance(value, bool),
            "number": isinstance(value, int | float) and not isinstance(value, bool),
        }[param.type]
        if not ok:
            raise ToolError(
                f"argument {key!r} of {call.name} must be a {param.type}, got "
                f"{type(value).__name__} {str(value)[:60]!r}"
            )
        if param.type == "number" and not math.isfinite(value):  # json.loads accepts NaN and Infinity
            raise ToolError(f"argument {key!r} of {call.name} must be a finite number, got {value}")
    return args


class Toolbox:
    """Executes tool calls against one sandbox. Safe to call from several threads."""

    def __init__(self, sandbox: Sandbox, config: ToolConfig | None = None):
        self.sandbox = sandbox
        self.config = config or ToolConfig()

    def execute(
        self, call: ToolCall, parallel: bool = False, shell_state: str = "", max_timeout_s: float | None = None
    ) -> ToolResult:
        """Run one call; never raises. `parallel`/`shell_state`: run as a separate process (see module doc);
        `max_timeout_s` caps a command's timeout (e.g. by the time left in the episode)."""
        started = time.perf_counter()
        ok = True
        try:
            args = validate(call, self.config)
            if call.name == "run":
                output, ok = self._run(args, parallel, shell_state, max_timeout_s)
            else:
                output = getattr(self, "_" + call.name)(**args)
        except ToolError as e:
            output, ok = f"error: {e}", False
        except (SandboxError, OSError, ValueError, UnicodeError) as e:  # PathEscapeError is both
            output, ok = f"error: {e}", False
        except Exception as e:  # a bug in a tool must not end the episode
            output, ok = f"error: {call.name} failed unexpectedly ({type(e).__name__}: {e})", False
        return ToolResult(
            call.id,
            call.name,
            cap_text(printable(output), self.config.max_output_chars),
            ok,
            time.perf_counter() - started,
        )

    # -- the tools ---------------------------------------------------------------------

    def _search(self, pattern: str, path: str = ".") -> str:
        if not pattern:
            raise ToolError("search needs a non-empty pattern")
        limit = self.config.max_search_matches
        matches = [
            m
            for m in self.sandbox.search(pattern, path or ".", max_matches=limit + 1 + _PRIVATE_LINES)
            if not _private(m.path)
        ]
        if not matches:
            return f"no matches for {pattern!r} in {path}"
        lines = [f"{m.path}:{m.line_number}:{m.line[:300]}" for m in matches[:limit]]
        if len(matches) > limit:
            lines.append(f"[more than {limit} matches; narrow the pattern or the path]")
        return "\n".join(lines)

    def _read_file(self, path: str, start_line: int = 1, end_line: int | None = None) -> str:
        if start_line < 1 or (end_line is not None and end_line < start_line):
            raise ToolError(
                f"read_file needs 1 <= start_line <= end_line, got start_line={start_line}, end_line={end_line}"
            )
        try:
            text, first = self.sandbox.read_file(path), 1
        except FileTooLargeError:  # only the lines asked for are read; how many the file has is not known then
            wanted = end_line if end_line is not None else start_line + _BIG_FILE_LINES - 1
            text, first = self.sandbox.read_file(path, start_line, wanted), start_line
        # split on \n only (not str.splitlines, which also splits on \f, \x1c, ...): numbers match sed and editors
        lines = [ln.removesuffix("\r") for ln in text.removesuffix("\n").split("\n")] if text else []
        total: int | str = len(lines) if first == 1 else "a file too large to count"
        if not lines and first == 1:
            return f"[{path} is empty]"
        if not lines or start_line > first + len(lines) - 1:
            raise ToolError(
                f"{path} has {len(lines) if first == 1 else 'fewer'} lines; start_line {start_line} is past the end"
            )
        last = first + len(lines) - 1 if end_line is None else min(end_line, first + len(lines) - 1)
        out: list[str] = []
        size = 0
        for number in range(start_line, last + 1):
            line = f"{number:>6}\t{lines[number - first]}"
            if size + len(line) > self.config.max_output_chars - 200 and out:
                out.append(f"[output capped at line {number - 1} of {total}; read on with start_line={number}]")
                break
            out.append(line)
            size += len(line) + 1
        return "\n".join(out)

    def _edit_file(self, path: str, old_text: str, new_text: str) -> str:
        if not old_text:
            raise ToolError("edit_file needs a non-empty old_text; use write_file to create or replace a file")
        if old_text == new_text:
            raise ToolError("old_text and new_text are identical; there is nothing to change")
        text = self._read_exact(path)
        count = text.count(old_text)
        if count == 0 and "\r\n" in text and "\r\n" not in old_text:  # a CRLF file, edited as read_file shows it
            old_text, new_text = old_text.replace("\n", "\r\n"), new_text.replace("\n", "\r\n")
            count = text.count(old_text)
        if count == 0 and "\ufffd" in old_text and any("\udc80" <= ch <= "\udcff" for ch in text):
            raise ToolError(
                f"old_text was not found in {path}: the file has bytes that are not UTF-8, which "
                "read_file shows as \ufffd; choose an old_text without them, or change those lines "
                "with run"
            )
        if count == 0:
            raise ToolError(
                f"old_text was not found in {path}; it must match the file exactly, whitespace and "
                "indentation included (read_file the region again and copy it without the "
                "line-number prefixes)"
            )
        if count > 1:
            raise ToolError(
                f"old_text occurs {count} times in {path}; it must be unique — include more surrounding lines"
            )
        at = text.index(old_text)
        edited = text[:at] + new_text + text[at + len(old_text) :]
        self.sandbox.write_file(path, edited.encode("utf-8", "surrogateescape"))
        first = text.count("\n", 0, at) + 1
        return (
            f"edited {path}: replaced {old_text.count(chr(10)) + 1} line(s) at line {first} with "
            f"{new_text.count(chr(10)) + 1} line(s)"
        )

    def _read_exact(self, path: str) -> str:
        text = read_exact(self.sandbox, path)
        if text is None:
            raise ToolError(
                f"{path} has bytes that are not UTF-8, which edit_file cannot keep intact in this "
                "sandbox; change it with run (e.g. sed or python)"
            )
        return text

    def _write_file(self, path: str, content: str) -> str:
        self.sandbox.write_file(path, content)
        return f"wrote {len(content.encode())} bytes ({content.count(chr(10))} lines) to {path}"

    def _list_dir(self, path: str = ".") -> str:
        limit = self.config.max_list_entries
        out: list[str] = []
        for entry in self.sandbox.list_dir(path or "."):
            if len(out) >= limit:
                break
            if _private(entry.path):
                continue
            out.append(_describe(entry, ""))
            if entry.kind == "dir" and entry.path.rsplit("/", 1)[-1] not in _SKIP_DIRS:
                for child in self.sandbox.list_dir(entry.path)[: max(limit - len(out), 0)]:
                    out.append(_describe(child, "  "))
        if len(out) >= limit:
            out.append(f"[listing capped at {limit} entries; list a subdirectory]")
        return "\n".join(out) if out else f"[{path} is empty]"

    def _run(self, args: dict, parallel: bool, shell_state: str, max_timeout_s: float | None) -> tuple[str, bool]:
        command: str = args["command"]
        if not command.strip():
            raise ToolError("run needs a non-empty command")
        timeout_s = float(args.get("timeout", self.config.default_run_timeout_s))
        if timeout_s <= 0:
            raise ToolError(f"timeout must be positive, got {timeout_s:g}")
        timeout_s = min(timeout_s, self.config.max_run_timeout_s)
        if max_timeout_s is not None:
            timeout_s = max(min(timeout_s, max_timeout_s), 1.0)
        if parallel:
            result = self.sandbox.run_oneoff(["bash", "-c", f"{shell_state}\n{command}"], timeout_s=timeout_s)
        else:
            result = self.sandbox.exec(command, timeout_s=timeout_s)
        output = result.output if result.output.endswith("\n") or not result.output else result.output + "\n"
        return f"{output}[exit code {result.exit_code}]", result.ok

    def _submit(self, summary: str = "") -> str:
        return "submitted"

    def shell_state(self) -> str:
        """Bash lines recreating the shell's cwd and exported variables (for parallel `run` calls)."""
        result = self.sandbox.exec("builtin pwd; builtin export -p", timeout_s=10)
        lines = result.output.splitlines()
        if not result.ok or not lines:
            return ""
        keep = [
            ln
            for ln in lines[1:]
            if ln.startswith("declare -x ") and ln.split()[2].split("=")[0] not in ("PWD", "OLDPWD", "SHLVL", "_")
        ]
        return "\n".join([f"cd {shlex.quote(lines[0])} 2>/dev/null", *keep])


def read_exact(sandbox: Sandbox, path: str) -> str | None:
    """The text of `path` with every byte that is not UTF-8 kept as a surrogate (surrogateescape), so that
    encoding it back the same way restores those bytes exactly (read_file shows them as \ufffd, and writing
    that back would corrupt them). None when the file has such bytes and the sandbox cannot give bytes."""
    text = sandbox.read_file(path)
    if "\ufffd" not in text:
        return text
    if not isinstance(sandbox, ExactBytes):
        return None
    return sandbox.read_bytes(path).decode("utf-8", "surrogateescape")


def _describe(entry, indent: str) -> str:
    if entry.kind == "dir":
        return f"{indent}{entry.path}/"
    if entry.kind == "symlink":
        return f"{indent}{entry.path} -> (symlink)"
    return f"{indent}{entry.path}  ({entry.size_bytes} B)"
