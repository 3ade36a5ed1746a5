"""The scripted expert solves generated tasks of every family completely, through the real harness.

Each task runs as a full episode: a prepared sandbox, the agent loop with
the expert as policy (the same tool-call JSON a model writes), the final
diff, and the hidden checks, which must all pass.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from codefleet.agent.clients.scripted import ScriptedExpert
from codefleet.agent.episode import run_episode
from codefleet.tasks.families import FAMILIES
from codefleet.tasks.generate import generate_tasks


def test_expert_solves_two_generated_tasks_of_every_family(tmp_path, config):
    tasks = generate_tasks(str(tmp_path / "tasks"), n=2 * len(FAMILIES), seed=3, split="all")
    assert {t.metadata["family"] for t in tasks} == set(FAMILIES)
    with ThreadPoolExecutor(max_workers=2) as pool:
        trajectories = list(pool.map(lambda task: run_episode(task, ScriptedExpert(task), config), tasks))
    for task, trajectory in zip(tasks, trajectories):
        assert trajectory.checks is not None, (task.id, trajectory.metadata)
        assert trajectory.checks.all_passed, (task.id, trajectory.checks.output[-2000:])
        assert trajectory.reward == 1.0 and trajectory.stop_reason == "submit", task.id
        assert not [e for turn in trajectory.turns for e in turn.errors], task.id  # every call was well-formed
        assert trajectory.diff.strip() and trajectory.n_turns <= 5
        names = [c.name for turn in trajectory.turns for c in turn.tool_calls]
        assert names[:1] == ["list_dir"] and names[-1] == "submit" and "run" in names, task.id
    # parallel tool use happens: somewhere several files were read in one turn
    assert any(sum(c.name == "read_file" for c in turn.tool_calls) >= 2
               for trajectory in trajectories for turn in trajectory.turns)
