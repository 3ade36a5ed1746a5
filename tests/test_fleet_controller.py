"""The asynchronous controller on real Ray: attempts are async actor methods that sleep and return
scripted rewards (or fail, hang, or lose their actor); the trainer is an in-process client that
sleeps and records what it was given."""

from __future__ import annotations

import asyncio
import itertools
import random
import threading
import time

import pytest

from codefleet.fleet.controller import AttemptResult, Controller, ControllerConfig, ControllerError
from codefleet.fleet.staleness import Rollout


@pytest.fixture(scope="module")
def worker_cls(ray_session):
    ray = ray_session

    @ray.remote(num_cpus=0)
    class AttemptWorker:
        def __init__(self):
            self.cancelled = 0

        async def attempt(self, rollout_id, group_id, version, duration_s, reward, mode):
            try:
                await asyncio.sleep(duration_s)
                if mode == "hang":
                    await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            if mode == "raise":
                raise RuntimeError("the sandbox died")
            if mode == "infra":
                return AttemptResult(None, "engine unreachable")
            if mode == "broken":
                return AttemptResult(None, task_error="setup command 'make deps' failed (exit 2)")
            return AttemptResult(Rollout(rollout_id, group_id, version, reward))

        def cancelled_count(self):
            return self.cancelled

    return AttemptWorker


@pytest.fixture(scope="module")
def worker(worker_cls, ray_session):
    w = worker_cls.remote()
    ray_session.get(w.cancelled_count.remote())  # started
    yield w
    ray_session.kill(w)


class ScriptedRunner:
    """Starts attempts on the shared worker. `script(group_id, attempt, try_no) -> (duration_s, reward, mode)`;
    mode "kill" runs the attempt on a fresh actor that is killed while the attempt sleeps. Records the
    version each attempt actually started at."""

    def __init__(self, ray, worker, script):
        self.ray, self.worker, self.script = ray, worker, script
        self.controller: Controller | None = None
        self.tries: dict[tuple[int, int], int] = {}
        self.started: list[tuple[int, int, int]] = []  # (group_id, attempt, version)
        self.group_items: dict[int, object] = {}  # group_id -> item, in the order groups were started
        self.victims = []

    def start(self, ticket, item, attempts):
        version = self.controller.version
        self.group_items.setdefault(ticket.group_id, item)
        refs = []
        for a in attempts:
            key = (ticket.group_id, a)
            self.tries[key] = self.tries.get(key, 0) + 1
            duration_s, reward, mode = self.script(ticket.group_id, a, self.tries[key])
            self.started.append((ticket.group_id, a, version))
            actor = self.worker
            if mode == "kill":
                victim = self.victim_cls.remote()
                self.victims.append(victim)
                threading.Timer(duration_s / 2, self.ray.kill, [victim]).start()
                actor = victim
            refs.append(
                actor.attempt.remote(f"{ticket.group_id}/{a}", ticket.group_id, version, duration_s, reward, mode)
            )
        return refs


class SleepTrainer:
    def __init__(self, step_s=0.02, check=None, fail_at=None):
        self.step_s, self.check, self.fail_at = step_s, check, fail_at
        self.batches = []

    def train(self, batch):
        if batch.trainer_version == self.fail_at:
            raise ValueError("loss is NaN")
        if self.check:
            self.check(batch)
        self.batches.append(batch)
        time.sleep(self.step_s)
        return {"loss": 1.0}


def random_script(seed, lo=0.005, hi=0.06):
    rng = random.Random(seed)
    return lambda g, a, t: (rng.uniform(lo, hi), float(rng.random() < 0.5), "ok")


def build(ray, worker, script, trainer=None, victim_cls=None, **config):
    cfg = dict(eta=1, rollout_slots=8, batch_groups=2, group_size=2, rollout_timeout_s=30.0)
    cfg.update(config)
    runner = ScriptedRunner(ray, worker, script)
    runner.victim_cls = victim_cls
    trainer = trainer or SleepTrainer()
    ctrl = Controller(ControllerConfig(**cfg), runner, trainer, itertools.count())
    runner.controller = ctrl
    return ctrl, runner, trainer


def ids(batches):
    return [r.rollout_id for b in batches for r in b.rollouts]


@pytest.mark.parametrize("eta", [0, 1, 2])
def test_lag_is_bounded_and_nothing_is_trained_twice(ray_session, worker, eta):
    ctrl, runner, trainer = build(ray_session, worker, random_script(eta), eta=eta)
    report = ctrl.run(8)
    assert report.steps == 8 and ctrl.version == 8 and report.ended_by == "steps"
    lags = [lag for b in trainer.batches for lag in b.lags]
    assert len(lags) == 8 * 2 * 2 == report.trained_rollouts
    assert max(lags) <= eta and report.version_lag_max == max(lags)
    assert len(set(ids(trainer.batches))) == len(lags)
    started_at = {(g, a): v for g, a, v in runner.started}
    for b in trainer.batches:
        for r in b.rollouts:
            g, a = map(int, r.rollout_id.split("/"))
            assert r.policy_version == started_at[(g, a)]
            if eta == 0:  # synchronous: every rollout of step s started at version s
                assert started_at[(g, a)] == b.trainer_version
    if eta == 2:  # and the bound is not met by being synchronous
        assert max(lags) >= 1


def test_infrastructure_failures_are_retried_and_the_groups_complete(ray_session, worker, worker_cls):
    def script(g, a, t):
        mode = {(0, 1, 1): "raise", (1, 0, 1): "infra", (2, 1, 1): "kill"}.get((g, a, t), "ok")
        return (0.3 if mode == "kill" else 0.01), float(a), mode

    ctrl, runner, trainer = build(ray_session, worker, script, victim_cls=worker_cls, eta=0)
    report = ctrl.run(3)
    assert report.steps == 3 and report.infra_failures == 3 and report.abandoned_groups == 0
    assert "died" in report.last_infra_error.lower()  # the last failure was the killed actor
    trained = {g.group_id: g for b in trainer.batches for g in b.groups}
    assert {0, 1, 2} <= set(trained)
    for gid in (0, 1, 2):  # complete, with the retried attempt's rollout scored normally
        assert sorted(r.rollout_id for r in trained[gid].rollouts) == [f"{gid}/0", f"{gid}/1"]
    assert runner.tries[(0, 1)] == runner.tries[(1, 0)] == runner.tries[(2, 1)] == 2


def test_a_timed_out_attempt_is_cancelled_and_retried(ray_session, worker):
    script = lambda g, a, t: (0.01, float(a), "hang" if (g, a, t) == (0, 0, 1) else "ok")  # noqa: E731
    before = ray_session.get(worker.cancelled_count.remote())
    ctrl, runner, trainer = build(ray_session, worker, script, eta=1, rollout_timeout_s=0.5)
    t0 = time.monotonic()
    report = ctrl.run(2)
    assert time.monotonic() - t0 < 10
    assert report.infra_failures == 1 and "timed out" in report.last_infra_error
    assert runner.tries[(0, 0)] == 2 and 0 in {g.group_id for b in trainer.batches for g in b.groups}
    deadline = time.monotonic() + 5
    while ray_session.get(worker.cancelled_count.remote()) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray_session.get(worker.cancelled_count.remote()) > before  # the hanging coroutine was cancelled


def test_a_failed_attempt_is_retried_after_a_growing_back_off(ray_session, worker):
    """A restarting actor fails every call at once for a while: the retries of one attempt wait 0.4 s, then
    0.8 s, so they reach the actor once it is back instead of burning through max_infra_retries at once."""
    script = lambda g, a, t: (0.01, float(a), "infra" if (g, a) == (0, 0) and t <= 2 else "ok")  # noqa: E731
    ctrl, runner, trainer = build(ray_session, worker, script, eta=0, retry_backoff_s=0.4, retry_backoff_max_s=0.6)
    starts: list[float] = []
    start = runner.start
    runner.start = lambda ticket, item, attempts: (
        starts.extend(time.monotonic() for a in attempts if (ticket.group_id, a) == (0, 0)),
        start(ticket, item, attempts),
    )[1]
    report = ctrl.run(2)
    assert report.steps == 2 and report.infra_failures == 2 and report.abandoned_groups == 0
    assert runner.tries[(0, 0)] == 3
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert 0.4 <= gaps[0] < 2.0 and 0.6 <= gaps[1] < 2.0, gaps  # the second back-off doubled, capped at 0.6


def test_an_abandoned_group_does_not_deadlock_the_run(ray_session, worker):
    script = lambda g, a, t: (0.01, float(a), "raise" if (g, a) == (0, 0) else "ok")  # noqa: E731
    ctrl, runner, trainer = build(ray_session, worker, script, eta=0, max_infra_retries=2)
    report = ctrl.run(3)
    assert report.steps == 3 and report.abandoned_groups == 1
    assert report.infra_failures == 3 and runner.tries[(0, 0)] == 3
    assert 0 not in {g.group_id for b in trainer.batches for g in b.groups}
    assert ctrl.admission.in_flight == 0 and not ctrl.admission.unconsumed  # nothing leaked


def test_a_broken_item_drops_its_group_at_once_and_the_run_goes_on(ray_session, worker):
    """An item that cannot be attempted (a task whose set-up fails) is not retried as infrastructure and not
    trained on: its group is withdrawn, on_broken hears of the item, and the other groups fill the batches."""
    broken_items = {2, 5}
    items = itertools.count()
    ctrl, runner, trainer = build(ray_session, worker, lambda g, a, t: (0.01, float(a), "ok"), eta=1)
    runner.script = lambda g, a, t: (0.01, float(a), "broken" if runner.group_items[g] in broken_items else "ok")
    ctrl.items = items
    heard = []
    ctrl.on_broken = lambda item, why: heard.append((item, why))
    report = ctrl.run(4)
    assert report.steps == 4 and report.broken_groups == 2 and report.infra_failures == 0
    assert sorted(item for item, _ in heard) == [2, 5] and "make deps" in heard[0][1]
    assert "make deps" in report.last_task_error
    trained_items = {runner.group_items[g.group_id] for b in trainer.batches for g in b.groups}
    assert trained_items.isdisjoint(broken_items)
    broken_groups = [g for g, item in runner.group_items.items() if item in broken_items]
    assert all(runner.tries[(g, a)] == 1 for g in broken_groups for a in (0, 1) if (g, a) in runner.tries)


def test_when_every_item_is_broken_the_run_stops_saying_so(ray_session, worker):
    ctrl, runner, trainer = build(
        ray_session, worker, lambda g, a, t: (0.01, 0.0, "broken"), eta=1, max_abandoned_in_a_row=3
    )
    with pytest.raises(ControllerError, match="3 groups in a row were dropped because their item cannot be attempted"):
        ctrl.run(2)
    assert ctrl.version == 0 and ctrl.admission.in_flight == 0


def test_zero_variance_groups_are_dropped(ray_session, worker):
    script = lambda g, a, t: (0.01, 1.0 if g % 2 == 0 else float(a), "ok")  # noqa: E731
    seen = []
    ctrl, runner, trainer = build(ray_session, worker, script, eta=1, drop_zero_variance=True)
    ctrl.assembler.on_group = lambda g, dropped: seen.append((g.group_id, dropped))
    report = ctrl.run(3)
    assert report.dropped_groups >= 3
    assert all(dropped == (gid % 2 == 0) for gid, dropped in seen)
    assert all(g.group_id % 2 == 1 for b in trainer.batches for g in b.groups)


def test_on_group_is_called_before_the_trainer_sees_the_group(ray_session, worker):
    persisted = set()

    def on_group(group, dropped):
        time.sleep(0.005)  # a slow write: the trainer must still not see the group before it ends
        persisted.add(group.group_id)

    def check(batch):
        assert {g.group_id for g in batch.groups} <= persisted

    ctrl, runner, trainer = build(ray_session, worker, random_script(5), trainer=SleepTrainer(check=check), eta=2)
    ctrl.assembler.on_group = on_group
    assert ctrl.run(5).steps == 5


def test_a_failing_on_group_stops_the_run_with_its_error(ray_session, worker):
    ctrl, _, _ = build(ray_session, worker, random_script(6), eta=1)

    def on_group(group, dropped):
        raise OSError("disk full")

    ctrl.assembler.on_group = on_group
    with pytest.raises(RuntimeError, match="on_group failed .*disk full"):
        ctrl.run(3)
    assert ctrl.admission.in_flight == 0


def test_a_failing_trainer_step_stops_the_run_and_reraises(ray_session, worker):
    ctrl, _, _ = build(ray_session, worker, random_script(7), trainer=SleepTrainer(fail_at=2), eta=1)
    with pytest.raises(RuntimeError, match="trainer.train failed at step 2: ValueError") as err:
        ctrl.run(5)
    assert isinstance(err.value.__cause__, ValueError) and ctrl.version == 2


def test_resume_from_buffer_state_loses_nothing_and_trains_nothing_twice(ray_session, worker):
    # slow trainer, fast rollouts: at the checkpoint the buffer holds accepted groups not yet trained
    ctrl, runner, trainer = build(
        ray_session, worker, random_script(8, 0.002, 0.01), trainer=SleepTrainer(step_s=0.1), eta=2
    )
    accepted = []
    ctrl.assembler.on_group = lambda g, dropped: accepted.append(g.group_id)
    assert ctrl.run(3).steps == 3
    state = ctrl.buffer_state()
    buffered = {r.rollout_id for _, rollouts in state["ready"] for r in rollouts}
    assert buffered and state["next_batch"] == 3
    first = set(ids(trainer.batches))

    with pytest.raises(ValueError, match="start_version=2 but buffer_state was saved before step 3"):
        Controller(ctrl.config, runner, trainer, itertools.count(), start_version=2, buffer_state=state)
    trainer2 = SleepTrainer(step_s=0.001)
    ctrl2 = Controller(ctrl.config, runner, trainer2, itertools.count(), start_version=3, buffer_state=state)
    accepted2 = []
    ctrl2.assembler.on_group = lambda g, dropped: accepted2.append(g.group_id)
    runner.controller = ctrl2
    report = ctrl2.run(5)
    assert report.steps == 2 and ctrl2.version == 5 and [b.trainer_version for b in trainer2.batches] == [3, 4]
    second = ids(trainer2.batches)
    assert first.isdisjoint(second) and len(second) == len(set(second))
    # earliest deadline first (ties: older group): the restored groups go before any new one
    restored = sorted((t.deadline, t.group_id) for t, _ in state["ready"])
    trained_groups = [g.group_id for b in trainer2.batches for g in b.groups]
    assert trained_groups[: len(restored)] == [gid for _, gid in restored][: len(trained_groups)]
    assert report.version_lag_max <= 2
    new_groups = {int(r.split("/")[0]) for r in second} - {int(r.split("/")[0]) for r in buffered}
    assert all(g > max(accepted) for g in new_groups)  # group ids (hence rollout ids) are not reused

    # the same controller continues with a second run(); the items of the groups it interrupted go first
    assert ctrl2.run(5).steps == 0
    interrupted = [
        item for gid, item in runner.group_items.items() if gid >= state["next_group_id"] and gid not in set(accepted2)
    ]
    assert interrupted  # the trainer is fast: groups were in flight when run(5) ended
    n_before = len(runner.group_items)
    assert ctrl2.run(7).steps == 2
    assert list(runner.group_items.values())[n_before : n_before + len(interrupted)] == interrupted
    third = ids(trainer2.batches)
    assert len(third) == len(set(third)) and first.isdisjoint(third)
    assert buffered <= set(third)  # every restored group was due by step 5: nothing lost


def test_stop_from_another_thread_ends_the_run_promptly(ray_session, worker):
    ctrl, runner, trainer = build(ray_session, worker, random_script(9, 0.05, 0.2), eta=1)
    threading.Timer(0.5, ctrl.stop).start()
    t0 = time.monotonic()
    report = ctrl.run(10_000)
    assert time.monotonic() - t0 < 2.0
    assert report.ended_by == "stop" and 0 < report.steps < 10_000
    assert ctrl.admission.in_flight == 0 and ctrl.run(20_000).steps == 0  # stop() is final


def test_the_run_ends_when_the_items_run_out(ray_session, worker):
    ctrl, runner, trainer = build(ray_session, worker, random_script(10), eta=1)
    ctrl.items = iter(range(5))  # two full batches of 2 groups, one group left over
    report = ctrl.run(100)
    assert report.ended_by == "no_more_items" and report.steps == 2
    assert len(ctrl.buffer_state()["ready"]) == 1


def test_on_step_reports_every_step(ray_session, worker):
    ctrl, runner, trainer = build(ray_session, worker, random_script(11), trainer=SleepTrainer(step_s=0.03), eta=1)
    reports = []
    ctrl.on_step = reports.append
    run = ctrl.run(4)
    assert [(r.step, r.version) for r in reports] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for r in reports:
        assert r.metrics == {"loss": 1.0} and r.train_s >= 0.03 and r.waiting_s >= 0
        assert abs(r.wall_s - (r.waiting_s + r.train_s)) < 1e-6 and 0 <= r.batch_lag_max <= 1
        assert 0 < r.trainer_busy_fraction <= 1 and r.rollouts_per_s > 0
        assert r.buffer["consumed_rollouts"] == (r.step + 1) * 4
    assert run.trainer_busy_s >= 4 * 0.03
    # busy fraction = time in train() / time since the first batch arrived
    since_first = sum(r.wall_s for r in reports) - reports[0].waiting_s
    assert abs(run.trainer_busy_fraction - run.trainer_busy_s / since_first) < 0.02

    ctrl2, _, _ = build(ray_session, worker, random_script(12), eta=1)

    def bad(report):
        raise KeyError("no such metric")

    ctrl2.on_step = bad
    with pytest.raises(RuntimeError, match="on_step failed after step 0: KeyError"):
        ctrl2.run(3)
