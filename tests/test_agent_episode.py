"""Episodes end to end: prepared sandbox, the loop, diff, hidden checks, reward — and the scripted expert.

The hand-made task here exercises every kind of change a reference patch can
hold (several hunks in one file, a line that occurs twice, a new file, a
deleted file, a second file read in parallel); the generated task families
are solved in test_agent_expert.py.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
from openai_stub import OpenAIStub, call, reply

from codefleet.agent.attempts import best_trajectory, run_task_attempts
from codefleet.agent.clients import OpenAIPolicy
from codefleet.agent.clients.scripted import ScriptedExpert
from codefleet.agent.episode import EpisodeConfig, run_episode
from codefleet.agent.reward import RewardConfig, compute_reward
from codefleet.tasks.patch import make_unified_diff
from codefleet.types import HiddenChecks, Task

_STUB = "    # identity for now\n    return x\n"
CALC = (
    "def add(a, b):\n    return a - b\n\n\ndef clamp(x, lo, hi):\n"
    + _STUB
    + "\n\ndef twice(x):\n"
    + _STUB
    + "\n\ndef thrice(x):\n"
    + _STUB
    + "\n\ndef last():\n    return None\n"
)
CALC_FIXED = (
    CALC.replace("a - b", "a + b")
    .replace("hi):\n" + _STUB, "hi):\n    # identity for now\n    return max(lo, min(x, hi))\n")
    .replace("twice(x):\n" + _STUB, "twice(x):\n    # identity for now\n    return 2 * x\n")
)
UNITS = "SCALE = 1\n"
HIDDEN = """from pkg.calc import add, clamp, twice
from pkg.units import SCALE
import dataclasses
import os


def test_add():
    assert add(2, 3) == 5


def test_clamp():
    assert clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0


def test_twice():
    assert twice(4) == 8


def test_units_scale():
    assert SCALE == 10


def test_legacy_removed():
    assert not os.path.exists("pkg/legacy.py")
"""


@pytest.fixture
def task(tmp_path) -> Task:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    before = {
        "pkg/__init__.py": "",
        "pkg/calc.py": CALC,
        "pkg/units.py": UNITS,
        "pkg/legacy.py": "OLD = 1\n",
        "tests/test_visible.py": "from pkg.calc import thrice\n\n\ndef test_thrice():\n    assert thrice(1) == 1\n",
    }
    for path, text in before.items():
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text(text)
    after = {**before, "pkg/calc.py": CALC_FIXED, "pkg/units.py": "SCALE = 10\n", "pkg/extra.py": "EXTRA = 1\n"}
    del after["pkg/legacy.py"]
    tests = [
        "tests/test_hidden.py::" + t
        for t in ("test_add", "test_clamp", "test_twice", "test_units_scale", "test_legacy_removed")
    ]
    return Task(
        id="handmade-1",
        repo=str(repo),
        instruction="Fix `add`, `clamp` and `twice`; `SCALE` must be 10; remove pkg/legacy.py.",
        test_command="python3 -m pytest -q tests/test_visible.py",
        checks=HiddenChecks(
            command="python3 -m pytest -q -p no:cacheprovider {tests}",
            fail_to_pass=tests,
            files={"tests/test_hidden.py": HIDDEN},
        ),
        reference_patch=make_unified_diff(before, after, context_lines=1),
        metadata={"family": "handmade"},
    )


def test_scripted_expert_solves_the_task_like_an_agent(task, config):
    trajectory = run_episode(task, ScriptedExpert(task), config)
    assert trajectory.checks is not None, trajectory.metadata
    assert trajectory.checks.all_passed, trajectory.checks.output
    assert trajectory.reward == 1.0 and trajectory.stop_reason == "submit"
    names = [[c.name for c in t.tool_calls] for t in trajectory.turns]
    assert names[0] == ["list_dir", "search"]
    assert names[1] == ["read_file", "read_file"]  # both changed files read in one turn
    assert names[2].count("edit_file") == 4 and "write_file" in names[2] and "run" in names[2]
    assert names[3:] == [["run"], ["submit"]]
    edits = [c.arguments for c in trajectory.turns[2].tool_calls if c.name == "edit_file"]
    # "# identity for now / return x" occurs three times: the expert widened those edits until unique
    assert [("def clamp" in e["old_text"], "def twice" in e["old_text"]) for e in edits[1:3]] == [
        (True, False),
        (False, True),
    ]
    assert all(not t.errors for t in trajectory.turns), [t.errors for t in trajectory.turns]
    assert "[exit code 0]" in trajectory.turns[3].tool_results[0].output  # the visible tests ran and passed
    # the final diff is the reference solution's effect, and the figures are filled in
    assert "+    return max(lo, min(x, hi))" in trajectory.diff and "deleted file mode" in trajectory.diff
    assert "+++ b/pkg/extra.py" in trajectory.diff and "test_hidden" not in trajectory.diff.split("+++")[0]
    assert trajectory.metadata["turns"] == 5 and trajectory.metadata["tool_calls"] == trajectory.n_tool_calls
    assert trajectory.metadata["task.family"] == "handmade" and trajectory.tokens > 0
    assert trajectory.tool_calls_per_turn > 1


def test_the_hidden_tests_are_not_in_the_agents_sandbox(task, config):
    seen: list[str] = []

    def record(event: dict) -> None:
        if event["event"] == "turn":
            seen.append(event["text"])

    script = [reply("", call("run", {"command": "ls tests; cat tests/test_hidden.py; git log --all --oneline"}))]
    with OpenAIStub(script) as stub:
        trajectory = run_episode(task, OpenAIPolicy(stub.base_url), config, on_event=record)
    listing = trajectory.turns[0].tool_results[0].output
    assert "test_visible.py" in listing and "def test_add" not in listing
    assert trajectory.checks is not None and trajectory.checks.passed == 0 and trajectory.reward == 0.0
    assert trajectory.stop_reason == "no_tool_calls" and trajectory.diff == ""


def test_reward_modes_and_speed_costs(task, config):
    half_done = [
        reply(
            "",
            call("edit_file", {"path": "pkg/calc.py", "old_text": "return a - b", "new_text": "return a + b"}),
            call("write_file", {"path": "pkg/units.py", "content": "SCALE = 10\n"}),
        ),
        reply("", call("submit", {})),
    ]
    cost = RewardConfig(mode="fraction", cost_per_turn=0.01, cost_per_token=1e-6)
    with OpenAIStub(half_done) as stub:
        trajectory = run_episode(task, OpenAIPolicy(stub.base_url), config, config=EpisodeConfig(reward=cost))
    assert trajectory.checks.passed == 2 and trajectory.checks.total == 5 and not trajectory.checks.all_passed
    assert trajectory.reward == pytest.approx(0.4 - 0.02 - 1e-6 * trajectory.tokens)
    assert trajectory.checks.per_test["tests/test_hidden.py::test_add"] is True
    # the parts the report shows: correctness minus costs is the reward
    assert trajectory.metadata["reward.correctness"] == pytest.approx(0.4)
    assert trajectory.metadata["reward.costs"] == pytest.approx(0.02 + 1e-6 * trajectory.tokens)
    with pytest.raises(ValueError, match="unknown reward mode"):
        RewardConfig(mode="vibes")
    with pytest.raises(ValueError, match="unknown costs_on"):
        RewardConfig(costs_on="sometimes")
    # costs on solved episodes only: scaled by the correctness, so a failure scores 0 however long it ran
    scaled = RewardConfig(mode="fraction", cost_per_turn=0.01, cost_per_token=1e-6, costs_on="solved")
    assert compute_reward(trajectory, scaled) == pytest.approx(0.4 - 0.4 * (0.02 + 1e-6 * trajectory.tokens))
    # an episode that passed checks but never submitted is unsolved when the reward requires a submit
    strict = dataclasses.replace(scaled, require_submit=True)
    assert compute_reward(trajectory, strict) == compute_reward(trajectory, scaled)  # it submitted
    assert compute_reward(dataclasses.replace(trajectory, stop_reason="max_turns"), strict) == 0.0
    assert compute_reward(dataclasses.replace(trajectory, stop_reason="max_turns"), scaled) > 0
    trajectory.checks = dataclasses.replace(trajectory.checks, passed=0)
    assert compute_reward(trajectory, scaled) == 0.0
    assert compute_reward(trajectory, cost) == pytest.approx(-0.02 - 1e-6 * trajectory.tokens)


def test_tool_errors_cost_reward(task, config):
    script = [
        reply("", call("read_file", {"path": "no/such.py"}), call("nonexistent_tool", {})),
        reply("", call("submit", {})),
    ]
    cost = RewardConfig(mode="fraction", cost_per_tool_error=0.05)
    with OpenAIStub(script) as stub:
        trajectory = run_episode(task, OpenAIPolicy(stub.base_url), config, config=EpisodeConfig(reward=cost))
    assert trajectory.metadata["tool_errors"] == 2
    assert trajectory.reward == pytest.approx(trajectory.checks.fraction - 0.1)


def test_parallel_attempts_on_a_task_are_all_scored(task, config):
    trajectories = run_task_attempts(task, ScriptedExpert(task), 2, config)
    assert [t.metadata["attempt"] for t in trajectories] == [0, 1]
    assert all(t.reward == 1.0 and t.checks.all_passed for t in trajectories)
    assert best_trajectory(trajectories) in trajectories
    assert os.path.exists(os.path.join(task.repo, "pkg/legacy.py"))  # the task's repo itself is untouched


def test_exact_token_attempts_each_run_on_their_own_episode_view_of_the_engine(task, config):
    import torch

    from codefleet.agent.clients import LocalEnginePolicy
    from codefleet.chat.tokenizer import default_tokenizer
    from codefleet.inference.engine import Engine
    from codefleet.model.config import ModelConfig
    from codefleet.model.transformer import Transformer

    torch.manual_seed(0)
    engine = Engine(Transformer(ModelConfig.tiny()), default_tokenizer(), max_batch=4, max_seq_len=4096)
    try:
        policy = LocalEnginePolicy(engine=engine, max_tokens=8, temperature=1.0, seed=0)
        views = []
        original = policy.for_episode
        policy.for_episode = lambda: views.append(original()) or views[-1]
        trajectories = run_task_attempts(task, policy, 2, config, exact_tokens=True)
    finally:
        engine.close()
    # one view per attempt, and each holds exactly the tokens its episode sampled
    assert len(views) == 2
    assert sorted(sum(v.tokens.mask) for v in views) == sorted(
        sum(len(turn.token_ids) for turn in t.turns) for t in trajectories
    )
    assert all(sum(v.tokens.mask) > 0 for v in views)
