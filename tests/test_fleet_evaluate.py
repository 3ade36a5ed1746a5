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


def test_a_model_behind_an_openai_endpoint_is_evaluated_like_a_checkpoint(tmp_path, config, capsys):
    """`codefleet eval --model URL`: every turn is a chat request to a real HTTP server; here the server answers
    as the scripted expert would for the task in the request (edge of the world), so every attempt solves it."""
    from openai_stub import OpenAIStub, call, reply

    from codefleet.agent.clients.scripted import ScriptedExpert
    from codefleet.cli import main
    from codefleet.fleet.evaluate import EvalConfig, evaluate_endpoint
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
        report, results = evaluate_endpoint(stub.base_url, [*tasks, broken], EvalConfig(attempts=2, jobs=2),
                                            sandbox_config=config)
        assert report.checkpoint == "stub-model" and report.tasks == 2 and report.attempts == 2
        assert list(report.broken) == ["broken-setup"] and "pip: no network" in report.broken["broken-setup"]
        assert "broken-setup" not in results and "1 task(s) left out, their set-up fails: broken-setup" in report.table()
        assert report.success_rate == 1.0 and report.pass_at_n == 1.0, report.per_task
        assert all(len(ts) == 2 for ts in results.values())
        assert all("tools" in body for body in stub.requests)  # the full prompt: an endpoint serves any model
    for argv, words in ((["--model", "localhost:8000"], "is not a URL"),
                        (["--model", "http://127.0.0.1:9/v1", "--exact-tokens"], "needs codefleet's own engine"),
                        (["--model", "http://127.0.0.1:9/v1"], "127.0.0.1:9")):
        assert main(["eval", "--tasks", str(tmp_path / "tasks"), *argv]) == 2
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
