"""Rollouts on the shared Ray session: engine actors, rollout workers on the sandbox fleet, weight broadcast,
and infrastructure failures that are not the agent's."""

from __future__ import annotations

import pytest
import ray
import torch

from codefleet.agent.episode import EpisodeConfig
from codefleet.chat.tokenizer import default_tokenizer
from codefleet.fleet.controller import AttemptResult
from codefleet.fleet.inference import broadcast_weights, start_engines
from codefleet.fleet.rollouts import AgentGroupRunner, RolloutSpec, start_workers
from codefleet.fleet.staleness import Ticket
from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.sandbox import SandboxConfig
from codefleet.tasks.generate import generate_tasks


@pytest.fixture(scope="module")
def setup(ray_session, tmp_path_factory, state_dir):
    root = tmp_path_factory.mktemp("rollouts")
    torch.manual_seed(0)
    model = Transformer(ModelConfig.tiny(vocab_size=default_tokenizer().vocab_size, max_seq_len=3072))
    checkpoint.save(model, str(root / "ckpt"))
    tasks = generate_tasks(str(root / "tasks"), n=1, seed=0, families=["config"], difficulty=1)
    return str(root / "ckpt"), tasks[0], state_dir


def _spec(ckpt, state_dir, prompt="full"):
    return RolloutSpec(
        checkpoint=ckpt,
        sandbox=SandboxConfig(state_dir=state_dir, timeout_s=30),
        max_tokens=8,
        episode=EpisodeConfig(prompt=prompt),
    )


def test_rollout_workers_get_no_arguments_in_the_object_store(setup, capfd):
    """A restarted actor is created again from its first arguments; an argument in the object store (an actor
    handle puts it there) may be gone by then (ray-project/ray#53727), and Ray warns about it when the actor is
    created. Rollout workers get the engines' names instead. Ray warns once per process: this test comes first."""
    ckpt, _, state_dir = setup
    engines = start_engines(ckpt, 1, num_cpus=0, max_batch=2)
    workers = start_workers(_spec(ckpt, state_dir), engines, 1, slots_per_worker=1, num_cpus=0)
    assert "constructor arguments in the object store" not in capfd.readouterr().err
    for actor in (*workers, *engines):
        ray.kill(actor, no_restart=True)


def test_an_attempt_runs_the_harness_and_returns_exact_tokens(setup):
    ckpt, task, state_dir = setup
    engines = start_engines(ckpt, 1, num_cpus=0, max_batch=4)
    workers = start_workers(_spec(ckpt, state_dir), engines, 1, slots_per_worker=2, num_cpus=0)
    runner = AgentGroupRunner(workers)
    ticket = Ticket(group_id=7, policy_version=0, deadline=1, group_size=2)
    results = ray.get(runner.start(ticket, task, [0, 1]), timeout=240)
    assert all(isinstance(r, AttemptResult) and r.rollout is not None for r in results)
    assert sorted(r.rollout.rollout_id for r in results) == ["7/0", "7/1"]
    for r in results:
        t = r.rollout.trajectory
        s = t.sequence
        assert t.task_id == task.id and t.checks is not None and t.checks.total >= 1
        assert len(s.ids) == len(s.loss_mask) == len(s.logprobs) == len(s.versions) > 8
        assert 1 <= sum(s.loss_mask) <= 8 * t.n_turns + t.n_turns  # sampled (+ an <|end|> per cut turn)
        assert s.routed_experts is not None and len(s.routed_experts) == len(s.ids)
        assert r.rollout.policy_version == 0 and r.rollout.reward == t.reward
        assert t.messages[0]["role"] == "system"  # the spec's prompt style: "full"

    weights = {k: v + 0.01 for k, v in checkpoint.load(ckpt).state_dict().items()}
    broadcast_weights(engines, ray.put(weights), 3)
    assert ray.get(engines[0].info.remote())["version"] == 3
    results = ray.get(runner.start(Ticket(8, 3, 4, 1), task, [0]), timeout=240)
    sequence = results[0].rollout.trajectory.sequence
    assert {v for v, m in zip(sequence.versions, sequence.loss_mask, strict=True) if m} == {3}
    assert results[0].rollout.policy_version == 3

    ray.kill(engines[0], no_restart=True)  # an engine that dies is an infrastructure failure, not a reward of 0
    with pytest.raises(ray.exceptions.RayTaskError, match="InfraError"):
        ray.get(runner.start(Ticket(9, 3, 4, 1), task, [0])[0], timeout=240)
    for w in workers:
        ray.kill(w, no_restart=True)


def test_attempts_show_the_policy_the_prompt_style_it_was_trained_on(setup):
    ckpt, task, state_dir = setup
    engines = start_engines(ckpt, 1, num_cpus=0, max_batch=2)
    workers = start_workers(_spec(ckpt, state_dir, prompt="bare"), engines, 1, slots_per_worker=1, num_cpus=0)
    (result,) = ray.get(AgentGroupRunner(workers).start(Ticket(3, 0, 1, 1), task, [0]), timeout=240)
    trajectory = result.rollout.trajectory
    assert trajectory.messages[0]["role"] == "user" and task.instruction in trajectory.messages[0]["content"]
    assert not any(m["role"] == "system" for m in trajectory.messages)
    for actor in (*workers, *engines):
        ray.kill(actor, no_restart=True)


def test_an_engine_that_fails_a_request_is_an_infrastructure_error_and_keeps_serving(setup):
    """A request the engine fails (its step raised) is the engine's failure, not the agent's: the attempt
    becomes an InfraError (retried, never scored) through EngineFailedError, like a dead engine's."""
    from codefleet.fleet.inference import EngineFailedError, RemoteEngine
    from codefleet.inference.sampling import SamplingParams

    ckpt, _, _ = setup
    engine = start_engines(ckpt, 1, num_cpus=0, max_batch=2)[0]
    remote = RemoteEngine(engine, default_tokenizer(), 3072)
    with pytest.raises(EngineFailedError, match="the engine failed the request"):
        remote.submit([10**9, 5], SamplingParams(max_tokens=2)).result(timeout=120)  # a token id past the vocab
    assert len(remote.submit([5, 6, 7], SamplingParams(max_tokens=2)).result(timeout=120).token_ids) == 2
    ray.kill(engine, no_restart=True)


def _crash_and_restart(engine, timeout_s=120.0) -> dict:
    """Kill the engine's process (Ray restarts it) and wait until its new process answers; its info()."""
    import time

    pid = ray.get(engine.info.remote())["pid"]
    ray.kill(engine, no_restart=False)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            info = ray.get(engine.info.remote(), timeout=timeout_s)
            if info["pid"] != pid:
                return info
        except ray.exceptions.RayActorError:  # restarting
            pass
        assert time.monotonic() < deadline, "the engine did not restart"
        time.sleep(0.3)


@pytest.mark.slow
def test_an_engine_that_restarts_serves_the_newest_committed_weights_not_its_first(setup, tmp_path):
    """An engine process that dies is restarted by Ray with its first arguments: it must come back with the
    newest committed weights and their version (else every attempt it serves reports an old version), a weight
    broadcast must wait for it, and an attempt it served on older weights than its group's is an infrastructure
    failure, never a rollout."""
    ckpt, task, state_dir = setup
    latest = tmp_path / "checkpoints" / "LATEST"
    engines = start_engines(ckpt, 1, num_cpus=0, max_batch=2, restart_from=str(latest))
    model = checkpoint.load(ckpt)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    checkpoint.save(model, str(tmp_path / "checkpoints" / "rl-step-000003"), metadata={"policy_version": 3})
    latest.write_text("rl-step-000003")  # committed, then published
    weights = ray.put(model.state_dict())
    broadcast_weights(engines, weights, 3)

    ray.kill(engines[0], no_restart=False)  # the process dies mid-run; Ray restarts it
    broadcast_weights(engines, weights, 3)  # waits for the restarted engine instead of failing the step
    assert ray.get(engines[0].info.remote())["version"] == 3
    assert _crash_and_restart(engines[0])["version"] == 3  # from LATEST, not the checkpoint it was started with

    workers = start_workers(_spec(ckpt, state_dir), engines, 1, slots_per_worker=1, num_cpus=0)
    (result,) = ray.get(AgentGroupRunner(workers).start(Ticket(5, 3, 4, 1), task, [0]), timeout=240)
    assert result.rollout.policy_version == 3

    stale = start_engines(ckpt, 1, num_cpus=0, max_batch=2)  # no restart_from: comes back at version 0
    broadcast_weights(stale, weights, 3)
    assert _crash_and_restart(stale[0])["version"] == 0
    old = start_workers(_spec(ckpt, state_dir), stale, 1, slots_per_worker=1, num_cpus=0)
    with pytest.raises(ray.exceptions.RayTaskError, match="InfraError.*older than the group's 3"):
        ray.get(AgentGroupRunner(old).start(Ticket(6, 3, 4, 1), task, [0])[0], timeout=240)
    for actor in (*workers, *old, *engines, *stale):
        ray.kill(actor, no_restart=True)


def test_an_engine_dead_for_good_gets_no_more_episodes_and_leaves_the_weight_broadcast(setup):
    """Killed with no restart, an engine gets no episode: the worker finds it dead for good before an episode
    would start on it and routes every episode to the engines left; a weight broadcast leaves it out."""
    ckpt, task, state_dir = setup
    engines = start_engines(ckpt, 2, num_cpus=0, max_batch=2)
    workers = start_workers(_spec(ckpt, state_dir), engines, 1, slots_per_worker=1, num_cpus=0)
    runner = AgentGroupRunner(workers)
    ray.kill(engines[0], no_restart=True)
    for group_id in (10, 12):  # 10 * 1 + 0 -> engine 0 of 2, and a later group that would have gone there too
        (result,) = ray.get(runner.start(Ticket(group_id, 0, 1, 1), task, [0]), timeout=240)
        assert result.rollout is not None
    weights = {k: v + 0.01 for k, v in checkpoint.load(ckpt).state_dict().items()}
    assert broadcast_weights(engines, ray.put(weights), 1) == ([engines[1]], {})
    assert ray.get(engines[1].info.remote())["version"] == 1
    ray.kill(engines[1], no_restart=True)
    with pytest.raises(Exception, match="no engine took policy version 2: of 2, 0 are restarting"):
        broadcast_weights(engines, ray.put(weights), 2)
    for w in workers:
        ray.kill(w, no_restart=True)


def test_a_task_whose_set_up_fails_is_broken_not_an_infrastructure_failure(setup):
    """A set-up command that fails (twice, in fresh sandboxes) makes every attempt of the group resolve to a
    task error, which the controller drops without retrying; the worker then runs other tasks as before."""
    import dataclasses

    ckpt, task, state_dir = setup
    broken = dataclasses.replace(task, id="config-broken", setup_commands=["echo 'no such package: foo' >&2; exit 3"])
    engines = start_engines(ckpt, 1, num_cpus=0, max_batch=2)
    workers = start_workers(_spec(ckpt, state_dir), engines, 1, slots_per_worker=2, num_cpus=0)
    runner = AgentGroupRunner(workers)
    results = ray.get(runner.start(Ticket(20, 0, 1, 2), broken, [0, 1]), timeout=240)
    for r in results:
        assert r.rollout is None and not r.infra_error
        assert "the set-up of config-broken failed twice" in r.task_error and "no such package: foo" in r.task_error
    (result,) = ray.get(runner.start(Ticket(21, 0, 1, 1), task, [0]), timeout=240)
    assert result.rollout is not None
    for actor in (*workers, *engines):
        ray.kill(actor, no_restart=True)


def test_an_engine_that_never_comes_back_is_routed_around_and_the_broadcast_goes_on_without_it(setup):
    """An engine Ray cannot place (its node is gone and no other has room) takes calls that never return. A worker
    finds that out before an episode starts on it and sends the episode elsewhere; a weight broadcast waits for
    it up to its limit once, then only briefly, and the engines that took the weights go on serving."""
    import time

    from codefleet.fleet.inference import EngineActor

    ckpt, task, state_dir = setup
    up = start_engines(ckpt, 1, num_cpus=0, max_batch=2)[0]
    nowhere = EngineActor.options(num_cpus=0, resources={"no-such-node": 1}, name="engine-nowhere").remote(ckpt)
    engines = [nowhere, up]
    workers = start_workers(_spec(ckpt, state_dir), engines, 1, slots_per_worker=1, num_cpus=0)
    (result,) = ray.get(AgentGroupRunner(workers).start(Ticket(0, 0, 1, 1), task, [0]), timeout=240)  # -> engine 0
    assert result.rollout is not None and result.rollout.trajectory.n_turns >= 1

    weights = ray.put({k: v + 0.01 for k, v in checkpoint.load(ckpt).state_dict().items()})
    serving, away = broadcast_weights(engines, weights, 1, timeout_s=2.0)
    assert serving == [up] and list(away) == [nowhere]
    t0 = time.monotonic()
    serving, away = broadcast_weights(engines, weights, 2, timeout_s=60.0, away=away)  # not waited for again
    assert serving == [up] and list(away) == [nowhere] and time.monotonic() - t0 < 30
    assert ray.get(up.info.remote())["version"] == 2
    for actor in (*workers, *engines):
        ray.kill(actor, no_restart=True)


def test_a_retry_goes_to_another_worker_when_one_never_answers(setup):
    """A rollout worker Ray cannot place (its node is gone, no room elsewhere) takes attempts that never start.
    The controller times such an attempt out; its retry goes to the next worker and the group completes."""
    from codefleet.fleet.controller import Controller, ControllerConfig
    from codefleet.fleet.inference import actor_names
    from codefleet.fleet.rollouts import RolloutWorker

    ckpt, task, state_dir = setup
    engines = start_engines(ckpt, 1, num_cpus=0, max_batch=2)
    live = start_workers(_spec(ckpt, state_dir), engines, 1, slots_per_worker=2, num_cpus=0)[0]
    nowhere = RolloutWorker.options(num_cpus=0, resources={"no-such-node": 1}).remote(
        _spec(ckpt, state_dir), actor_names(engines)
    )

    class Recorder:  # the trainer: the edge of this test
        batches = []

        def train(self, batch):
            self.batches.append(batch)
            return {}

    controller = Controller(
        ControllerConfig(
            eta=0, rollout_slots=2, batch_groups=1, group_size=2, rollout_timeout_s=20.0, max_infra_retries=1
        ),
        AgentGroupRunner([nowhere, live]),
        Recorder(),
        iter([task] * 4),
    )
    report = controller.run(1)  # group 0: attempt 0 -> the worker that never answers, attempt 1 -> the live one
    assert report.steps == 1 and report.infra_failures == 1 and "timed out" in report.last_infra_error
    (group,) = Recorder.batches[0].groups
    assert sorted(r.rollout_id for r in group.rollouts) == ["0/0", "0/1"] and report.abandoned_groups == 0
    for actor in (live, nowhere, *engines):
        ray.kill(actor, no_restart=True)


def test_a_rollout_worker_that_restarts_finds_its_engines_again_by_name(setup):
    """A rollout worker is restarted by Ray with the arguments it was created with, which name the engines. The
    restarted worker looks them up again and runs attempts; one whose engine is gone for good by then fails them
    as infrastructure, saying so."""
    import time

    ckpt, task, state_dir = setup
    engines = start_engines(ckpt, 1, num_cpus=0, max_batch=2)
    (worker,) = start_workers(_spec(ckpt, state_dir), engines, 1, slots_per_worker=1, num_cpus=0)

    def restart(worker) -> None:
        pid = ray.get(worker.pid.remote())
        ray.kill(worker, no_restart=False)
        deadline = time.monotonic() + 120
        while True:
            try:
                if ray.get(worker.pid.remote(), timeout=60) != pid:
                    return
            except ray.exceptions.RayActorError:  # restarting
                pass
            assert time.monotonic() < deadline, "the rollout worker did not restart"
            time.sleep(0.3)

    restart(worker)
    (result,) = ray.get(AgentGroupRunner([worker]).start(Ticket(30, 0, 1, 1), task, [0]), timeout=240)
    assert result.rollout is not None and result.rollout.trajectory.n_turns >= 1

    ray.kill(engines[0], no_restart=True)
    restart(worker)
    with pytest.raises(ray.exceptions.RayTaskError, match="all 1 engines are dead for good"):
        ray.get(AgentGroupRunner([worker]).start(Ticket(31, 0, 1, 1), task, [0])[0], timeout=240)
    ray.kill(worker, no_restart=True)
