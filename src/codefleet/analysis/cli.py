"""`codefleet analyze RUN_DIR [--judge rules|local:CKPT|URL] [--judge-model NAME] [--out DIR]`.

    codefleet analyze runs/r1                                   # rules only, offline
    codefleet analyze runs/r1 --judge http://127.0.0.1:8000/v1  # + an LLM judge (codefleet serve, vLLM, ...)
    codefleet analyze runs/r1/rollouts --judge local:runs/ckpt --out /tmp/a

RUN_DIR is a run directory with a `rollouts/` store or the store itself.
Writes OUT/summary.json, OUT/judgments.parquet/ and OUT/report.html (OUT
defaults to RUN_DIR/analysis) and prints where they are; Ray's own output goes
to OUT/ray.log. Exit status: 0 when
the analysis was written (even if some files were skipped or some rows could
not be judged: those are reported), 1 when there was nothing to analyse,
2 for bad arguments or a link under RUN_DIR (or OUT) where codefleet would
write: nothing is ever written, appended or removed through one (docs/security.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import ray

from codefleet.analysis.judge import JudgeConfig
from codefleet.analysis.pipeline import AnalyzeConfig, NoRollouts, analyze, output_dir, output_root
from codefleet.fleet.ray_init import ray_output_to
from codefleet.store import safe_files


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "analyze",
        help="analyse a run's rollouts with Ray Data: summary.json, judgments.parquet, report.html",
        description="Categorise every rollout of a run (rules), optionally score it with an LLM judge, "
        "aggregate per family and step, and write OUT/summary.json, OUT/judgments.parquet and OUT/report.html.",
    )
    p.add_argument("run_dir", help="run directory containing rollouts/, or the rollout store itself")
    p.add_argument(
        "--judge",
        default="rules",
        help="rules (default, offline), local:CHECKPOINT_DIR, or an "
        "OpenAI-compatible base URL such as http://127.0.0.1:8000/v1",
    )
    p.add_argument("--judge-model", default="", help="model name for a URL judge (default: the first it lists)")
    p.add_argument("--out", default="", help="output directory (default RUN_DIR/analysis)")
    p.add_argument("--rubric", default="", help="rubric file for the LLM judge (default: the packaged rubric.md)")
    p.add_argument("--judge-timeout-s", type=float, default=60.0, help="per judge request (default 60)")
    p.add_argument("--judge-retries", type=int, default=2, help="retries per judge request (default 2)")
    p.add_argument(
        "--judge-rate",
        type=float,
        default=0.0,
        help="judge requests per second, all actors together (default 0: unlimited)",
    )
    p.add_argument("--judge-actors", type=int, default=2, help="most judge actors at once (default 2)")
    p.add_argument("--judge-in-flight", type=int, default=4, help="concurrent requests per judge actor (default 4)")
    p.add_argument(
        "--num-cpus",
        type=int,
        default=None,
        help="CPUs for a local Ray started here (default: "
        "min(cores, 8), at least 2); ignored when RAY_ADDRESS points at a cluster",
    )
    p.add_argument(
        "--object-store-mb",
        type=int,
        default=1024,
        help="object store of a local Ray started here (default 1024; it bounds the memory blocks in flight may take)",
    )
    p.add_argument("--no-report", action="store_true", help="skip report.html")
    p.add_argument("--progress", action="store_true", help="show Ray Data progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    judge = JudgeConfig(
        backend=args.judge,
        model=args.judge_model,
        rubric_path=args.rubric,
        timeout_s=args.judge_timeout_s,
        max_retries=args.judge_retries,
        rate_limit_per_s=args.judge_rate,
        actors=args.judge_actors,
        requests_in_flight=args.judge_in_flight,
    )
    try:
        if judge.kind == "local" and not os.path.isdir(judge.backend.removeprefix("local:")):
            raise ValueError(
                f"judge checkpoint {judge.backend.removeprefix('local:')!r} is not a directory; give "
                "--judge local:DIR a directory written by codefleet.model.checkpoint.save"
            )
        judge.rubric()
    except (ValueError, OSError) as e:
        print(f"codefleet analyze: {e}", file=sys.stderr)
        return 2
    config = AnalyzeConfig(
        out_dir=args.out,
        judge=judge,
        report=not args.no_report,
        progress=args.progress,
        num_cpus=args.num_cpus,
        object_store_mb=args.object_store_mb,
    )
    try:
        # the directory the user named (OUT, or RUN_DIR for RUN_DIR/analysis): nothing below it is reached
        # through a link (codefleet.store.safe_files, docs/security.md)
        root, out_dir = output_root(args.run_dir, config), output_dir(args.run_dir, config)
        created = not safe_files.lexists_beneath(root, out_dir) if out_dir != root else not os.path.exists(root)
        safe_files.makedirs_beneath(root, out_dir)
        # Ray's own lines (start-up, library warnings, its workers' logs) go to OUT/ray.log, not to the terminal
        ray_was_up = ray.is_initialized()  # a caller's Ray (a test session's) is left running
        with ray_output_to(os.path.join(out_dir, "ray.log"), root=root) as terminal:
            try:
                result = analyze(
                    args.run_dir, config, log=lambda msg: print(msg, file=terminal, flush=True), progress_to=terminal
                )
            except BaseException:
                if created:  # nothing was analysed: leave no output directory behind
                    with contextlib.suppress(OSError):
                        safe_files.remove_beneath(root, out_dir)
                raise
            finally:
                if not ray_was_up:
                    ray.shutdown()  # inside: what Ray prints as it stops goes to the log too
    except (FileNotFoundError, safe_files.LinkRefused) as e:
        print(f"codefleet analyze: {e}", file=sys.stderr)
        return 2
    except NoRollouts as e:
        print(f"codefleet analyze: {e}", file=sys.stderr)
        return 1
    s = result.summary
    rate = f"{s['success_rate']:.1%}" if s["success_rate"] is not None else "-"
    print(
        f"{s['rollouts']} rollouts, {rate} solved, {s['suspicious_wins']} suspicious wins, categories {s['categories']}"
    )
    if result.problems:
        print(f"{len(result.problems)} problem(s) reported above; the rest was analysed")
    print(
        f"wrote {result.out_dir}/summary.json, judgments.parquet/, "
        f"{'report.html' if config.report else '(no report)'} in {result.timings_s['total_s']:.1f} s"
    )
    return 0
