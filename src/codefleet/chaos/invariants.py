"""What a run must keep whatever breaks, checked after the fact from its run directory, its rollout store and the
machine (`codefleet chaos`, docs/reliability.md).

- `finished`: LATEST names the last RL step (`rl.steps`) and results.json was written.
- `no_trained_twice`: no rollout id appears in two steps' `trained/step-*.json`.
- `trained_were_accepted`: every trained rollout was durable (an accepted group's pickle) before it was trained.
- `no_accepted_lost`: every accepted group whose deadline step has passed was trained. The buffer trains a group
  by its deadline (admission version + eta) or waits, so an accepted group missing from the trained steps past its
  deadline was lost; groups still inside their deadline when the run ended are counted, not failed.
- `lag_within_eta`: every trained rollout's version lag (the step that trained it minus the version it was
  sampled with) is at most `controller.eta`.
- `store_complete`: every accepted rollout has its row in the rollout store.
- `no_leaks`: once the run is over, no sandbox process (a bwrap running under the name of an owner in the
  soak's state directory, and anything under it), no mount under the state directory, and no live codefleet
  actor in the cluster.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import yaml

from codefleet.chaos.faults import cmdline, descendants, sandbox_roots
from codefleet.recipe.run_dir import RunDir
from codefleet.store.parquet import read_rollouts

_STEP_FILE = re.compile(r"step-(\d+)\.json$")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class RunFacts:
    """What the run directory says, gathered once."""

    steps: int  # rl.steps
    eta: int  # controller.eta
    final_version: int  # what LATEST names (0: none)
    results: bool
    accepted: dict[str, tuple[int, int]] = field(default_factory=dict)  # rollout id -> (policy version, deadline)
    trained: dict[int, list[str]] = field(default_factory=dict)  # trainer step -> rollout ids
    damaged: list[str] = field(default_factory=list)


def read_run(run_dir: str) -> RunFacts:
    run = RunDir(run_dir)
    with open(run.path("config.yaml")) as f:
        config = yaml.safe_load(f) or {}
    latest = run.latest()
    facts = RunFacts(
        steps=int(config["rl"]["steps"]),
        eta=int(config["controller"]["eta"]),
        final_version=latest[1] if latest else 0,
        results=os.path.isfile(run.path("results.json")),
    )
    groups, facts.damaged = run.load_groups()
    for g in groups:
        for r in g.rollouts:
            facts.accepted[r.rollout_id] = (r.policy_version, g.ticket.deadline)
    for path in glob.glob(run.path("trained", "step-*.json")):
        version = int(_STEP_FILE.search(path).group(1))
        with open(path) as f:
            facts.trained[version - 1] = json.load(f)  # step-N.json: the batch that took the policy to version N
    return facts


def lost_rollouts(facts: RunFacts) -> list[str]:
    """Accepted rollouts not trained although their group's deadline step was run."""
    trained = {rid for ids in facts.trained.values() for rid in ids}
    return sorted(
        rid
        for rid, (_, deadline) in facts.accepted.items()
        if rid not in trained and deadline <= facts.final_version - 1
    )


def run_checks(facts: RunFacts, store_root: str) -> list[Check]:
    checks = [
        Check(
            "finished",
            facts.final_version >= facts.steps and facts.results,
            f"LATEST at step {facts.final_version} of {facts.steps}, results.json "
            f"{'written' if facts.results else 'missing'}",
        )
    ]
    seen: dict[str, int] = {}
    twice = []
    for step in sorted(facts.trained):
        for rid in facts.trained[step]:
            if rid in seen:
                twice.append(f"{rid} (steps {seen[rid]} and {step})")
            seen[rid] = step
    checks.append(
        Check(
            "no_trained_twice",
            not twice,
            f"{len(seen)} rollouts trained in {len(facts.trained)} steps"
            + (f"; twice: {', '.join(twice[:5])}" if twice else ""),
        )
    )
    unknown = sorted(set(seen) - set(facts.accepted))
    checks.append(
        Check(
            "trained_were_accepted",
            not unknown,
            f"{len(seen)} of {len(seen)} trained rollouts were accepted first"
            if not unknown
            else f"{len(unknown)} trained rollouts have no accepted group: {', '.join(unknown[:5])}",
        )
    )
    untrained = set(facts.accepted) - set(seen)
    lost = lost_rollouts(facts)
    checks.append(
        Check(
            "no_accepted_lost",
            not lost,
            f"{len(facts.accepted)} accepted, {len(seen)} trained, {len(untrained) - len(lost)} still "
            f"inside their deadline at the end"
            + (f"; lost: {', '.join(lost[:5])}" if lost else "")
            + (f"; damaged group files: {facts.damaged}" if facts.damaged else ""),
        )
    )
    lags = [step - facts.accepted[rid][0] for rid, step in seen.items() if rid in facts.accepted]
    over = [lag for lag in lags if lag > facts.eta]
    checks.append(
        Check(
            "lag_within_eta",
            not over,
            f"max lag {max(lags, default=0)} with eta {facts.eta} over {len(lags)} trained rollouts"
            + (f"; {len(over)} over eta" if over else ""),
        )
    )
    try:
        table = read_rollouts(store_root, columns=["group", "attempt", "split"], on_problem=lambda msg: None)
        rows = {
            f"{g}/{a}"
            for g, a, s in zip(table["group"].to_pylist(), table["attempt"].to_pylist(), table["split"].to_pylist())
            if s == "train"
        }
        missing = sorted(set(facts.accepted) - rows)
        checks.append(
            Check(
                "store_complete",
                not missing,
                f"{len(facts.accepted) - len(missing)} of {len(facts.accepted)} accepted rollouts in the "
                "store" + (f"; missing: {', '.join(missing[:5])}" if missing else ""),
            )
        )
    except Exception as e:  # noqa: BLE001 - an unreadable store is a failed check, said in one line
        checks.append(Check("store_complete", False, f"the rollout store could not be read: {e!r}"))
    return checks


def leaks(state_dir: str, live_actors: list[str], whose: Callable[[int], str] | None = None) -> Check:
    """Sandbox processes, mounts under `state_dir`, and codefleet actors (`live_actors`, described) still there.
    `whose(pid)` says what the sandbox owner with that pid was (a host, the fault that hit it): each leaked mount is
    grouped under its owner (`<state_dir>/<pid>-…/`), so that a leak says where it came from."""
    found = []
    for root in sandbox_roots(state_dir):
        found.append(f"sandbox process tree {root} ({1 + len(descendants(root))} processes: {cmdline(root)[:80]})")
    prefix = state_dir.rstrip("/") + "/"
    by_owner: dict[str, list[str]] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4]
            if point.startswith(prefix):
                by_owner.setdefault(point[len(prefix) :].split("/", 1)[0], []).append(point)
    for owner, points in by_owner.items():
        pid = _OWNER_PID.match(owner)
        said = f"; {whose(int(pid[1]))}" if pid and whose else ""
        found.append(
            f"{len(points)} mount(s) of owner {owner}{said}: " + ", ".join(p[len(prefix) :] for p in points[:4])
        )
    found += [f"actor {a}" for a in live_actors]
    return Check(
        "no_leaks",
        not found,
        "no sandbox process, mount or actor left" if not found else f"{len(found)} left: " + "; ".join(found[:8]),
    )


_OWNER_PID = re.compile(r"(\d+)-")  # a sandbox owner's directory: <pid>-<start ticks>-<hex> (sandbox/state.py)
