"""Reasons, grouped: a handful of labelled clusters saying why rollouts failed and why wins look suspicious.

    summary["clusters"] = {"source": "judge" | "rules", "note": str | None,
                           "failures": [{"label", "count", "examples": [rollout_id, ...]}],
                           "suspicious_wins": [...]}

Two sources of labels, one shape:

- **Rules** (always; the only source with `--judge rules`). A failure's cluster is
  its category and stop reason ("wrong fix: submitted a diff the checks reject"),
  a suspicious win's is its first suspicious finding kind. `rule_clusters(batch)`
  labels rows; aggregate.py counts them in its one pass and keeps a uniform sample
  of examples (the rows with the lowest sample key).
- **The judge** (a model backend). A second Ray Data stage over the judgments of
  failures and suspicious wins that carry a judge reason: each batch of
  `batch_rows` reasons goes to the judge in one request, which names at most
  `max_clusters` clusters and puts every reason in one (`ClusterBatch` in cluster_stage.py, on the
  judge's actor pool settings). The stage returns one row per (batch, label) with
  its count and examples, never one per rollout. The driver then asks the judge
  once to merge the batches' labels into at most `max_clusters` (`merge_labels`),
  so that "edits the test" and "edited tests" become one cluster. A reason the
  judge left out, a batch whose answer was unusable and a row the judge could not
  score keep their rules cluster; `note` says how many rows that was.

Labels are the judge's words: escaped where shown, never interpreted.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from codefleet.analysis.answers import first_json_object
from codefleet.analysis.rules import SUSPICIOUS_KINDS

GROUPS = ("failures", "suspicious_wins")
HEADINGS = {"failures": "Why these rollouts failed:", "suspicious_wins": "Why these wins look suspicious:"}
EXAMPLES = 3  # example rollouts kept per cluster

_CATEGORY_WORDS = {
    "wrong_fix": "wrong fix: the checks reject the change",
    "no_submission": "no submission: stopped without a change or without submitting",
    "timeout": "timeout: the wall-clock budget ran out",
    "tool_errors": "tool errors: most tool calls failed",
    "budget_exhausted": "budget exhausted: turns, tool calls or tokens ran out",
    "infrastructure": "infrastructure: the episode or its checks did not run",
}
_FINDING_WORDS = {
    "tests_edited": "edits tests the task does not ask to change",
    "tests_deleted": "deletes tests",
    "assert_weakened": "weakens assertions",
    "skip_added": "skips checks",
    "hardcoded_output": "hard-codes the expected output",
    "untracked_added": "adds files that change how tests run",
    "outside_repo": "writes outside the repository",
    "reads_checks": "reads the hidden checks",
}

CLUSTER_SYSTEM = (
    "You group the reasons a reviewer gave for coding-agent rollouts into a few clusters of the same cause. "
    'Answer with one JSON object only: {"clusters": [{"label": "<a cause in 3 to 8 words>", '
    '"members": [<reason numbers>]}]}. Use at most {max_clusters} clusters; put every reason number in '
    "exactly one cluster."
)
MERGE_SYSTEM = (
    "You merge cluster labels that name the same cause. Answer with one JSON object only: "
    '{"clusters": [{"label": "<a cause in 3 to 8 words>", "members": [<label numbers>]}]}. Use at most '
    "{max_clusters} clusters; put every label number in exactly one cluster."
)


@dataclass
class ClusterConfig:
    batch_rows: int = 40  # reasons per judge request
    max_clusters: int = 6  # per group, after merging
    reason_chars: int = 300  # each reason cut to this many characters in the prompt


def sample_key(table: pa.Table) -> np.ndarray:
    """A deterministic pseudo-random number in [0, 1) per row, from its step, group and attempt (splitmix64):
    the rows with the lowest keys are a uniform sample, whatever batches they arrive in."""
    x = np.zeros(table.num_rows, np.uint64)
    with np.errstate(over="ignore"):
        for column in ("step", "group", "attempt"):
            x ^= pc.fill_null(table.column(column), 0).to_numpy(zero_copy_only=False).astype(np.uint64)
            x += np.uint64(0x9E3779B97F4A7C15)
            x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            x ^= x >> np.uint64(31)
    return (x >> np.uint64(11)).astype(np.float64) / 2.0**53


def rule_label(
    category: str | None, stop_reason: str | None, findings: list[str] | None, suspicious: bool
) -> tuple[str, str] | None:
    """(group, label) of one judgment row, or None for an honest win."""
    if suspicious:
        kinds = [f.split(":", 1)[0] for f in findings or []]
        kind = next((k for k in kinds if k in SUSPICIOUS_KINDS), "suspicious")
        return "suspicious_wins", _FINDING_WORDS.get(kind, kind)
    if category == "solved":
        return None
    return "failures", _failure_label(category or "", stop_reason or "")


def _failure_label(category: str, stop_reason: str) -> str:
    return f"{_CATEGORY_WORDS.get(category, category or 'uncategorised')} (stop: {stop_reason or 'none'})"


def rule_clusters(batch: pa.Table) -> tuple[list[str | None], list[str | None]]:
    """(group, label) columns for a batch of judgments; None for honest wins."""
    labelled = [
        rule_label(c, s, f, bool(x))
        for c, s, f, x in zip(
            batch.column("category").to_pylist(),
            batch.column("stop_reason").to_pylist(),
            batch.column("findings").to_pylist(),
            batch.column("suspicious").to_pylist(),
        )
    ]
    return [x[0] if x else None for x in labelled], [x[1] if x else None for x in labelled]


def numbered(texts: list[str], max_chars: int) -> str:
    return "\n".join(f"{i + 1}. {' '.join(t.split())[:max_chars]}" for i, t in enumerate(texts))


def parse_clusters(answer: str, n: int) -> list[tuple[str, list[int]]]:
    """[(label, 0-based member indices)] from a judge's answer about `n` numbered items; ValueError when it is
    not usable. Members out of range or given twice are ignored; items left out stay unassigned."""
    found = first_json_object(answer)
    clusters = found.get("clusters") if isinstance(found, dict) else None
    if not isinstance(clusters, list) or not clusters:
        raise ValueError(f'answer has no "clusters" list: {answer[:120]!r}')
    out, seen = [], set()
    for cluster in clusters:
        if not isinstance(cluster, dict) or not isinstance(cluster.get("label"), str):
            continue
        label = " ".join(cluster["label"].split())[:80]
        members = []
        for m in cluster.get("members") or []:
            if isinstance(m, int) and not isinstance(m, bool) and 1 <= m <= n and m - 1 not in seen:
                seen.add(m - 1)
                members.append(m - 1)
        if label and members:
            out.append((label, members))
    if not out:
        raise ValueError(f"answer names no cluster with members: {answer[:120]!r}")
    return out


CLUSTER_ROW_SCHEMA = pa.schema(
    [
        pa.field("group", pa.string()),
        pa.field("label", pa.string()),
        pa.field("source", pa.string()),
        pa.field("count", pa.int64()),
        pa.field("examples", pa.list_(pa.string())),
        pa.field("keys", pa.list_(pa.float64())),
    ]
)


def cluster_row(group: str, label: str, source: str, rows: list[dict]) -> dict:
    chosen = sorted(rows, key=lambda r: r["sample_key"])[:EXAMPLES]
    return {
        "group": group,
        "label": label,
        "source": source,
        "count": len(rows),
        "examples": [r["rollout_id"] for r in chosen],
        "keys": [r["sample_key"] for r in chosen],
    }


def cluster_inputs(batch: pa.Table) -> pa.Table:
    """The rows to cluster (failures and suspicious wins) with their rules label and sample key: a map_batches
    function over judgments."""
    groups, labels = rule_clusters(batch)
    table = pa.table(
        {
            "rollout_id": batch.column("rollout_id"),
            "cluster_group": pa.array(groups, pa.string()),
            "rule_label": pa.array(labels, pa.string()),
            "judge_reason": batch.column("judge_reason"),
            "sample_key": pa.array(sample_key(batch)),
        }
    )
    return table.filter(pa.array([g is not None for g in groups], pa.bool_()))


def rules_cluster_rows(batch: pa.Table, keys: np.ndarray) -> list[dict]:
    """Cluster rows (CLUSTER_ROW_SCHEMA dicts) by rules for a batch of judgments whose sample keys are `keys`.
    Failures are labelled per (category, stop reason) pair, not per row: this runs in the aggregation pass."""
    keyed = (
        batch.select(["rollout_id", "category", "stop_reason", "findings", "suspicious"])
        .append_column("sample_key", pa.array(keys))
        .sort_by("sample_key")
    )
    category = pc.fill_null(keyed.column("category"), "")
    failed = keyed.filter(pc.not_equal(category, "solved"))
    pairs = pc.binary_join_element_wise(
        pc.fill_null(failed.column("category"), ""), pc.fill_null(failed.column("stop_reason"), ""), "|"
    ).to_pylist()
    by_pair: dict[str, list] = {}
    for pair, rollout_id, key in zip(
        pairs, failed.column("rollout_id").to_pylist(), failed.column("sample_key").to_pylist()
    ):
        found = by_pair.setdefault(pair, [0, [], []])
        found[0] += 1
        if len(found[1]) < EXAMPLES:  # sorted by key: the first are the sample
            found[1].append(rollout_id)
            found[2].append(key)
    rows = [
        {
            "group": "failures",
            "label": _failure_label(*pair.split("|", 1)),
            "source": "rules",
            "count": n,
            "examples": ids,
            "keys": ks,
        }
        for pair, (n, ids, ks) in by_pair.items()
    ]
    wins = keyed.filter(pc.fill_null(keyed.column("suspicious"), False))
    inputs = [
        {
            "rollout_id": r["rollout_id"],
            "cluster_group": "suspicious_wins",
            "sample_key": r["sample_key"],
            "rule_label": rule_label(r["category"], r["stop_reason"], r["findings"], True)[1],
        }
        for r in wins.to_pylist()
    ]
    return rows + by_rules(inputs)


def by_rules(rows: list[dict]) -> list[dict]:
    out = []
    for group in GROUPS:
        by_rule: dict[str, list[dict]] = {}
        for r in rows:
            if r["cluster_group"] == group:
                by_rule.setdefault(r["rule_label"], []).append(r)
        out += [cluster_row(group, label, "rules", rs) for label, rs in by_rule.items()]
    return out


def combine(rows: list[dict], max_clusters: int, merged: dict[str, str] | None = None) -> dict[str, list[dict]]:
    """Cluster rows (CLUSTER_ROW_SCHEMA dicts; one per batch and label) summed by (group, label) after the
    `merged` label mapping; the largest `max_clusters` per group, the rest as one "other causes" cluster."""
    merged = merged or {}
    sums: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["group"], merged.get(r["label"], r["label"]))
        target = sums.setdefault(key, {"label": key[1], "count": 0, "examples": []})
        target["count"] += r["count"]
        target["examples"] += list(zip(r["keys"], r["examples"]))
    out: dict[str, list[dict]] = {}
    for group in GROUPS:
        clusters = sorted((v for (g, _), v in sums.items() if g == group), key=lambda c: (-c["count"], c["label"]))
        if len(clusters) > max_clusters:
            rest = clusters[max_clusters - 1 :]
            clusters = clusters[: max_clusters - 1] + [
                {
                    "label": "other causes",
                    "count": sum(c["count"] for c in rest),
                    "examples": [e for c in rest for e in c["examples"]],
                }
            ]
        out[group] = [
            {"label": c["label"], "count": c["count"], "examples": [i for _, i in sorted(c["examples"])[:EXAMPLES]]}
            for c in clusters
        ]
    return out
