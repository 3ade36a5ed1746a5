"""The asynchronous controller's pure core: admission under the staleness bound, group assembly,
dynamic sampling and the buffer, driven by a discrete-event simulation with random rollout durations."""

import heapq
import itertools
import random
import threading

import pytest

from codefleet.fleet.staleness import AdmissionController, Group, GroupAssembler, Rollout, RolloutBuffer


def make(eta, slots=16, batch_groups=2, group_size=4, drop=False):
    adm = AdmissionController(eta, slots, batch_groups, group_size)
    buf = RolloutBuffer(adm)
    return adm, buf, GroupAssembler(buf, drop_zero_variance=drop)


def simulate(
    eta,
    steps=30,
    seed=0,
    slots=16,
    batch_groups=2,
    group_size=4,
    infra_p=0.0,
    drop=False,
    step_s=0.5,
    reward=None,
    state_at=None,
):
    """Discrete-event run: attempts take lognormal times, some fail by infrastructure and are retried,
    the trainer takes a batch whenever it is idle and one is ready. Returns a record of what happened."""
    rng = random.Random(seed)
    adm, buf, asm = make(eta, slots, batch_groups, group_size, drop)
    rec = {"batches": [], "admit_versions": [], "streamed_at": {}, "infra": 0, "accepted_ids": set(), "states": []}
    asm.on_group = lambda g, dropped: rec["streamed_at"].__setitem__(g.group_id, now)
    events, seq = [], itertools.count()
    now, version, trainer_busy, retries = 0.0, 0, False, []
    reward = reward or (lambda: float(rng.random() < 0.5))

    def start(ticket, attempt):
        fail = rng.random() < infra_p
        heapq.heappush(
            events, (now + rng.lognormvariate(0, 1.0), next(seq), "attempt", (ticket, attempt, version, fail))
        )

    def fill():
        while retries and adm.try_retry(retries[0][0]):
            start(*retries.pop(0))
        while (t := adm.try_admit(version)) is not None:
            rec["admit_versions"].append((version, len(rec["batches"]), t.group_id))
            for a in range(group_size):
                start(t, a)

    def train():
        nonlocal trainer_busy
        if not trainer_busy and (b := buf.take_batch(batch_groups, version, timeout_s=0)) is not None:
            rec["batches"].append(b)
            trainer_busy = True
            heapq.heappush(events, (now + step_s, next(seq), "step", None))

    fill()
    while version < steps:
        now, _, kind, data = heapq.heappop(events)
        if kind == "step":
            version += 1
            trainer_busy = False
            if state_at == version:
                rec["states"].append((buf.state_dict(), set(rec["accepted_ids"]), set(rec["streamed_at"])))
        else:
            ticket, attempt, started, fail = data
            adm.release(ticket, accepted=not fail)
            if fail:
                rec["infra"] += 1
                retries.append((ticket, attempt))
            else:
                rid = f"{ticket.group_id}/{attempt}"
                rec["accepted_ids"].add(rid)
                asm.add(ticket, Rollout(rid, ticket.group_id, started, reward()))
        train()
        fill()
    rec["metrics"] = buf.metrics()
    rec["buf"], rec["adm"] = buf, adm
    return rec


def test_eta_zero_is_synchronous():
    rec = simulate(eta=0, steps=10, slots=64)
    # exactly one batch of groups is admitted at each version, and only after the previous step
    per_version = {}
    for v, batches_taken, _ in rec["admit_versions"]:
        per_version[v] = per_version.get(v, 0) + 1
        assert batches_taken == v  # nothing admitted for version v+1 before step v ended
    assert all(n == 2 for n in per_version.values()), per_version
    assert all(lag == 0 for b in rec["batches"] for lag in b.lags)


@pytest.mark.parametrize("eta", [1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_lag_never_exceeds_eta_with_random_durations(eta, seed):
    rec = simulate(eta=eta, steps=40, seed=seed, slots=24, infra_p=0.1, step_s=0.3)
    lags = [lag for b in rec["batches"] for lag in b.lags]
    assert len(lags) >= 40 * 2 * 4
    assert max(lags) <= eta
    assert rec["metrics"]["version_lag_max"] <= eta


def test_async_actually_overlaps_and_is_stale():
    # the bound must not be met by accident of being synchronous: with eta=2 some rollouts are trained stale
    rec = simulate(eta=2, steps=40, seed=1, slots=24)
    assert max(lag for b in rec["batches"] for lag in b.lags) >= 1


def test_out_of_order_slow_group_is_waited_for_not_overtaken():
    # eta=2, one group per batch: the slow group admitted at version 0 must be trained by step 2
    adm, buf, asm = make(eta=2, slots=100, batch_groups=1, group_size=1)
    t0, t1, t2 = (adm.try_admit(0) for _ in range(3))
    assert adm.try_admit(0) is None  # 3 groups with deadline 2 fill steps 0..2
    for t in (t1,):
        asm.add(t, Rollout(f"{t.group_id}", t.group_id, 0, 1.0))
    assert buf.take_batch(1, 0, timeout_s=0).groups[0].group_id == t1.group_id
    t3 = adm.try_admit(1)  # deadline 3
    assert t3 is not None and adm.try_admit(1) is None
    asm.add(t3, Rollout("3", t3.group_id, 1, 1.0))
    # step 1 may not take t3: t0 and t2 (deadline 2) would then both be due at step 2
    assert buf.take_batch(1, 1, timeout_s=0) is None
    asm.add(t2, Rollout("2", t2.group_id, 0, 1.0))
    assert buf.take_batch(1, 1, timeout_s=0).groups[0].group_id == t2.group_id
    assert buf.take_batch(1, 2, timeout_s=0) is None  # t0 is due: wait for it even though t3 is ready
    asm.add(t0, Rollout("0", t0.group_id, 0, 1.0))
    assert buf.take_batch(1, 2, timeout_s=0).lags == [2]


def test_infrastructure_failures_are_retried_and_not_counted():
    rec = simulate(eta=1, steps=20, seed=3, infra_p=0.3)
    assert rec["infra"] > 0 and rec["metrics"]["infra_failures"] == rec["infra"]
    consumed = [r for b in rec["batches"] for r in b.rollouts]
    # every group trained is complete: G attempts, none of them an infrastructure failure
    assert all(len(g.rollouts) == 4 for b in rec["batches"] for g in b.groups)
    assert len(consumed) >= 20 * 2 * 4


def test_infra_release_returns_capacity():
    adm, _, _ = make(eta=0, slots=4, batch_groups=2, group_size=4)
    t = adm.try_admit(0)
    assert adm.try_admit(0) is None  # slots full
    adm.release(t, accepted=False)
    assert adm.in_flight == 3 and t.infra_failures == 1
    assert adm.try_retry(t) and not adm.try_retry(t)


def test_groups_stream_to_the_buffer_as_soon_as_complete():
    adm, buf, asm = make(eta=1, slots=16, batch_groups=2, group_size=2)
    a, b = adm.try_admit(0), adm.try_admit(0)
    assert asm.add(b, Rollout("b0", b.group_id, 0, 1.0)) is None
    assert asm.add(a, Rollout("a1", a.group_id, 0, 0.0)) is None
    assert asm.add(b, Rollout("b1", b.group_id, 0, 0.0)) is not None
    assert list(buf.ready) == [b.group_id]  # b is in the buffer while a is still running
    asm.add(a, Rollout("a0", a.group_id, 0, 1.0))
    assert {r.rollout_id for r in buf.take_batch(2, 0, timeout_s=0).rollouts} == {"a0", "a1", "b0", "b1"}


def test_dynamic_sampling_drops_zero_variance_groups():
    adm, buf, asm = make(eta=0, slots=16, batch_groups=1, group_size=2, drop=True)
    a = adm.try_admit(0)
    asm.add(a, Rollout("a0", a.group_id, 0, 1.0))
    asm.add(a, Rollout("a1", a.group_id, 0, 1.0))
    assert not buf.ready and buf.metrics()["dropped_zero_variance_groups"] == 1
    b = adm.try_admit(0)  # the dropped group freed its place in batch 0
    assert b is not None
    asm.add(b, Rollout("b0", b.group_id, 0, 1.0))
    asm.add(b, Rollout("b1", b.group_id, 0, 0.0))
    assert buf.take_batch(1, 0, timeout_s=0).groups[0].group_id == b.group_id
    rec = simulate(eta=1, steps=10, seed=2, drop=True, reward=lambda: 1.0 if random.random() < 0.8 else 0.0)
    assert rec["metrics"]["dropped_zero_variance_groups"] > 0
    assert all(len({r.reward for r in g.rollouts}) > 1 for b in rec["batches"] for g in b.groups)


def test_buffer_never_yields_a_rollout_twice():
    rec = simulate(eta=2, steps=30, seed=4, infra_p=0.1)
    ids = [r.rollout_id for b in rec["batches"] for r in b.rollouts]
    assert len(ids) == len(set(ids))
    buf = rec["buf"]
    g = rec["batches"][0].groups[0]
    assert buf.put(Group(g.ticket, g.rollouts)) is False  # redelivery of a consumed group is refused


def test_take_batch_times_out_and_wakes_from_another_thread():
    adm, buf, asm = make(eta=0, slots=8, batch_groups=1, group_size=2)
    t = adm.try_admit(0)
    assert buf.take_batch(1, 0, timeout_s=0.01) is None
    out = []
    th = threading.Thread(target=lambda: out.append(buf.take_batch(1, 0, timeout_s=5)))
    th.start()
    asm.add(t, Rollout("x0", t.group_id, 0, 0.0))
    asm.add(t, Rollout("x1", t.group_id, 0, 1.0))
    th.join(5)
    assert out and out[0].trainer_version == 0


def test_state_dict_round_trip_after_crash_loses_nothing_and_trains_nothing_twice():
    crash_at = 12
    rec = simulate(eta=2, steps=crash_at + 3, seed=5, state_at=crash_at, infra_p=0.1)
    ((state, accepted_at_ckpt, complete_at_ckpt),) = rec["states"]
    trained_before = {r.rollout_id for b in rec["batches"][:crash_at] for r in b.rollouts}
    assert set(state["consumed_ids"]) == trained_before
    # the crashed run kept going past the checkpoint; resume from the checkpoint in a fresh process
    adm, buf, asm = make(eta=2, slots=16)
    buf.load_state_dict(state)
    buffered = {r.rollout_id for _, rs in state["ready"] for r in rs}
    assert buffered and buffered.isdisjoint(trained_before)
    # every rollout of a group complete by checkpoint time is trained already or in the restored buffer;
    # groups still in flight then are regenerated after resume
    in_complete = {rid for rid in accepted_at_ckpt if int(rid.split("/")[0]) in complete_at_ckpt}
    assert in_complete and in_complete < accepted_at_ckpt
    assert in_complete == trained_before | buffered
    # a redelivered already-trained group is refused; the buffered ones are yielded once, then new work
    old = rec["batches"][0].groups[0]
    assert buf.put(Group(old.ticket, old.rollouts)) is False
    yielded = []
    v = crash_at
    while not buffered <= set(yielded) and v < crash_at + 10:
        while (t := adm.try_admit(v)) is not None:  # fresh groups fill in after the restored ones
            for a in range(4):
                adm.release(t, accepted=True)
                asm.add(t, Rollout(f"{t.group_id}/{a}", t.group_id, v, float(a % 2)))
        b = buf.take_batch(2, v, timeout_s=0)
        assert b is not None and max(b.lags) <= 2
        yielded += [r.rollout_id for r in b.rollouts]
        v += 1
    assert buffered <= set(yielded)
    assert min(int(r.split("/")[0]) for r in set(yielded) - buffered) > max(
        int(r.split("/")[0]) for r in accepted_at_ckpt
    )
    assert len(yielded) == len(set(yielded)) and set(yielded).isdisjoint(trained_before)


def test_threaded_workers_and_trainer_keep_the_bound():
    # real threads: 8 workers run attempts with sub-millisecond random sleeps, one trainer thread steps
    eta, steps, group_size = 1, 25, 2
    adm, buf, asm = make(eta, slots=8, batch_groups=2, group_size=group_size)
    version, done, batches, lock = [0], threading.Event(), [], threading.Lock()
    rng = random.Random(7)

    def worker():
        while not done.is_set():
            t = adm.try_admit(version[0])
            if t is None:
                with adm.cond:
                    adm.cond.wait(0.005)
                continue
            for a in range(group_size):
                started = version[0]
                with lock:
                    pause = rng.random() * 0.002
                threading.Event().wait(pause)
                adm.release(t, accepted=True)
                asm.add(t, Rollout(f"{t.group_id}/{a}", t.group_id, started, float(a % 2)))

    def trainer():
        for s in range(steps):
            b = buf.take_batch(2, s, timeout_s=5)
            assert b is not None
            batches.append(b)
            version[0] = s + 1
        done.set()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(8)]
    tr = threading.Thread(target=trainer)
    for th in [*threads, tr]:
        th.start()
    tr.join(10)
    done.set()
    assert len(batches) == steps
    ids = [r.rollout_id for b in batches for r in b.rollouts]
    assert len(ids) == len(set(ids)) == steps * 2 * group_size
    assert max(lag for b in batches for lag in b.lags) <= eta


def test_withdrawn_group_frees_its_slots_and_its_place_under_the_bound():
    adm, buf, asm = make(eta=0, slots=8, batch_groups=1, group_size=2)
    t = adm.try_admit(0)
    adm.release(t, accepted=True)
    asm.add(t, Rollout("w0", t.group_id, 0, 1.0))  # one attempt finished, the other keeps failing
    assert adm.try_admit(0) is None  # batch 0 is promised to t
    adm.withdraw(t, running=1, abandoned=True)
    asm.discard(t.group_id)
    assert adm.in_flight == 0 and buf.metrics()["abandoned_groups"] == 1
    u = adm.try_admit(0)
    assert u is not None
    asm.add(u, Rollout("u0", u.group_id, 0, 1.0))
    asm.add(u, Rollout("u1", u.group_id, 0, 0.0))
    assert [g.group_id for g in buf.take_batch(1, 0, timeout_s=0).groups] == [u.group_id]


def test_on_group_runs_before_the_group_is_in_the_buffer():
    adm, buf, asm = make(eta=0, slots=8, batch_groups=1, group_size=1)
    seen = []
    asm.on_group = lambda g, dropped: seen.append((g.group_id, g.group_id in buf.ready))
    t = adm.try_admit(0)
    asm.add(t, Rollout("o0", t.group_id, 0, 1.0))
    assert seen == [(t.group_id, False)] and t.group_id in buf.ready
