"""docs/configuration.md, generated from TrainRunConfig's dataclasses and the `#` comments on their fields.

A field's meaning is the comment lines directly above it (joined) plus any trailing comment on its own
lines, read from the class's source with `tokenize` (so a `#` inside a string is no comment). Defaults
are those of `TrainRunConfig()`, which are each component's own (a recipe's values are in its YAML file,
printed at the end). Each top-level section gets a table; a dataclass nested in it (`rl.loss`) gets a table
of its own below, headed by its field's comment.

    .venv/bin/python -m codefleet.recipe.config_doc > docs/configuration.md

tests/test_config_docs.py fails when a field has no comment (`undocumented()`) or the file is stale.
"""

from __future__ import annotations

import ast
import dataclasses
import glob
import inspect
import io
import json
import os
import textwrap
import tokenize
import typing

from codefleet.recipe.config import RECIPES_DIR, TrainRunConfig

HEADER = """# Configuration of `codefleet train`

Every field of a training run's configuration (`TrainRunConfig` in `src/codefleet/recipe/config.py` and
the component configs it holds), with its type, its default and what it does. Set any field from a YAML
file whose nesting follows the dotted names, or on the command line:

    codefleet train --out runs/r1 --config my.yaml rl.steps=48 sandbox.memory_mb=2048

Command-line values are read as YAML (`0.5`, `true`, `null`, `[a, b]`) and checked against the field's type.
The defaults below are the components' own (`TrainRunConfig()`: each setting is declared once, next to the
component it configures); a recipe file (the field `recipe`, default `demo`, shown at the end), `--config`
and the overrides are layered over them, each over the one before.

This file is generated from the dataclasses and the comments on their fields; do not edit it by hand. After
changing a field or its comment, run `.venv/bin/python -m codefleet.recipe.config_doc > docs/configuration.md`.
"""

Row = tuple[str, str, str, str]  # dotted name, type, default, meaning


def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment} for the fields `cls` itself declares; a field without a comment maps to ""."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # line number -> comment text
    whole_lines: set[int] = set()  # lines that hold nothing but a comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            comments[row] = tok.string.lstrip("#").strip()
            if tok.line.lstrip().startswith("#"):
                whole_lines.add(row)
    (class_def,) = ast.parse(source).body
    found = {}
    for stmt in class_def.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        above = []
        row = stmt.lineno - 1
        while row in whole_lines:
            above.insert(0, comments[row])
            row -= 1
        trailing = [comments[r] for r in range(stmt.lineno, stmt.end_lineno + 1) if r in comments]
        found[stmt.target.id] = " ".join(text for text in above + trailing if text)
    return found


def type_name(tp: typing.Any) -> str:
    if isinstance(tp, type) and not typing.get_args(tp):
        return tp.__name__
    return str(tp).replace("typing.", "")


def default_text(value: typing.Any) -> str:
    return json.dumps(value, default=repr)  # YAML reads JSON: the text can be pasted as an override


def _rows(config: typing.Any, prefix: str) -> tuple[list[Row], list[tuple[str, typing.Any, str]]]:
    """The (name, type, default, meaning) rows of `config`'s plain fields, and its nested sections
    as (dotted name, instance, comment)."""
    cls = type(config)
    hints = typing.get_type_hints(cls)
    comments = field_comments(cls)
    rows, sections = [], []
    for f in dataclasses.fields(cls):
        value, name = getattr(config, f.name), prefix + f.name
        if dataclasses.is_dataclass(value):
            sections.append((name, value, comments.get(f.name, "")))
        else:
            rows.append((name, type_name(hints[f.name]), default_text(value), comments.get(f.name, "")))
    return rows, sections


def field_rows(config: typing.Any | None = None) -> list[Row]:
    """The (dotted name, type, default, meaning) of every plain field under `config`, depth first."""
    rows, sections = _rows(TrainRunConfig() if config is None else config, "")
    for name, value, _ in sections:
        rows += [(name + "." + row[0], *row[1:]) for row in field_rows(value)]
    return rows


def undocumented(config: typing.Any | None = None) -> list[str]:
    """The dotted names of the fields (sections aside) that have no comment."""
    return [name for name, _, _, meaning in field_rows(config) if not meaning]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _table(rows: list[Row]) -> list[str]:
    lines = ["| field | type | default | meaning |", "| --- | --- | --- | --- |"]
    for name, tp, default, meaning in rows:
        lines.append(f"| `{_cell(name)}` | `{_cell(tp)}` | `{_cell(default)}` | {_cell(meaning)} |")
    return lines + [""]


def _class_doc(cls: type) -> str:
    """The class's own docstring, not the signature dataclass writes for a class without one."""
    doc = inspect.getdoc(cls) or ""
    return "" if doc.startswith(cls.__name__ + "(") else doc


def _section(name: str, config: typing.Any, comment: str, level: str) -> list[str]:
    rows, sections = _rows(config, name + ".")
    lines = [f"{level} `{name}` ({type(config).__name__})", ""]
    lines += [text + "\n" for text in (comment, _class_doc(type(config))) if text]
    lines += _table(rows)
    for sub_name, sub_config, sub_comment in sections:
        lines += _section(sub_name, sub_config, sub_comment, level + "#")
    return lines


def render(config: typing.Any | None = None) -> str:
    """The Markdown of docs/configuration.md."""
    rows, sections = _rows(TrainRunConfig() if config is None else config, "")
    lines = [HEADER, "## Top level", ""] + _table(rows)
    for name, section, comment in sections:
        lines += _section(name, section, comment, "##")
    lines += [
        "## Recipes",
        "",
        "The recipe files shipped in `codefleet/recipe/configs/`, which `recipe: NAME` layers over the defaults above:",
        "",
    ]
    for path in sorted(glob.glob(os.path.join(RECIPES_DIR, "*.yaml"))):
        with open(path) as f:
            text = f.read().rstrip("\n")
        lines += [f"### `{os.path.basename(path).removesuffix('.yaml')}`", "", "```yaml", text, "```", ""]
    return "\n".join(lines).rstrip("\n") + "\n"


def main() -> None:
    print(render(), end="")


if __name__ == "__main__":
    main()
