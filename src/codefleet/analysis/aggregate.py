"""Aggregates over judgments.parquet with Ray Data: summary.json and the report's tables.

The driver only ever holds aggregates and a few table rows, whatever the number of
rollouts. One Ray Data execution over the (small) judgments computes everything, as a
two-level aggregation:

1. `map_batches(_partials)`: each batch becomes a few partial-sum rows keyed by
   (dim, key) — dim "all", "family", "step", "family|category", "hist:<column>" (fixed
   1-2-5 bins, for the plots), "sketch:<column>" (log bins 2% wide, for quantiles), "tool"
   (tool-use mix), "parallel" (turns that made k tool calls) — via
   pyarrow's `group_by().aggregate()`, plus the batch's candidate rows for the tables
   (worst failures, suspicious wins, the browse sample's candidates, judge errors; JSON in
   `row`, sort key in `n`) and its rules clusters (clusters.py; counts and examples per label).
2. The partials are summed by (dim, key): by default in the driver (`combine_partials`; a
   few hundred rows per batch), or with `shuffle_aggregate=True` by a Ray Data
   `groupby(["dim", "key"]).sum(...)`, which is what a cluster with many batches wants.
   The shuffle runs on aggregator actors and costs a fixed 80–130 s on a loaded 2-core
   machine even for 2,000 rollouts (measured), hence the default.

Means are sums / counts of the rows that recorded the figure: a null, NaN or infinite value
(a hand-written or damaged store) is left out of its mean, histogram and quantiles, not
counted as 0. Success rate = mean of `success` (1.0 for category "solved").
p50/p90 are read off the sketch: bucket k holds values in (1.02^(k-1), 1.02^k], so a quantile
is within 1% of a value at that rank (reported to 3 significant figures); the 1-2-5
histograms are too coarse for that (a run whose every rollout took 6 turns would read p90 = 9.4).
Ray's ApproximateQuantile needs `datasketches`, which codefleet does not depend on.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from codefleet.analysis.clusters import combine, rules_cluster_rows, sample_key
from codefleet.store import safe_files

TABLE_COLUMNS = [
    "rollout_id",
    "run",
    "step",
    "task_id",
    "family",
    "group",
    "attempt",
    "category",
    "stop_reason",
    "reward",
    "checks_passed",
    "checks_total",
    "turns",
    "n_tool_calls",
    "wall_s",
    "findings",
    "suspicious",
    "judge_score",
    "judge_reason",
    "judge_error",
]
TABLES = ("worst_failures", "suspicious_wins", "rollouts", "judge_errors")
HISTOGRAMS = {"turns": 1.0, "wall_s": 0.01, "tokens": 10.0}  # column: lowest non-zero bin edge
MEANS = ["turns", "tool_calls_per_turn", "wall_s", "tokens", "model_s", "tool_s", "prompt_tokens", "completion_tokens"]
COUNTS = [f"{c}_count" for c in MEANS]  # rows with a finite value of the column: the mean's denominator
SUMMED = ["success", "suspicious", *MEANS, *COUNTS, "judge_score", "judge_scored", "judge_errors"]
SKETCH_GAMMA = 1.02  # quantile sketch: relative bucket width


def bin_edges(lowest: float, highest: float = 1e9) -> list[float]:
    """0, then a 1-2-5 sequence from `lowest` up to `highest`."""
    edges, exponent = [0.0], math.floor(math.log10(lowest))
    while edges[-1] < highest:
        edges += [m * 10.0**exponent for m in (1, 2, 5) if m * 10.0**exponent >= lowest]
        exponent += 1
    return edges


_EDGES = {column: np.array(bin_edges(lowest)) for column, lowest in HISTOGRAMS.items()}
_SKETCH_ZERO = -(1 << 20)  # the sketch's bucket for values <= 1e-9 (negatives included)


def _finite(column: pa.ChunkedArray) -> tuple[pa.Array, pa.Array]:
    """(values with null/NaN/inf as 0.0, 1.0 where the value was finite else 0.0)."""
    values = column.cast(pa.float64())
    valid = pc.fill_null(pc.is_finite(values), False)
    return pc.if_else(valid, values, 0.0), valid.cast(pa.float64())


def sketch_bucket(values: np.ndarray) -> np.ndarray:
    """The quantile sketch's bucket of each value (see the module docstring)."""
    positive = values > 1e-9
    buckets = np.full(len(values), _SKETCH_ZERO, np.int64)
    buckets[positive] = np.ceil(np.log(values[positive]) / math.log(SKETCH_GAMMA) - 1e-9)
    return buckets


def sketch_quantile(sketch: dict[int, float], q: float) -> float | None:
    """The q-quantile (numpy's linear rank q*(n-1)) of a sketch {bucket: count}, to 3 significant figures."""
    total = sum(sketch.values())
    if not total:
        return None
    rank, seen = q * (total - 1), 0.0
    for bucket in sorted(sketch):
        seen += sketch[bucket]
        if seen > rank:
            break
    if bucket == _SKETCH_ZERO:
        return 0.0
    value = 2 * SKETCH_GAMMA**bucket / (SKETCH_GAMMA + 1)  # relative midpoint of (gamma^(k-1), gamma^k]
    return float(f"{value:.3g}")


def _partials(batch: pa.Table) -> pa.Table:
    """Partial sums of one batch of judgments, one row per (dim, key) (see the module docstring)."""
    n = batch.num_rows
    values = {
        "success": pc.fill_null(batch.column("success"), 0.0),
        "suspicious": pc.fill_null(batch.column("suspicious"), False).cast(pa.float64()),
    }
    finite = {c: _finite(batch.column(c)) for c in MEANS}
    values.update({c: finite[c][0] for c in MEANS})
    values.update({f"{c}_count": finite[c][1] for c in MEANS})
    values["judge_scored"] = pc.is_valid(batch.column("judge_score")).cast(pa.float64())
    values["judge_errors"] = pc.is_valid(batch.column("judge_error")).cast(pa.float64())
    values["judge_score"] = pc.fill_null(batch.column("judge_score"), 0.0)
    family = pc.fill_null(batch.column("family"), "")
    family = pc.if_else(pc.equal(family, ""), "(none)", family)
    step = pc.fill_null(batch.column("step").cast(pa.string()), "")  # "": a row without a step
    keys = {
        "all": pa.array([""] * n, pa.string()),
        "family": family,
        "step": step,
        "family|category": pc.binary_join_element_wise(family, batch.column("category"), "|"),
    }
    parts = []
    for dim, key in keys.items():
        table = pa.table({"key": key, "n": pa.array(np.ones(n)), **values})
        grouped = table.group_by("key").aggregate([(c, "sum") for c in ["n", *SUMMED]])
        grouped = grouped.rename_columns([c.removesuffix("_sum") for c in grouped.column_names])
        parts.append(grouped.append_column("dim", pa.array([dim] * grouped.num_rows, pa.string())))
    counted: list[tuple[str, str, int]] = []
    for column, edges in _EDGES.items():
        numbers, valid = (a.to_numpy(zero_copy_only=False) for a in finite[column])
        recorded = numbers[valid > 0]
        bins = np.maximum(np.searchsorted(edges, recorded, "right") - 1, 0)
        index, count = np.unique(bins, return_counts=True)
        counted += [(f"hist:{column}", str(i), c) for i, c in zip(index.tolist(), count.tolist())]
        index, count = np.unique(sketch_bucket(recorded), return_counts=True)
        counted += [(f"sketch:{column}", str(i), c) for i, c in zip(index.tolist(), count.tolist())]
    for dim, column in (("tool", "tool_names"), ("parallel", "calls_per_turn")):
        flat = pc.list_flatten(batch.column(column))
        if len(flat):
            vc = pc.value_counts(flat)
            pairs = zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())
            counted += [(dim, str(k), c) for k, c in pairs]
    if counted:
        dims, keys_, counts = zip(*counted)
        extra = {c: pa.array(np.zeros(len(counted))) for c in SUMMED}
        parts.append(
            pa.table(
                {
                    "key": pa.array(keys_, pa.string()),
                    "n": pa.array(counts, pa.float64()),
                    **extra,
                    "dim": pa.array(dims, pa.string()),
                }
            )
        )
    partials = pa.concat_tables(parts).select(["dim", "key", "n", *SUMMED])
    return partials.append_column("row", pa.nulls(partials.num_rows, pa.string()))


def _candidates(batch: pa.Table, k_worst: int, k_wins: int, k_browse: int, browse_below: float) -> pa.Table:
    """The batch's table candidates and rules cluster rows as partial-shaped rows: dim = table name (or
    "cluster"), n = sort key, row = JSON."""
    keys = sample_key(batch)
    rows = _tables(batch, k_worst, k_wins, k_browse, keys, browse_below).to_pylist()
    rows += [{"table": "cluster", "sort_score": 0.0, **r} for r in rules_cluster_rows(batch, keys)]
    zeros = {c: pa.array(np.zeros(len(rows))) for c in SUMMED}
    return pa.table(
        {
            "dim": pa.array([r["table"] for r in rows], pa.string()),
            "key": pa.array([str(i) for i in range(len(rows))], pa.string()),
            "n": pa.array([r["sort_score"] for r in rows], pa.float64()),
            **zeros,
            "row": pa.array(
                [
                    json.dumps({k: v for k, v in r.items() if k not in ("table", "sort_score")}, default=str)
                    for r in rows
                ],
                pa.string(),
            ),
        }
    )


def batch_summary(batch: pa.Table, k_worst: int, k_wins: int, k_browse: int, browse_below: float) -> pa.Table:
    """The map_batches function: partial sums and table candidates of one batch."""
    return pa.concat_tables([_partials(batch), _candidates(batch, k_worst, k_wins, k_browse, browse_below)])


def combine_partials(rows: list[dict], sums: dict | None = None) -> dict[str, dict[str, dict]]:
    """Partial rows summed by (dim, key): {dim: {key: {column: sum}}}, added into `sums` when given."""
    sums = {} if sums is None else sums
    for row in rows:
        target = sums.setdefault(row["dim"], {}).setdefault(row["key"], dict.fromkeys(["n", *SUMMED], 0.0))
        for c in ("n", *SUMMED):
            target[c] += row[c] or 0.0
    return sums


def _tables(
    batch: pa.Table, k_worst: int, k_wins: int, k_browse: int, keys: np.ndarray, browse_below: float
) -> pa.Table:
    """A batch's k worst failures (lowest judge score, rule score when unjudged, then longest),
    first k suspicious wins, up to k rollouts with the lowest sample keys `keys` under `browse_below`
    (candidates for the uniform sample to browse) and first 3 judge errors, tagged by `table`."""
    # only the shown columns are copied, and only for the rows chosen: sorts run on small key tables (a batch can be
    # a whole dataset of 40 columns)
    batch = batch.select(list(dict.fromkeys([*TABLE_COLUMNS, "success", "rule_score"])))
    failed = pc.fill_null(pc.equal(batch.column("success"), 0.0), False)
    score = pc.coalesce(batch.column("judge_score"), batch.column("rule_score"))
    order = pc.sort_indices(
        pa.table({"other": pc.invert(failed), "score": score, "wall_s": batch.column("wall_s")}),
        sort_keys=[("other", "ascending"), ("score", "ascending"), ("wall_s", "descending")],
    )
    chosen = order.slice(0, min(k_worst, pc.sum(failed.cast(pa.int64())).as_py() or 0))
    worst = batch.take(chosen).append_column("sort_score", score.take(chosen))
    wins = batch.filter(pc.fill_null(batch.column("suspicious"), False)).slice(0, k_wins)
    wins = wins.append_column("sort_score", wins.column("judge_score"))
    errors = batch.filter(pc.is_valid(batch.column("judge_error"))).slice(0, 3)
    errors = errors.append_column("sort_score", errors.column("judge_score"))
    below = np.flatnonzero(keys < browse_below)
    below = below[np.argsort(keys[below], kind="stable")][:k_browse]
    sampled = batch.take(pa.array(below, pa.int64())).append_column("sort_score", pa.array(keys[below]))
    parts = [
        t.select(TABLE_COLUMNS + ["sort_score"]).append_column("table", pa.array([name] * t.num_rows, pa.string()))
        for name, t in zip(TABLES, (worst, wins, sampled, errors))
    ]
    return pa.concat_tables(parts)


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (np.floating, np.integer)):
        return _clean(value.item())
    return value


def summarise(judgments, config, rows: int | None = None) -> tuple[dict, dict]:
    """(summary, tables) from the judgments dataset (see the module docstring); `rows`: how many it holds, when
    known (else counted)."""
    candidates, sums = _reduce(judgments, config, rows)
    tables = _chosen_rows(candidates, config)
    clusters = {
        "source": "rules",
        "note": None,
        **combine([json.loads(r["row"]) for r in candidates if r["dim"] == "cluster"], config.clusters.max_clusters),
    }
    total = sums.get("all", {}).get("", dict.fromkeys(["n", *SUMMED], 0.0))  # no rows: all zero
    families, categories = _per_family(sums)
    sketches = {column: {int(k): s["n"] for k, s in sums.get(f"sketch:{column}", {}).items()} for column in _EDGES}
    summary = {
        "rollouts": int(total["n"]),
        "solved": int(total["success"]),
        "success_rate": _clean(total["success"] / total["n"]) if total["n"] else None,
        "suspicious_wins": int(total["suspicious"]),
        "means": {k: v for k, v in _figures(total).items() if k not in ("rollouts", "success_rate")},
        "quantiles": {
            c: {f"p{int(q * 100)}": sketch_quantile(sketch, q) for q in (0.5, 0.9)} for c, sketch in sketches.items()
        },
        "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "per_family": families,
        "per_step": sorted(
            ({"step": int(k) if k else None, **_figures(s)} for k, s in sums.get("step", {}).items()),
            key=lambda r: (r["step"] is None, r["step"] or 0),
        ),  # rows without a step last
        "tool_mix": {k: int(s["n"]) for k, s in sorted(sums.get("tool", {}).items(), key=lambda kv: -kv[1]["n"])},
        "parallel_calls_per_turn": {
            k: int(s["n"]) for k, s in sorted(sums.get("parallel", {}).items(), key=lambda kv: int(kv[0]))
        },
        "histograms": _histograms(sums),
        "browse": {"shown": len(tables["rollouts"]), "of": int(total["n"])},
        "clusters": clusters,
        "judge": {
            "backend": config.judge.backend,
            "scored": int(total["judge_scored"]),
            "errors": int(total["judge_errors"]),
            "error_examples": [f"{r['task_id']}: {r['judge_error']}" for r in tables.pop("judge_errors")],
        },
    }
    return summary, tables


def _reduce(judgments, config, rows: int | None) -> tuple[list[dict], dict[str, dict[str, dict]]]:
    """The one Ray Data execution: (every batch's candidate rows, the partial sums summed by (dim, key)), summed
    in the driver or by a shuffle (`config.shuffle_aggregate`; the module docstring says when)."""
    k_worst, k_wins, k_browse = config.worst_failures, config.suspicious_wins, config.browse_rows
    # the sample's candidates: rows whose key is under 4x the share to show (about 4 x k_browse rows, so that
    # fewer than k_browse is out of reach: 30 standard deviations away), every row when all fit
    rows = judgments.count() if rows is None else rows
    browse_below = 1.0 if rows <= k_browse else min(1.0, 4.0 * k_browse / rows)
    partials = judgments.map_batches(
        batch_summary,
        fn_kwargs={"k_worst": k_worst, "k_wins": k_wins, "k_browse": k_browse, "browse_below": browse_below},
        batch_format="pyarrow",
    )
    if config.shuffle_aggregate:
        partials = partials.materialize()
        candidates = partials.filter(fn=lambda r: r["row"] is not None).take_all()
        summed = partials.filter(fn=lambda r: r["row"] is None).groupby(["dim", "key"]).sum(["n", *SUMMED]).take_all()
        sums = combine_partials(
            [{"dim": r["dim"], "key": r["key"], **{c: r[f"sum({c})"] for c in ("n", *SUMMED)}} for r in summed]
        )
    else:
        candidates, sums = [], {}
        for batch in partials.iter_batches(batch_format="pyarrow"):  # summed as they come: the driver holds sums
            batch_rows = batch.to_pylist()
            candidates += [r for r in batch_rows if r["row"] is not None]
            combine_partials([r for r in batch_rows if r["row"] is None], sums)
    return candidates, sums


def _chosen_rows(candidates: list[dict], config) -> dict[str, list[dict]]:
    """Each table's rows, in `TABLES` order: the best of every batch's candidates (lowest sort key, then
    longest), as many as the table shows; the browse sample ("rollouts") then in step, task, attempt order."""
    tables = {}
    for name, limit in zip(TABLES, (config.worst_failures, config.suspicious_wins, config.browse_rows, 3)):
        chosen = sorted(
            (r for r in candidates if r["dim"] == name),
            key=lambda r: (r["n"] if r["n"] is not None else 2.0, -(json.loads(r["row"])["wall_s"] or 0.0)),
        )
        tables[name] = [json.loads(r["row"]) for r in chosen[:limit]]
    tables["rollouts"].sort(key=lambda r: (r["step"] is None, r["step"] or 0, r["task_id"] or "", r["attempt"] or 0))
    return tables


def _figures(s: dict) -> dict:
    """A group's rollouts, success rate and means from its sums."""
    n = s["n"] or 1
    return {
        "rollouts": int(s["n"]),
        "success_rate": _clean(s["success"] / n),
        **{c: _clean(s[c] / s[f"{c}_count"]) if s[f"{c}_count"] else None for c in MEANS},
        "judge_score": _clean(s["judge_score"] / s["judge_scored"]) if s["judge_scored"] else None,
    }


def _per_family(sums: dict) -> tuple[dict[str, dict], dict[str, int]]:
    """({family: figures and rollouts per category}, {category: rollouts over all families})."""
    families = {name: {**_figures(s), "categories": {}} for name, s in sorted(sums.get("family", {}).items())}
    categories: dict[str, int] = {}
    for key, s in sums.get("family|category", {}).items():
        family, category = key.rsplit("|", 1)
        families[family]["categories"][category] = int(s["n"])
        categories[category] = categories.get(category, 0) + int(s["n"])
    return families, categories


def _histograms(sums: dict) -> dict[str, dict]:
    """{column: {"edges", "counts"}}, the 1-2-5 bins up to the highest one holding a value."""
    histograms = {}
    for column, edges in _EDGES.items():
        bins = {int(k): int(s["n"]) for k, s in sums.get(f"hist:{column}", {}).items()}
        top = max(bins, default=0) + 1
        histograms[column] = {
            "edges": [float(e) for e in edges[: top + 1]],
            "counts": [bins.get(i, 0) for i in range(top)],
        }
    return histograms


def write_summary(path: str, summary: dict, root: str | None = None) -> None:
    """summary.json, written atomically (a reader never sees half of it); `root`: the directory the user named
    (default: `path`'s own), below which no link is followed."""
    text = json.dumps(summary, indent=2, default=str)
    safe_files.write_file_beneath(root or os.path.dirname(path) or ".", path, text)
