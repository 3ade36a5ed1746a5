"""Tasks mined from a real library (six 1.16.0, its sdist cached by `make sdists`): they check sound, and
`codefleet eval` runs the harness on them against a real OpenAI-protocol server that answers as the scripted
expert (the edge of the world), reporting success per library and per mutation kind."""

from __future__ import annotations

import json
import os

import pytest
from openai_stub import OpenAIStub, call, reply

from codefleet.agent.clients.scripted import ScriptedExpert
from codefleet.cli import main
from codefleet.tasks.spec import load_tasks

SDIST = os.path.join(os.path.dirname(__file__), "..", ".cache", "sdists", "six-1.16.0.tar.gz")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_tasks_mined_from_six_check_sound_and_evaluate_through_the_harness(tmp_path, capsys):
    if not os.path.exists(SDIST):
        pytest.skip("the cached sdists are missing: run `make sdists` (it fetches them from PyPI once)")
    out = str(tmp_path / "mined")
    assert main(["tasks", "mine", SDIST, "--out", out, "--seed", "0", "--max-tasks", "2"]) == 0
    tasks = load_tasks(out)
    assert len(tasks) == 2 and {t.metadata["library"] for t in tasks} == {"six"}
    assert main(["tasks", "check", out]) == 0  # reference passes, untouched fails, deterministic

    def expert(body: dict):
        task_message = next(m["content"] for m in body["messages"] if m["role"] == "user")
        task = next(t for t in tasks if t.instruction.strip() in task_message)
        done = ScriptedExpert(task).generate(body["messages"], body.get("tools") or [])
        return reply(done.text, *[call(c.name, c.raw_arguments) for c in done.tool_calls])

    capsys.readouterr()
    with OpenAIStub([expert] * 40) as stub:
        assert main(["eval", "--model", stub.base_url, "--tasks", out, "--jobs", "2"]) == 0
    printed = capsys.readouterr().out
    assert "by library         six 100% (2)" in printed and "by mutation" in printed, printed
    report = json.loads(printed.strip().splitlines()[-1])  # the table, then one JSON object
    assert report["success_rate"] == 1.0 and set(report["groups"]) == {"library", "mutation"}
