"""The documentation's links hold: every relative link in README.md, CONTRIBUTING.md and docs/ reaches a file (and
its heading, when it names one), every page under docs/ that code, tests, configs or scripts name exists, and
docs/index.md lists every page outside docs/experiments/. A page renamed without its links fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
MENTION = re.compile(r"(?<![\w/.-])docs/[\w./-]*?\.md\b")
MENTION_DIRS = ("src", "tests", "deploy", "scripts", "configs", ".ci")
MENTION_FILES = ("Makefile", "pyproject.toml", "README.md", "CONTRIBUTING.md")


def markdown_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted(DOCS.rglob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def broken_links(page: Path) -> list[str]:
    text = re.sub(r"`[^`]+`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve()
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {path or page.name}")
    return broken


def test_every_relative_link_in_the_docs_reaches_its_file_and_heading():
    broken = {str(page.relative_to(ROOT)): bad for page in markdown_files() if (bad := broken_links(page))}
    assert not broken, f"links that lead nowhere (fix the link, or the page's name): {broken}"


def test_every_doc_page_that_code_or_docs_mention_exists():
    files = [ROOT / name for name in MENTION_FILES] + [
        path
        for folder in MENTION_DIRS
        if (ROOT / folder).exists()
        for path in sorted((ROOT / folder).rglob("*"))
        if path.is_file() and not any(part.endswith(".egg-info") or part == "__pycache__" for part in path.parts)
    ]
    files += markdown_files()
    missing = {}
    for path in files:
        if path.suffix in (".pyc", ".so", ".gz", ".parquet", ".safetensors"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        gone = sorted({m for m in MENTION.findall(text) if not (ROOT / m).exists()})
        if gone:
            missing[str(path.relative_to(ROOT))] = gone
    assert not missing, f"mentions of doc pages that do not exist (name the page as it is now): {missing}"


def test_the_index_lists_every_page_outside_the_experiments():
    index = DOCS / "index.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for target in LINK.findall(index.read_text())}
    pages = {page.resolve() for page in DOCS.rglob("*.md") if "experiments" not in page.relative_to(DOCS).parts}
    unlisted = sorted(str(page.relative_to(ROOT)) for page in pages - linked - {index.resolve()})
    assert not unlisted, f"pages docs/index.md does not list (add a line for each): {unlisted}"


def test_the_link_checker_finds_a_broken_link_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# A page\n\n## The part\n\nSee [b](b.md), [part](#the-part).\n")
    (tmp_path / "c.md").write_text(
        "[ok](a.md#the-part) [gone](a.md#no-such-part) [none](nowhere.md)\n```\n[in code](ignored.md)\n```\n"
    )
    assert broken_links(tmp_path / "a.md") == ["b.md: no such file"]
    assert [bad.split(":")[0] for bad in broken_links(tmp_path / "c.md")] == ["a.md#no-such-part", "nowhere.md"]
    assert slug("Scale: `codefleet bench scale`") == "scale-codefleet-bench-scale"
