"""`codefleet chaos RUN_CONFIG --minutes N --seed S`: a training run under injected faults (soak.py)."""

from __future__ import annotations

import argparse
import json
import sys

from codefleet.chaos.faults import KINDS
from codefleet.chaos.soak import SoakConfig, soak, table


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "chaos",
        help="a training run on a local multi-node Ray cluster under injected faults, then its invariants",
        description="Runs `codefleet train --config RUN_CONFIG` on a local Ray cluster (a head and --nodes worker "
        "nodes on this machine) while killing rollout workers, sandbox hosts, an engine, a trainer worker, a "
        "sandbox's processes and a whole worker node, and filling a sandbox's disk, at seeded random times; then "
        "checks that the run finished, that no accepted rollout was lost or trained twice, that every lag is within "
        "eta, and that nothing leaked (docs/reliability.md). Exit status 0 when every invariant holds.",
    )
    p.add_argument("run_config", metavar="RUN_CONFIG", help="YAML file of training settings (docs/configuration.md)")
    p.add_argument("--minutes", type=float, default=5.0, help="length of the fault window, from RL's start")
    p.add_argument("--seed", type=int, default=0, help="seeds the fault schedule and the targets")
    p.add_argument("--out", default="chaos", help="directory for the run, its log and chaos-report.json")
    p.add_argument("--nodes", type=int, default=2, help="worker nodes (sandboxes and rollout workers)")
    p.add_argument("--faults", default=",".join(KINDS), help=f"kinds to inject, comma-separated ({', '.join(KINDS)})")
    p.add_argument("--per-kind", type=int, default=1, help="faults of each kind in the window")
    p.add_argument("--json", action="store_true", help="print only the report as JSON")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="`codefleet train` overrides")
    p.set_defaults(func=_chaos)


def _chaos(args: argparse.Namespace) -> int:
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip())
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds or args.minutes <= 0 or args.nodes < 1 or args.per_kind < 1:
        what = f"unknown fault kinds {unknown}" if unknown else "--minutes, --nodes and --per-kind must be above 0"
        print(f"codefleet chaos: {what}; kinds are {', '.join(KINDS)}", file=sys.stderr)
        return 2
    cfg = SoakConfig(
        args.run_config,
        minutes=args.minutes,
        seed=args.seed,
        out=args.out,
        overrides=args.overrides,
        worker_nodes=args.nodes,
        kinds=kinds,
        per_kind=args.per_kind,
    )
    try:
        report = soak(cfg)
    except (OSError, ValueError, RuntimeError) as e:  # a missing file, a cluster that cannot start, a run that ended
        print(f"codefleet chaos: {e}", file=sys.stderr)
        return 1
    if not args.json:
        print(table(report))
        print(f"report: {args.out}/chaos-report.json")
    else:
        print(json.dumps(report))
    return 0 if report["ok"] else 1
