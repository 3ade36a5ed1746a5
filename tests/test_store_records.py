"""Run-directory records: dataclasses to JSON and back by their declared types, never by code the file names."""

from __future__ import annotations

import json
import os

import pytest

from codefleet.fleet.staleness import Group, Rollout, Ticket
from codefleet.recipe.demos import Demos
from codefleet.store import records
from codefleet.types import CheckResult, Failure, TokenSequence, ToolCall, Trajectory, Turn


def _group() -> Group:
    turn = Turn(
        0,
        "let me look",
        [ToolCall("c1", "read_file", '{"path": "a.py"}', {"path": "a.py"})],
        token_ids=[1, 2, 3],
        logprobs=[-0.1, -0.2, -0.3],
        policy_versions=[4, 4, 4],
        routed_experts=[[0, 1], [2, 3], [1, 0]],
    )
    trajectory = Trajectory(
        "t1",
        [{"role": "user", "content": "fix it"}],
        [turn],
        "error",
        failure=Failure.ENGINE_DIED,
        sequence=TokenSequence([1, 2], [0, 1], [0.0, -0.5], [-1, 4]),
        diff="--- a\n+++ b\n",
        checks=CheckResult(1, 2, False, {"test_a": True, "test_b": False}),
        reward=float("nan"),
        metadata={"attempt": 1, "task.expects_changed": ["a.py"], "note": "x"},
    )
    return Group(Ticket(7, 4, 5, 2), [Rollout("7/0", 7, 4, 0.5, trajectory), Rollout("7/1", 7, 4, 0.0)])


def test_a_group_and_demonstrations_round_trip():
    group = _group()
    back = records.loads(records.dumps(group), Group)
    assert back.rollouts[1] == group.rollouts[1] and back.ticket == group.ticket
    t, t0 = back.rollouts[0].trajectory, group.rollouts[0].trajectory
    assert t.failure is Failure.ENGINE_DIED and t.turns == t0.turns and t.sequence == t0.sequence
    assert t.metadata == t0.metadata and t.checks == t0.checks and t.reward != t.reward  # NaN survives
    demos = Demos(
        examples=[([1, 2, 3], [0, 1, 1])],
        task_ids=["t1"],
        broken={"t2": "set-up fails"},
        conversations=[[{"role": "user", "content": "hi"}]],
        variants=[{(True, False): [{"role": "assistant", "content": "a"}], (False, False): []}],
    )
    assert records.loads(records.dumps(demos), Demos) == demos


@pytest.mark.parametrize(
    "data, says",
    [
        (
            b'{"ticket": {"group_id": "7", "policy_version": 1, "deadline": 2, "group_size": 1}, "rollouts": []}',
            "$.ticket.group_id: expected int",
        ),
        (
            b'{"ticket": {"group_id": 7, "policy_version": 1, "deadline": 2, "group_size": 1}, "rollouts": [], "x": 1}',
            "Group has no field 'x'",
        ),
        (b'{"ticket": [], "rollouts": []}', "expected an object for Ticket"),
        (b"\x80abc", "not a JSON record"),
        (b"[" * 100_000 + b"]" * 100_000, "not a JSON record"),
    ],
)
def test_a_record_that_does_not_match_its_types_is_one_clear_error(data, says):
    with pytest.raises(records.RecordError, match=says.replace("$", r"\$").replace("[", r"\[")):
        records.loads(data, Group)


def test_a_pickle_planted_in_a_run_directory_is_never_loaded(tmp_path):
    """A run directory is shared storage: a group file that is a pickle (which would run code when loaded) is
    reported as unreadable, and the code in it never runs."""
    from codefleet.recipe.run_dir import RunDir

    run = RunDir(str(tmp_path / "run"))
    run.save_group(_group())
    canary = tmp_path / "canary"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {canary}",))

    import pickle

    (tmp_path / "run" / "accepted" / "group-00000008.pkl").write_bytes(pickle.dumps(Evil()))
    (tmp_path / "run" / "accepted" / "group-00000009.json").write_bytes(pickle.dumps(Evil()))
    groups, bad = run.load_groups()
    assert [g.ticket.group_id for g in groups] == [7]
    assert len(bad) == 1 and bad[0].startswith("group-00000009.json: RecordError")
    assert not canary.exists()
    json.loads((tmp_path / "run" / "accepted" / "group-00000007.json").read_text())  # plain JSON for any reader
