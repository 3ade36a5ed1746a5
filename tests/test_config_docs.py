"""docs/configuration.md is generated from TrainRunConfig's dataclasses and their field comments
(codefleet.recipe.config_doc); these tests keep every field documented and the file current."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from codefleet.config import load_config
from codefleet.recipe.config import TrainRunConfig
from codefleet.recipe.config_doc import field_comments, field_rows, render, undocumented

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
REGENERATE = ".venv/bin/python -m codefleet.recipe.config_doc > docs/configuration.md"


def test_every_field_has_a_comment():
    missing = undocumented()
    assert not missing, (
        f"fields without a `#` comment (above the field or on its line): {missing}; "
        f"comment them where they are defined, then run `{REGENERATE}`"
    )


def test_configuration_md_is_current():
    assert DOC.exists(), f"docs/configuration.md is missing; run `{REGENERATE}`"
    assert DOC.read_text() == render(), f"docs/configuration.md is stale; run `{REGENERATE}`"


def test_every_default_shown_can_be_pasted_as_an_override():
    overrides = [f"{name}={default}" for name, _, default, _ in field_rows()]
    assert len(overrides) > 50
    assert load_config(TrainRunConfig, None, overrides) == TrainRunConfig()


@dataclass
class _Inner:
    depth: int = 3  # how deep | how far


@dataclass
class _Sample:
    """A config for the comment reader."""

    # two lines above
    # are joined
    plain: int = 1
    both: str = "a # not a comment"  # trailing
    # above a field that spans lines
    spread: list[str] = field(default_factory=lambda: ["x", "y"])  # and trails on its last line
    # a comment with a blank line after it belongs to no field

    bare: float = 0.5
    inner: _Inner = field(default_factory=lambda: _Inner(depth=7))


def test_comment_reader_on_a_small_dataclass():
    assert field_comments(_Sample) == {
        "plain": "two lines above are joined",
        "both": "trailing",
        "spread": "above a field that spans lines and trails on its last line",
        "bare": "",
        "inner": "",
    }
    assert undocumented(_Sample()) == ["bare"]  # a section needs no comment; its fields do

    text = render(_Sample())
    assert "| `plain` | `int` | `1` | two lines above are joined |" in text
    assert '| `spread` | `list[str]` | `["x", "y"]` |' in text
    # a nested dataclass gets its own table, with the default its parent's factory sets, and `|` escaped
    assert "## `inner` (_Inner)" in text
    assert "| `inner.depth` | `int` | `7` | how deep \\| how far |" in text
