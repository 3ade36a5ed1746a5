"""The judge's clusters: a Ray Data stage over the judgments of failures and suspicious wins, and the merge.

Each batch of `ClusterConfig.batch_rows` reasons goes to the judge in one request (`ClusterBatch`, an actor on the
judge's pool settings), which names its clusters; the stage returns one row per (batch, label). The driver then
asks the judge once per group to merge the batches' labels (`merge_labels`). What the judge left out keeps its
rules cluster. The labels, the rows' shapes and the pure parts live in clusters.py (which the aggregation pass
imports without the judge's client libraries).
"""

from __future__ import annotations

import pyarrow as pa

from codefleet.analysis.clusters import (
    CLUSTER_ROW_SCHEMA,
    CLUSTER_SYSTEM,
    GROUPS,
    HEADINGS,
    MERGE_SYSTEM,
    ClusterConfig,
    by_rules,
    cluster_inputs,
    cluster_row,
    combine,
    numbered,
    parse_clusters,
)
from codefleet.analysis.judge import JudgeBatch


class ClusterBatch(JudgeBatch):
    """The cluster stage's actor: one judge request per batch of reasons (see the module docstring)."""

    cluster_config = ClusterConfig()  # judge_clusters sets the analysis's own

    def _ask(self, system: str, heading: str, items: list[str]) -> list[tuple[str, list[int]]]:
        if self.init_error:
            raise ValueError(self.init_error)
        self.pacer.wait()
        config = self.cluster_config
        answer = self.complete(
            [
                {"role": "system", "content": system.replace("{max_clusters}", str(config.max_clusters))},
                {"role": "user", "content": f"{heading}\n{numbered(items, config.reason_chars)}"},
            ]
        )
        return parse_clusters(answer, len(items))

    def __call__(self, batch: pa.Table) -> pa.Table:
        rows = batch.to_pylist()
        out, left = [], []
        for group in GROUPS:
            members = [r for r in rows if r["cluster_group"] == group and (r["judge_reason"] or "").strip()]
            try:
                named = (
                    self._ask(CLUSTER_SYSTEM, HEADINGS[group], [r["judge_reason"] for r in members]) if members else []
                )
            except Exception:  # the judge's answer was not usable: these rows keep their rules clusters
                named = []
            assigned = set()
            for label, indices in named:
                assigned.update(id(members[i]) for i in indices)
                out.append(cluster_row(group, label, "judge", [members[i] for i in indices]))
            left += [r for r in rows if r["cluster_group"] == group and id(r) not in assigned]
        return pa.Table.from_pylist(out + by_rules(left), schema=CLUSTER_ROW_SCHEMA)

    def merge(self, group: str, labels: list[str]) -> list[tuple[str, list[int]]]:
        """The judge's merge of a group's `labels` into at most max_clusters; ValueError when its answer is
        unusable."""
        return self._ask(MERGE_SYSTEM, f"Cluster labels ({HEADINGS[group][:-1].lower()}):", labels)


def merge_labels(judge: ClusterBatch, rows: list[dict], max_clusters: int) -> tuple[dict[str, str], str | None]:
    """{batch label: merged label} from the judge, per group; and a note when a merge answer was unusable
    (those labels stay as they are, equal ones summed)."""
    mapping, failed = {}, []
    for group in GROUPS:
        labels = sorted({r["label"] for r in rows if r["group"] == group and r["source"] == "judge"})
        if len(labels) <= 1:
            continue
        try:
            for label, indices in judge.merge(group, labels):
                mapping.update({labels[i]: label for i in indices})
        except Exception as e:
            failed.append(f"{group}: {type(e).__name__}: {' '.join(str(e).split())[:160]}")
    note = f"the judge could not merge the batches' labels ({'; '.join(failed)})" if failed else None
    return mapping, note


def judge_clusters(judgments, judge_class: type[ClusterBatch], config: ClusterConfig, compute, num_cpus: float) -> dict:
    """summary["clusters"] from the judge (module docstring): the cluster stage over `judgments` (a Ray Dataset),
    then the merge in the driver."""
    stage = type("ClusterStage", (judge_class,), {"cluster_config": config})  # travels with the class, as its judge
    rows = (
        judgments.map_batches(cluster_inputs, batch_format="pyarrow")
        .map_batches(stage, batch_format="pyarrow", batch_size=config.batch_rows, compute=compute, num_cpus=num_cpus)
        .take_all()
    )
    rows = [dict(r, examples=list(r["examples"]), keys=list(r["keys"])) for r in rows]
    mapping, note = merge_labels(stage(), rows, config.max_clusters)
    grouped_by_rules = sum(r["count"] for r in rows if r["source"] == "rules")
    total = sum(r["count"] for r in rows)
    notes = (
        [
            f"{grouped_by_rules} of {total} rows are grouped by rules: the judge gave no reason for them, left "
            "them out of its clusters, or its answer about their batch was not usable"
        ]
        if grouped_by_rules
        else []
    )
    source = "judge" if any(r["source"] == "judge" for r in rows) else "rules"
    return {
        "source": source,
        "note": "; ".join(notes + ([note] if note else [])) or None,
        **combine(rows, config.max_clusters, mapping),
    }
