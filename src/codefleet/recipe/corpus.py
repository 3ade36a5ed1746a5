"""codefleet's own training corpus: built locally, deterministically, no downloads.

    texts = build_corpus(CorpusConfig(n_tasks=120))   # list[str], same list every time

Three kinds of documents, in this order:

1. Task code. `n_tasks` tasks of the bundled families are generated into a
   temporary directory (`tasks.generate_tasks`, split "all", fixed seed);
   every file of their repositories (deduplicated by content, sorted by
   path) and every reference patch becomes a document.
2. Agent transcripts in the chat template (`codefleet_template.render`). For each of the
   first `n_transcripts` tasks the scripted expert solves the task turn by
   turn through the real `Toolbox`, run against an in-memory copy of the
   repository (`MemoryRepo`), so tool results have exactly the format the
   agent sees: list_dir, search, read_file with line numbers, edit_file,
   run, submit. The test command's output is a fixed stand-in (no
   processes run: timings would make the corpus non-deterministic).
3. The project's own Python source (`codefleet/**/*.py`, sorted).

The corpus is a function of the code of this checkout; `fingerprint(texts)`
names it. The tokenizer trained on it is frozen in assets/ (see
tokenizer.py), so edits to the code do not change the shipped vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass

import tokenizers

import codefleet
from codefleet.agent.clients.scripted import ScriptedExpert
from codefleet.agent.policy import assistant_message
from codefleet.agent.prompts import build_messages
from codefleet.agent.tools import Toolbox, tool_schemas
from codefleet.chat.codefleet_template import render
from codefleet.chat.tokenizer import (
    ASSETS_DIR,
    DEFAULT_MIN_FREQUENCY,
    DEFAULT_VOCAB_SIZE,
    TOKENIZER_FILE,
    Tokenizer,
    write,
)
from codefleet.tasks import generate_tasks
from codefleet.types import ExecResult, FileEntry, SearchMatch


@dataclass
class CorpusConfig:
    n_tasks: int = 120  # tasks generated for their code (families cycle, so 24 per family)
    n_transcripts: int = 60  # of those, how many the scripted expert solves into transcripts
    seed: int = 0
    include_src: bool = True  # the project's own Python files

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def build_corpus(config: CorpusConfig | None = None) -> list[str]:
    """The corpus documents, in a fixed order."""

    config = config or CorpusConfig()
    with tempfile.TemporaryDirectory(prefix="codefleet-corpus-") as tmp:
        tasks = generate_tasks(tmp, config.n_tasks, seed=config.seed, split="all")
        repos = [_read_repo(t.repo) for t in tasks]
    docs: list[str] = []
    seen: set[str] = set()
    for files in repos:
        for path in sorted(files):
            if files[path] not in seen:
                seen.add(files[path])
                docs.append(files[path])
    docs += [t.reference_patch for t in tasks if t.reference_patch]
    docs += [transcript(task, files) for task, files in list(zip(tasks, repos))[: config.n_transcripts]]
    if config.include_src:
        docs += source_files()
    return [d for d in docs if d]


def fingerprint(texts: list[str]) -> str:
    """sha256 over the documents and their boundaries."""
    h = hashlib.sha256()
    for text in texts:
        data = text.encode("utf-8", errors="surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def source_files() -> list[str]:
    """The text of every Python file of the installed codefleet package, sorted by path."""
    root = os.path.dirname(os.path.abspath(codefleet.__file__))
    return [text for _, text in sorted(_read_repo(root, suffix=".py").items())]


def _read_repo(root: str, suffix: str = "") -> dict[str, str]:
    files: dict[str, str] = {}
    for directory, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in {".git", "__pycache__"})
        for name in sorted(names):
            if not name.endswith(suffix):
                continue
            full = os.path.join(directory, name)
            try:
                with open(full, encoding="utf-8", newline="") as f:
                    files[os.path.relpath(full, root)] = f.read()
            except UnicodeDecodeError:
                continue  # binary files are not corpus text
    return files


# -- transcripts ---------------------------------------------------------------------------


class MemoryRepo:
    """The part of the Sandbox interface the Toolbox uses, over a dict of files (no processes)."""

    id = "memory"

    def __init__(self, files: dict[str, str], test_command: str = ""):
        self.files = dict(files)
        self.test_command = test_command

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str:
        path = os.path.normpath(path)
        if path not in self.files:
            raise FileNotFoundError(f"no such file: {path}")
        return self.files[path]

    def write_file(self, path: str, content: str | bytes) -> None:
        self.files[os.path.normpath(path)] = content if isinstance(content, str) else content.decode()

    def list_dir(self, path: str = ".", recursive: bool = False) -> list[FileEntry]:
        prefix = "" if os.path.normpath(path) == "." else os.path.normpath(path) + "/"
        entries: dict[str, FileEntry] = {}
        for name, text in self.files.items():
            if not name.startswith(prefix):
                continue
            head, sep, _ = name[len(prefix) :].partition("/")
            entry_path = prefix + head
            entries[entry_path] = (
                FileEntry(entry_path, "dir", 0) if sep else FileEntry(entry_path, "file", len(text.encode()))
            )
        return [entries[k] for k in sorted(entries)]

    def search(self, pattern: str, path: str = ".", max_matches: int = 200) -> list[SearchMatch]:
        regex = re.compile(pattern)
        prefix = "" if os.path.normpath(path) == "." else os.path.normpath(path)
        matches: list[SearchMatch] = []
        for name in sorted(self.files):
            if prefix and name != prefix and not name.startswith(prefix + "/"):
                continue
            for number, line in enumerate(self.files[name].split("\n"), 1):
                if regex.search(line) and len(matches) < max_matches:
                    matches.append(SearchMatch(name, number, line))
        return matches

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        if command.startswith("rm -f "):
            self.files.pop(command[len("rm -f ") :].strip("'"), None)
            return ExecResult("", 0)
        if command == self.test_command:
            tests = sum(text.count("\ndef test_") for name, text in self.files.items() if "test" in name)
            return ExecResult(f"{'.' * tests}{' ' * max(0, 72 - tests)}[100%]\n{tests} passed\n", 0)
        return ExecResult(f"bash: {command.split()[0] if command.split() else ''}: command not found\n", 127)

    run_oneoff = None  # parallel runs are not simulated; the corpus runs calls one by one


def transcript(task, files: dict[str, str]) -> str:
    """The scripted expert solving `task`, rendered in the chat template."""

    toolbox = Toolbox(MemoryRepo(files, task.test_command))  # type: ignore[arg-type]
    expert = ScriptedExpert(task)
    tools = tool_schemas()
    messages = build_messages(task.instruction, task.test_command)
    for _ in range(len(expert.steps) + 1):
        output = expert.generate(messages, tools)
        messages.append(assistant_message(output))
        for call in output.tool_calls:
            result = toolbox.execute(call)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result.output})
        if not output.tool_calls or any(c.name == "submit" for c in output.tool_calls):
            break
    return render(messages, tools, add_generation_prompt=False)


# -- the default tokenizer, trained on this corpus ------------------------------------------


def build_default(
    vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = DEFAULT_MIN_FREQUENCY
) -> tuple[Tokenizer, dict]:
    """Train on the default corpus; returns the tokenizer and the recipe (what meta.json records)."""

    config = CorpusConfig()
    texts = build_corpus(config)
    started = time.perf_counter()
    tok = Tokenizer.train(texts, vocab_size, min_frequency)
    meta = {
        "vocab_size": tok.vocab_size,
        "min_frequency": min_frequency,
        "corpus": config.to_dict(),
        "corpus_fingerprint": fingerprint(texts),
        "corpus_documents": len(texts),
        "corpus_bytes": sum(len(t.encode()) for t in texts),
        "tokenizers_version": tokenizers.__version__,
        "train_s": round(time.perf_counter() - started, 2),
        "rebuild": "python -m codefleet.recipe.corpus build",
    }
    return tok, meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m codefleet.recipe.corpus", description="Build the default tokenizer from codefleet's own corpus."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="train on the default corpus and write tokenizer.json + meta")
    build.add_argument("--out", default=ASSETS_DIR, help="output directory (default: the package assets)")
    build.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = parser.parse_args(argv)
    tok, meta = build_default(args.vocab_size)
    write(args.out, tok, meta)
    size = os.path.getsize(os.path.join(args.out, TOKENIZER_FILE))
    print(
        f"wrote {args.out}/{TOKENIZER_FILE} ({size / 1024:.0f} KiB): vocab {tok.vocab_size}, corpus "
        f"{meta['corpus_documents']} documents / {meta['corpus_bytes'] / 1e6:.2f} MB, trained in {meta['train_s']} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
