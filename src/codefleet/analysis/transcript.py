"""One rollout's transcript page: what the agent was asked, what it did turn by turn, and how it was scored.

The page reads top to bottom: a header (task, family, step, attempt, category, stop reason, the reward and its
parts, checks, turns, wall clock, tokens), the task (the first user message), then each assistant turn in order
with its text and its tool calls — arguments as indented JSON when they parse, raw otherwise — each followed by the
output of the tool message that answers it (matched by tool_call_id) and, when the store recorded it, the call's
duration and error. Then the diff (added and removed lines coloured), the checks (failed first), the rule
findings and the judge's score, reason and error.

Sizes are bounded: a long text shows its first PREVIEW_CHARS characters and keeps the rest inside a collapsed
<details>, up to TEXT_CAP_BYTES and half of what the page has left (so one huge output leaves room for the turns
after it); the whole page stays under PAGE_CAP_BYTES, and whatever did not fit is replaced by a line saying what
was cut. Any field may be missing or None (a rollout no longer in the store, a trajectory that kept no messages,
a column the store's schema upgrade filled with null): it is shown as absent, never an error. Nothing from the
rollout is interpreted as HTML (html_page.esc); the page needs no script.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from codefleet.analysis.html_page import as_list, esc, fmt, number, page

PREVIEW_CHARS = 2_000  # characters of a long text shown before "show all"
PAGE_CAP_BYTES = 2_000_000  # the page's size, all included
TEXT_CAP_BYTES = 500_000  # one text, expanded, at most (and at most half of what its section has left)
# Each section's share of the page, so that a long transcript never pushes out the diff or the checks; the rest
# (~60 kB) is the frame, the style and the header (its fields are cut at 500 characters).
SECTION_BYTES = {"turns": 1_150_000, "diff": 500_000, "checks": 100_000, "judge": 40_000, "metadata": 100_000}
_BLOCK_BYTES = 300  # charged per rendered message or call for its markup


@dataclass
class Budget:
    """The bytes of rollout text a page may still hold."""

    left_bytes: int

    def take(self, html_text: str) -> bool:
        """Charge `html_text` if it fits; False (and nothing charged) if it does not."""
        n = len(html_text.encode())
        if n > self.left_bytes:
            return False
        self.left_bytes -= n
        return True

    def charge(self, n_bytes: int) -> None:
        self.left_bytes -= n_bytes


def _cut_note(what: str) -> str:
    return f'<p class="cut">{esc(what)} cut: the page is capped at {PAGE_CAP_BYTES / 1e6:g} MB</p>'


def _fitting_chars(text: str, limit_bytes: int) -> int:
    """How many leading characters of `text` fit in `limit_bytes` once escaped and UTF-8 encoded."""
    keep = min(len(text), max(0, limit_bytes))
    while keep:
        size = len(esc(text[:keep]).encode())
        if size <= limit_bytes:
            break
        keep = min(keep - 1, int(keep * limit_bytes / size * 0.99))
    return keep


def text_block(text: object, budget: Budget) -> str:
    """`text` in a <pre>: the first PREVIEW_CHARS characters, the rest in a collapsed <details>, within `budget`."""
    text = "" if text is None else str(text)
    head = esc(text[:PREVIEW_CHARS])
    if not budget.take(head):
        return _cut_note(f"{len(text):,} characters")
    if len(text) <= PREVIEW_CHARS:
        return f"<pre>{head}</pre>"
    rest = text[PREVIEW_CHARS:]
    keep = _fitting_chars(rest, min(budget.left_bytes // 2, TEXT_CAP_BYTES))  # half: later turns keep room
    rest_html = esc(rest[:keep])
    budget.take(rest_html)
    note = _cut_note(f"the last {len(rest) - keep:,} characters") if keep < len(rest) else ""
    return (
        f"<pre>{head}</pre><details><summary>show all {len(text):,} characters</summary>"
        f"<pre>{rest_html}</pre>{note}</details>"
    )


def pretty_arguments(arguments: object) -> str:
    """A tool call's arguments as indented JSON when they parse, else as given."""
    if arguments is None:
        return ""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    try:
        return json.dumps(arguments, indent=2, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(arguments)


def content_text(content: object) -> str:
    """A message's content as text: a string, or the text parts of an OpenAI content list."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def metadata_of(d: dict) -> dict:
    """The detail's metadata (details.fetch_details parses the store's JSON), {} when it has none."""
    meta = d.get("metadata")
    return meta if isinstance(meta, dict) else {}


def _header(d: dict) -> str:
    meta = metadata_of(d)
    reward = fmt(d.get("reward"))
    parts = [
        f"{name} {fmt(meta[key])}"
        for name, key in (("correctness", "reward.correctness"), ("costs", "reward.costs"))
        if meta.get(key) is not None
    ]
    if parts:
        reward = f"{reward or 'none'} ({', '.join(parts)})"
    tokens = d.get("tokens")
    if tokens is None and (d.get("prompt_tokens") is not None or d.get("completion_tokens") is not None):
        tokens = f"{fmt(d.get('prompt_tokens'))} prompt + {fmt(d.get('completion_tokens'))} completion"
    checks = (
        f"{fmt(d.get('checks_passed'))} / {fmt(d.get('checks_total'))}" if d.get("checks_total") is not None else ""
    )
    fields = [
        ("task", d.get("task_id")),
        ("family", d.get("family")),
        ("run", d.get("run")),
        ("step", d.get("step")),
        ("group", d.get("group")),
        ("attempt", d.get("attempt")),
        ("category", d.get("category")),
        ("stop reason", d.get("stop_reason")),
        ("reward", reward),
        ("checks passed", checks),
        ("turns", d.get("turns")),
        ("tool calls", d.get("n_tool_calls")),
        ("wall s", d.get("wall_s")),
        ("tokens", tokens),
        ("rollout", d.get("rollout_id")),
        ("error", d.get("error") or meta.get("error")),
    ]
    rows = "".join(f"<dt>{esc(k)}</dt><dd>{esc(fmt(v)[:500])}</dd>" for k, v in fields if fmt(v) != "")
    return f'<dl class="head">{rows}</dl>'


def _record_status(record: dict) -> str:
    """A store record's duration, failure and error, as shown after a call's name."""
    duration = number(record.get("duration_s"))
    status = f' <span class="muted">{esc(fmt(duration))} s</span>' if duration is not None else ""
    if record.get("ok") is False:
        status += ' <span class="bad">failed</span>'
    if record.get("error"):
        status += f' <span class="bad">{esc(str(record["error"])[:500])}</span>'
    return status


def _call(call: dict, outputs: dict, record: dict | None, budget: Budget) -> str:
    """One tool call: name, arguments, the matching output, and the store's timing/error for it."""
    function = call.get("function") or {}
    name = function.get("name") or call.get("name") or "?"
    timing = _record_status(record) if record else ""
    output = (
        f'<div class="muted">output</div>{text_block(outputs[call.get("id")], budget)}'
        if call.get("id") in outputs
        else '<div class="muted">no output recorded</div>'
    )
    budget.charge(_BLOCK_BYTES)
    return (
        f'<div class="call"><span class="tool">{esc(str(name)[:200])}</span>{timing}'
        f"{text_block(pretty_arguments(function.get('arguments', call.get('arguments'))), budget)}{output}</div>"
    )


def _turns(messages: list[dict], records: list[dict], budget: Budget) -> str:
    """Every message after the task, in order; tool messages are shown under the call they answer."""
    calls = [c for m in messages if m.get("role") == "assistant" for c in as_list(m.get("tool_calls"))]
    call_ids = {c.get("id") for c in calls if isinstance(c, dict)} - {None}
    outputs = {
        m.get("tool_call_id"): content_text(m.get("content"))
        for m in messages
        if m.get("role") == "tool" and m.get("tool_call_id") in call_ids
    }
    by_order = iter(records)
    out, turn, task_seen = [], 0, False
    for index, m in enumerate(messages):
        if budget.left_bytes <= 0:
            out.append(_cut_note(f"messages {index + 1}-{len(messages)} of {len(messages)}"))
            break
        role = m.get("role")
        if role == "user" and not task_seen:
            task_seen = True  # the task, shown above
            continue
        if role == "tool" and m.get("tool_call_id") in outputs:
            continue  # shown under its call
        budget.charge(_BLOCK_BYTES)
        if role == "assistant":
            turn += 1
            text = content_text(m.get("content"))
            blocks = [text_block(text, budget) if text else ""]
            for call in as_list(m.get("tool_calls")):
                if isinstance(call, dict):
                    record = next(by_order, None)
                    name = (call.get("function") or {}).get("name")
                    blocks.append(
                        _call(call, outputs, record if record and record.get("name") == name else None, budget)
                    )
            out.append(f'<div class="turn"><div class="role">turn {turn} · assistant</div>{"".join(blocks)}</div>')
        elif role == "system":
            out.append(
                f'<details><summary class="role">system prompt</summary>'
                f"{text_block(content_text(m.get('content')), budget)}</details>"
            )
        else:
            label = "tool output (no matching call)" if role == "tool" else str(role or "message")
            out.append(
                f'<div class="turn"><div class="role">{esc(label)}</div>'
                f"{text_block(content_text(m.get('content')), budget)}</div>"
            )
    return "".join(out)


def _records(records: list[dict], budget: Budget) -> str:
    """The store's per-call records, for a rollout whose transcript was not kept."""
    rows = []
    for r in records:
        budget.charge(_BLOCK_BYTES)
        if budget.left_bytes <= 0:
            rows.append(_cut_note("the remaining tool calls"))
            break
        rows.append(
            f'<div class="call">turn {esc(fmt(r.get("turn")))} · <span class="tool">'
            f"{esc(str(r.get('name'))[:200])}</span>{_record_status(r)}"
            f"{text_block(pretty_arguments(r.get('arguments')), budget)}</div>"
        )
    return "".join(rows)


def diff_block(diff: object, budget: Budget) -> str:
    """The diff with added, removed and hunk lines coloured, cut at the budget."""
    if not diff:
        return '<p class="muted">no diff</p>'
    lines = str(diff).splitlines()
    out, note = [], ""
    for index, line in enumerate(lines):
        if line.startswith("+") and not line.startswith("+++"):
            cls = "add"
        elif line.startswith("-") and not line.startswith("---"):
            cls = "del"
        else:
            cls = "hunk" if line.startswith("@@") else ""
        piece = f'<span class="{cls}">{esc(line)}</span>' if cls else esc(line) + "\n"
        if not budget.take(piece):
            note = _cut_note(f"diff lines {index + 1}-{len(lines)}")
            break
        out.append(piece)
    return f'<pre class="diff">{"".join(out)}</pre>{note}'


def checks_block(per_test: object, budget: Budget) -> str:
    """The checks, failed first and marked, cut at the budget."""
    tests = [t for t in as_list(per_test) if isinstance(t, dict)]
    if not tests:
        return '<p class="muted">no per-check results recorded</p>'
    tests.sort(key=lambda t: bool(t.get("passed")))
    items = []
    for index, t in enumerate(tests):
        item = (
            f'<li class="bad">✗ failed: {esc(t.get("test"))}</li>'
            if not t.get("passed")
            else f'<li class="good">✓ passed: {esc(t.get("test"))}</li>'
        )
        if not budget.take(item):
            items.append(f"<li>{_cut_note(f'checks {index + 1}-{len(tests)}')}</li>")
            break
        items.append(item)
    failed = sum(not t.get("passed") for t in tests)
    return f"<p>{failed} of {len(tests)} failed</p><ul>{''.join(items)}</ul>"


def _judge(d: dict, budget: Budget) -> str:
    score = fmt(d.get("judge_score"))
    parts = [f"<p>score: <b>{esc(score or 'none')}</b></p>"]
    if d.get("judge_reason"):
        parts.append(f"<div class='muted'>reason</div>{text_block(d['judge_reason'], budget)}")
    if d.get("judge_error"):
        parts.append(f"<div class='bad'>judge error</div>{text_block(d['judge_error'], budget)}")
    return "".join(parts)


def _metadata(metadata: dict, budget: Budget) -> str:
    rows = []
    for k, v in sorted(metadata.items(), key=lambda kv: str(kv[0])):
        row = f"<tr><td>{esc(str(k)[:200])}</td><td>{esc(fmt(v)[:1000])}</td></tr>"
        if not budget.take(row):
            rows.append(f"<tr><td colspan=2>{_cut_note('the remaining keys')}</td></tr>")
            break
        rows.append(row)
    return "".join(rows)


def _findings(findings: object, budget: Budget) -> str:
    items = []
    for f in as_list(findings):
        item = f"<li>{esc(str(f)[:500])}</li>"
        if not budget.take(item):
            items.append(f"<li>{_cut_note('the remaining findings')}</li>")
            break
        items.append(item)
    return f"<ul>{''.join(items)}</ul>" if items else '<p class="muted">none</p>'


def render_transcript(detail: dict, back_href: str = "../report.html") -> str:
    """The transcript page of one rollout (see the module docstring)."""
    d = detail
    budget = Budget(SECTION_BYTES["turns"])
    messages = [m for m in as_list(d.get("transcript")) if isinstance(m, dict)]
    records = [r for r in as_list(d.get("tool_calls")) if isinstance(r, dict)]
    task = next((content_text(m.get("content")) for m in messages if m.get("role") == "user"), None)
    task_html = text_block(task, budget) if task is not None else '<p class="muted">no task message recorded</p>'
    if messages:
        turns_html = _turns(messages, records, budget)
    elif records:
        turns_html = "<p class='muted'>transcript not recorded; the store's tool calls:</p>" + _records(records, budget)
    else:
        turns_html = '<p class="muted">no transcript recorded</p>'
    checks = Budget(SECTION_BYTES["checks"])
    meta_html = _metadata(metadata_of(d), Budget(SECTION_BYTES["metadata"]))
    suspicious = ' <span class="bad">suspicious win</span>' if d.get("suspicious") else ""
    body = (
        f'<p><a href="{esc(back_href)}">← back to the report</a></p>'
        f"<h1>{esc(d.get('task_id') or d.get('rollout_id') or 'rollout')}{suspicious}</h1>{_header(d)}"
        f"<h2>Task</h2>{task_html}<h2>Turns</h2>{turns_html}"
        f"<h2>Diff</h2>{diff_block(d.get('diff'), Budget(SECTION_BYTES['diff']))}"
        f"<h2>Checks</h2>{checks_block(d.get('per_test'), checks)}"
        f"<h2>Findings</h2>{_findings(d.get('findings'), checks)}"
        f"<h2>Judge</h2>{_judge(d, Budget(SECTION_BYTES['judge']))}"
        + (f"<details><summary>metadata</summary><table>{meta_html}</table></details>" if meta_html else "")
    )
    return page(f"rollout {d.get('task_id') or d.get('rollout_id') or ''}", body)
