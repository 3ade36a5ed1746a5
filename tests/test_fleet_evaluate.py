"""fleet.evaluate.summarize: the figures of an evaluation, hand-computed, and its warning when the wall
clock, not the policy, ended the attempts."""

from __future__ import annotations

from codefleet.fleet.evaluate import summarize
from codefleet.types import CheckResult, Trajectory


def _attempt(solved: bool, stop: str, wall_s: float) -> Trajectory:
    return Trajectory(task_id="t", messages=[], turns=[], stop_reason=stop, wall_s=wall_s,
                      checks=CheckResult(passed=int(solved), total=1, all_passed=solved))


def test_summary_counts_attempts_the_wall_clock_cut_off():
    results = {"a": [_attempt(True, "submit", 2.0), _attempt(False, "wall_clock", 60.0)],
               "b": [_attempt(False, "max_turns", 5.0), _attempt(False, "submit", 3.0)]}
    report = summarize("ckpt", results, attempts=2, eval_s=1.0)
    assert report.success_rate == 0.25 and report.pass_at_n == 0.5
    assert report.wall_s == 17.5 and report.wall_s_per_solved == 2.0
    assert report.wall_clock_stops == 0.25 and report.summary()["wall_clock_stops"] == 0.25
    assert "25% of the attempts ran out of their wall-clock budget" in report.table()
    calm = summarize("ckpt", {"a": results["a"][:1], "b": results["b"][:1]}, attempts=1, eval_s=1.0)
    assert calm.wall_clock_stops == 0.0 and calm.clock_warning() == "" and "warning" not in calm.table()
