"""The HTML shell every page of an analysis shares: escaping, number formatting, the page frame, atomic writes.

Every page is self-contained (inline CSS, inline script, plots as data: URLs), so an analysis directory opens from
disk (file://) without a server. Its Content-Security-Policy forbids every fetch but data: images, so even a
rendering mistake cannot load anything from the network. Text from a rollout only ever reaches a page through
`esc` (html.escape, quotes included): it is shown, never interpreted as HTML or script.
"""

from __future__ import annotations

import html
import math
import os

from codefleet.store import safe_files

CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"

STYLE = """body{font-family:system-ui,'DejaVu Sans',sans-serif;margin:24px;color:#222;max-width:1300px}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;font-size:13px;width:100%}
td,th{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}th{background:#f4f4f4}
table.rows th{cursor:pointer;user-select:none;white-space:nowrap}
table.rows th[aria-sort=ascending]::after{content:" \\25B2"}
table.rows th[aria-sort=descending]::after{content:" \\25BC"}
table.clusters{width:auto;min-width:50%}
tr.sus td{background:#fff6e0}.plots{display:flex;flex-wrap:wrap;gap:8px}.plots img{width:380px;border:1px solid #eee}
.kpi{display:inline-block;margin-right:24px}.kpi b{font-size:20px;display:block}.muted{color:#777}
.overview{font-size:15px;line-height:1.5;background:#f3f7ff;border-left:4px solid #4a78d0;padding:10px 14px}
#filters{display:flex;flex-wrap:wrap;gap:10px 18px;align-items:center;background:#f8f8f8;padding:8px 10px;
border:1px solid #e4e4e4;font-size:13px}#filters input[type=number]{width:70px}.count{font-size:13px;color:#555}
pre{white-space:pre-wrap;word-break:break-word;background:#f7f7f7;border:1px solid #e6e6e6;padding:6px 8px;
margin:4px 0;font-size:12px}.turn{border-left:3px solid #c9d6ee;padding:2px 0 2px 12px;margin:14px 0}
.call{margin:8px 0 8px 6px}.role{font-weight:600;color:#3b5ea8}.tool{font-family:monospace;font-weight:600}
.bad{color:#b00020;font-weight:600}.good{color:#1b7a30}.cut{color:#b00020;font-style:italic}
.diff .add{background:#e6ffec;display:block}.diff .del{background:#ffebe9;display:block}
.diff .hunk{color:#6a4fb3;display:block}dl.head{display:grid;grid-template-columns:max-content 1fr;gap:2px 14px;
font-size:14px}dl.head dt{color:#666}dl.head dd{margin:0}"""


def esc(value: object) -> str:
    """`value` as escaped HTML text ("" for None)."""
    return "" if value is None else html.escape(str(value))


def fmt(value: object) -> str:
    """A table cell's plain text: floats to 3 significant figures, lists joined by "; ", None and NaN as ""."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return "; ".join(map(str, value))
    return str(value)


def number(value: object) -> float | None:
    """`value` as a finite float, or None (missing, not a number, NaN)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


def as_list(value: object) -> list:
    """A list field of a row or detail as a list: None -> [], a lone string -> [it], arrays and tuples -> list."""
    if value is None:
        return []
    if isinstance(value, (str, bytes, dict)):
        return [value]
    if hasattr(value, "tolist"):  # a numpy array from a Parquet column
        value = value.tolist()
    try:
        return list(value)  # type: ignore[call-overload]
    except TypeError:
        return [value]


def page(title: str, body: str, script: str = "") -> str:
    """A whole self-contained page (escaped title, trusted body and script)."""
    script_html = f"<script>{script}</script>" if script else ""
    return (
        f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f'<meta http-equiv="Content-Security-Policy" content="{CSP}">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{esc(title)}</title><style>{STYLE}</style></head><body>{body}{script_html}</body></html>"
    )


def write_atomic(path: str, text: str, root: str | None = None) -> None:
    """Write `text` to `path` through a temporary file and os.replace: a reader sees the old file or the new one.
    `root`: the directory the user named (default: `path`'s own directory); no link below it is followed."""
    safe_files.write_file_beneath(root or os.path.dirname(path) or ".", path, text)
