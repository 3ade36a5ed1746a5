"""fleet.evaluate.summarize: the figures of an evaluation, hand-computed, and its warning when the wall
clock, not the policy, ended the attempts."""

from __future__ import annotations

from codefleet.recipe.evaluate import compare, comparison_line, difference_interval, summarize, wilson_interval
from codefleet.types import CheckResult, Trajectory


def _attempt(solved: bool, stop: str, wall_s: float) -> Trajectory:
    return Trajectory(
        task_id="t",
        messages=[],
        turns=[],
        stop_reason=stop,
        wall_s=wall_s,
        checks=CheckResult(passed=int(solved), total=1, all_passed=solved),
    )


def test_summary_counts_attempts_the_wall_clock_cut_off():
    results = {
        "a": [_attempt(True, "submit", 2.0), _attempt(False, "wall_clock", 60.0)],
        "b": [_attempt(False, "max_turns", 5.0), _attempt(False, "submit", 3.0)],
    }
    report = summarize("ckpt", results, attempts=2, eval_s=1.0)
    assert report.success_rate == 0.25 and report.pass_at_n == 0.5
    assert report.wall_s == 17.5 and report.wall_s_per_solved == 2.0
    assert report.wall_clock_stops == 0.25 and report.summary()["wall_clock_stops"] == 0.25
    assert "25% of the attempts ran out of their wall-clock budget" in report.table()
    assert "success rate       25.0% (95% interval 4.6% to 69.9%, 4 attempts)" in report.table()  # Wilson, 1 of 4
    calm = summarize("ckpt", {"a": results["a"][:1], "b": results["b"][:1]}, attempts=1, eval_s=1.0)
    assert calm.wall_clock_stops == 0.0 and calm.clock_warning() == "" and "warning" not in calm.table()


def test_intervals_against_newcombes_worked_examples():
    # Newcombe (1998), Statistics in Medicine 17: 81/263 has the Wilson interval 0.2553-0.3662; 56/70 - 48/80
    # = 0.2000 has the hybrid score interval 0.0524-0.3339 (method 10)
    assert [round(x, 4) for x in wilson_interval(81, 263)] == [0.2553, 0.3662]
    assert [round(x, 4) for x in difference_interval(56, 70, 48, 80)] == [0.0524, 0.3339]
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0


def test_rl_against_sft_says_what_changed_with_intervals_and_which_changes_are_clear_of_noise():
    def summary(solved_turns, n=160):
        return {"tasks": n // 8, "attempts": 8, "success_rate": len(solved_turns) / n, "solved_turns": solved_turns}

    sft = summary([2, 3, 4, 4, 6, 6, 7])
    noise = compare(sft, summary([2, 2, 3, 3, 4, 4, 6, 7]))  # 7 vs 8 solved
    assert noise["solved"] == [7, 8] and noise["success_points"] == 0.0063
    assert noise["turns_change"] == round(31 / 8 / 4.5714285714 - 1, 4) == -0.1523
    lo, hi = noise["turns_change_ci"]
    assert lo < -0.2 and hi > 0  # seven solved episodes cannot tell -15% from nothing
    line = comparison_line(noise)
    assert line.startswith("rl against sft: success +0.6 points (95% interval") and "-15% (95% interval" in line
    assert "neither change is distinguishable from noise" in line and "target" not in line.lower()

    faster = compare(sft, summary([2] * 7))  # the same success, every solve in 2 turns: -56%
    assert faster["turns_change"] == round(2 / (32 / 7) - 1, 4) and faster["turns_change_ci"][1] < 0
    assert comparison_line(faster).endswith("Clear of noise: solved tasks took fewer turns.")
    better = compare(sft, summary([3] * 24))  # 4.4% -> 15%: +10.6 points
    assert better["success_points_ci"][0] > 0 and "Clear of noise: success rose" in comparison_line(better)
    worse_but_faster = compare(summary([3] * 24), summary([2] * 7))
    assert comparison_line(worse_but_faster).endswith("success fell and solved tasks took fewer turns.")
    assert compare({**sft, "solved_turns": []}, summary([2]))["turns_change"] is None  # an old run's report


def test_a_model_behind_an_openai_endpoint_is_evaluated_like_a_checkpoint(tmp_path, config, capsys):
    """`codefleet eval --model URL`: every turn is a chat request to a real HTTP server; here the server answers
    as the scripted expert would for the task in the request (edge of the world), so every attempt solves it."""
    from openai_stub import OpenAIStub, call, reply

    from codefleet.agent.clients.scripted import ScriptedExpert
    from codefleet.cli import main
    from codefleet.recipe.evaluate import EvalConfig, evaluate_endpoint
    from codefleet.tasks.generate import generate_tasks

    tasks = generate_tasks(str(tmp_path / "tasks"), n=2, seed=3, families=["bugfix", "rename"], split="test")

    def expert(body: dict):
        task_message = next(m["content"] for m in body["messages"] if m["role"] == "user")
        task = next(t for t in tasks if t.instruction.strip() in task_message)
        out = ScriptedExpert(task).generate(body["messages"], body.get("tools") or [])
        return reply(out.text, *[call(c.name, c.raw_arguments) for c in out.tool_calls])

    import dataclasses

    broken = dataclasses.replace(tasks[0], id="broken-setup", setup_commands=["echo 'pip: no network' >&2; exit 1"])
    with OpenAIStub([expert] * 40) as stub:
        report, results = evaluate_endpoint(
            stub.base_url, [*tasks, broken], EvalConfig(attempts=2, jobs=2), sandbox_config=config
        )
        assert report.checkpoint == "stub-model" and report.tasks == 2 and report.attempts == 2
        assert list(report.broken) == ["broken-setup"] and "pip: no network" in report.broken["broken-setup"]
        assert (
            "broken-setup" not in results and "1 task(s) left out, their set-up fails: broken-setup" in report.table()
        )
        assert report.success_rate == 1.0 and report.pass_at_n == 1.0, report.per_task
        assert all(len(ts) == 2 for ts in results.values())
        assert all("tools" in body for body in stub.requests)  # the full prompt: an endpoint serves any model
    for argv, words in (
        (["--model", "localhost:8000"], "is not a URL"),
        (["--model", "http://127.0.0.1:9/v1", "--exact-tokens"], "needs codefleet's own engine"),
        (["--model", "http://127.0.0.1:9/v1", "--tool-grammar"], "codefleet serve --tool-grammar"),
        (["--model", "http://127.0.0.1:9/v1"], "127.0.0.1:9"),
    ):
        assert main(["eval", "--tasks", str(tmp_path / "tasks"), *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
