"""`codefleet bench mine`: how fast `codefleet tasks mine` turns real libraries into checked tasks.

For each cached source distribution of the default set (`make sdists`: scripts/mined-libraries.txt into
.cache/sdists of the current directory, or CODEFLEET_SDISTS; `--quick`: six alone), one `mine_library` run
with seed 0 and `max_tasks` tasks, every task proven sound by `check_tasks` (part of the time). Reported per
library and over all:

- `tasks_per_min`: tasks kept per minute of wall clock, everything included (unpacking, the original suite's
  run, the mutants' runs, the checks);
- `kept_share`: tasks kept / mutants tried (a mutant no test notices is not a task);
- `tried`, `kept`, `wall_s`, and the kinds kept.

There is no peer in the same run: no other tool here mines tasks.
"""

from __future__ import annotations

import glob
import os
import tempfile
import time
from dataclasses import asdict, dataclass

from codefleet.bench.report import Log, report
from codefleet.tasks.mine import mine_library

SDISTS = os.environ.get("CODEFLEET_SDISTS", os.path.join(".cache", "sdists"))  # what `make sdists` fills


@dataclass
class BenchConfig:
    libraries: tuple[str, ...] = ("six", "toolz", "more-itertools")
    max_tasks: int = 6
    seed: int = 0
    quick: bool = False


QUICK = BenchConfig(libraries=("six",), max_tasks=3, quick=True)


def _sdist(name: str, sdists: str) -> str | None:
    found = sorted(
        glob.glob(os.path.join(sdists, f"{name}-*.tar.gz"))
        + glob.glob(os.path.join(sdists, f"{name.replace('-', '_')}-*.tar.gz"))
    )
    return found[-1] if found else None


def run(cfg: BenchConfig, log: Log = print, sdists: str | None = None) -> dict:
    sdists = sdists or SDISTS
    per_library, missing = {}, []
    with tempfile.TemporaryDirectory(prefix="codefleet-bench-mine-") as out:
        for name in cfg.libraries:
            source = _sdist(name, sdists)
            if source is None:
                missing.append(name)
                continue
            started = time.perf_counter()
            mined = mine_library(source, os.path.join(out, name), seed=cfg.seed, max_tasks=cfg.max_tasks)
            wall_s = time.perf_counter() - started
            tried, kept = sum(mined.tried.values()), len(mined.tasks)
            per_library[name] = {
                "version": mined.version,
                "wall_s": round(wall_s, 2),
                "tried": tried,
                "kept": kept,
                "tasks_per_min": round(60 * kept / wall_s, 2),
                "kept_share": round(kept / tried, 3) if tried else 0.0,
                "kinds_kept": dict(sorted(mined.kept.items())),
            }
            log(f"{name} {mined.version}: {kept} tasks of {tried} mutants in {wall_s:.1f} s")
    if not per_library:
        raise FileNotFoundError(
            f"no cached source distribution of {', '.join(cfg.libraries)} in "
            f"{os.path.abspath(sdists)}; run `make sdists` there (it fetches them from PyPI once)"
        )
    wall = sum(r["wall_s"] for r in per_library.values())
    tried = sum(r["tried"] for r in per_library.values())
    kept = sum(r["kept"] for r in per_library.values())
    return {
        "tasks_per_min": round(60 * kept / wall, 2),
        "kept_share": round(kept / tried, 3) if tried else 0.0,
        "tasks": kept,
        "mutants_tried": tried,
        "wall_s": round(wall, 2),
        "per_library": per_library,
        "missing": missing,
        "config": asdict(cfg),
        "cpus": os.cpu_count(),
    }


def table(r: dict) -> str:
    lines = [f"{'library':<16} {'version':<9} {'tried':>6} {'kept':>5} {'kept %':>7} {'wall s':>7} {'tasks/min':>10}"]
    for name, m in r["per_library"].items():
        lines.append(
            f"{name:<16} {m['version']:<9} {m['tried']:>6} {m['kept']:>5} {m['kept_share']:>7.0%} "
            f"{m['wall_s']:>7.1f} {m['tasks_per_min']:>10.2f}"
        )
    lines.append(
        f"{'all':<16} {'':<9} {r['mutants_tried']:>6} {r['tasks']:>5} {r['kept_share']:>7.0%} "
        f"{r['wall_s']:>7.1f} {r['tasks_per_min']:>10.2f}"
    )
    lines += [f"{name}: not cached (make sdists)" for name in r["missing"]]
    return "\n".join(lines)


def run_cli(quick: bool = False, as_json: bool = False) -> int:
    cfg = QUICK if quick else BenchConfig()
    return report(
        lambda log: run(cfg, log),
        lambda r: (
            f"codefleet bench mine (seed {cfg.seed}, at most "
            f"{cfg.max_tasks} tasks per library{', quick' if quick else ''})"
        ),
        table,
        as_json,
        name="mine",
    )
