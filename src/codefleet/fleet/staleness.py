"""The pure core of the asynchronous controller: admission under a staleness bound,
group assembly with dynamic sampling, and the trainer's rollout buffer. No Ray here;
the Ray controller wraps these objects.

Units. The trainer consumes `batch_groups` groups per step; a group is G attempts at
one task. Admission is per group (all G attempts of a group start from the same fork),
capacity (`max_in_flight`) is per rollout slot.

The admission rule (earliest-deadline feasibility). A group admitted while the engine
serves policy version p gets the deadline d = p + η: it must be trained by step d.
Let t be the index of the next batch the trainer will take, and U(≤j) the number of
admitted groups not yet consumed or dropped (in flight or buffered) with deadline ≤ j.
A group is admitted only if

    d ≥ t   and   U(≤j) + 1 ≤ (j − t + 1) · batch_groups   for every j ≥ d.

For j = p + η and t = trained version this is AReaL's rule `admitted ≤ (v + η + 1) · B`
(admitted = consumed + unconsumed, consumed = t · B); the check over every j also
covers groups admitted earlier at older versions.

Why lag ≤ η for every accepted rollout. The cumulative AReaL count alone does not
guarantee it when rollouts finish out of order: with η = 2 and one group per batch, a
slow group admitted at version 0 can be overtaken by groups admitted at versions 1
and 2 and would be trained at step 3 (lag 3). So the buffer takes batches earliest
deadline first and *waits* rather than break the invariant: `take_batch` for step s
picks the B completed groups with the smallest deadlines, and yields them only if,
after removing them, U(≤j) ≤ (j − s) · B for every j ≥ s (in particular every group
with deadline ≤ s is in batch s). EDF over the completed groups maximizes the number
picked with deadline ≤ j for every j at once, so if it fails no other choice succeeds;
and once everything due has finished it succeeds, because admission kept
U(≤j) ≤ (j − s + 1) · B. Hence every group is trained at step s ≤ d = p + η, i.e.
lag = s − p ≤ η. A retried attempt starts at a version ≥ p, so its lag is smaller.
η = 0 is synchronous: at version v exactly B groups get deadline v, the trainer waits
for all of them, and nothing else is admitted until the engine has version v + 1.

Resume: `RolloutBuffer.state_dict()` holds the accepted-but-unconsumed groups and the
consumed rollout ids; save it with the trainer checkpoint. In-flight groups are not in
it (they are regenerated), and `put` ignores a group whose ids were already consumed.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from codefleet.types import Trajectory


@dataclass
class Ticket:
    """One admitted group: its id, the version it started with and its deadline step."""

    group_id: int
    policy_version: int
    deadline: int
    group_size: int
    infra_failures: int = 0


@dataclass
class Rollout:
    """One finished attempt. `rollout_id` is unique across the run (e.g. f"{group_id}/{attempt}")."""

    rollout_id: str
    group_id: int
    policy_version: int
    reward: float
    trajectory: Trajectory | None = None  # the scored episode; the controller never looks inside


@dataclass
class Group:
    ticket: Ticket
    rollouts: list[Rollout]

    @property
    def group_id(self) -> int:
        return self.ticket.group_id


@dataclass
class Batch:
    trainer_version: int
    groups: list[Group]
    lags: list[int] = field(default_factory=list)  # one per rollout
    # the buffer's `state_dict` as of the call, to save with this step's checkpoint: this batch is consumed in it
    buffer_state: Callable[[], dict] | None = field(default=None, repr=False, compare=False)

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]


def _percentile(values: list[int], q: float) -> float:
    if not values:
        return 0.0
    xs = sorted(values)
    return float(xs[min(len(xs) - 1, round(q / 100 * (len(xs) - 1)))])


def _percentile_of_counts(counts: Counter[int], q: float) -> float:
    """`_percentile` of the list that holds each value `counts[value]` times, in O(distinct values)."""
    n = sum(counts.values())
    if not n:
        return 0.0
    k = min(n - 1, round(q / 100 * (n - 1)))
    for value in sorted(counts):
        k -= counts[value]
        if k < 0:
            return float(value)
    raise AssertionError("unreachable: k < n")


class AdmissionController:
    """Decides whether a group may start (see the module docstring for the rule). Thread-safe."""

    def __init__(self, eta: int, max_in_flight: int, batch_groups: int, group_size: int):
        if eta < 0 or batch_groups < 1 or group_size < 1:
            raise ValueError("need eta >= 0, batch_groups >= 1 and group_size >= 1")
        if max_in_flight < group_size:
            raise ValueError(f"max_in_flight={max_in_flight} cannot hold one group of {group_size} attempts; raise it")
        self.eta, self.max_in_flight = eta, max_in_flight
        self.batch_groups, self.group_size = batch_groups, group_size
        lock = threading.RLock()
        self.cond = threading.Condition(lock)
        # the same lock; notified only when a batch may have become possible (a group buffered, retired or
        # taken), not on every attempt's release, so a trainer waiting in take_batch is not woken per attempt
        self.batch_cond = threading.Condition(lock)
        self.next_batch = 0  # t: index of the next batch the trainer takes
        self.in_flight = 0  # rollout slots in use
        self.unconsumed: Counter[int] = Counter()  # deadline -> groups admitted, not consumed/dropped
        self.admitted_groups = 0
        self.infra_failures = 0
        self.abandoned_groups = 0
        self.next_group_id = 0  # never reused, also across resume: rollout ids derive from it

    def _feasible_with(self, deadline: int) -> bool:
        if deadline < self.next_batch:
            return False
        last = max([deadline, *self.unconsumed])
        below = sum(n for d, n in self.unconsumed.items() if d < deadline)
        for j in range(deadline, last + 1):
            below += self.unconsumed.get(j, 0)
            if below + 1 > (j - self.next_batch + 1) * self.batch_groups:
                return False
        return True

    def try_admit(self, policy_version: int) -> Ticket | None:
        """A ticket for a new group of `group_size` attempts started at `policy_version`, or None."""
        with self.cond:
            if self.in_flight + self.group_size > self.max_in_flight:
                return None
            deadline = policy_version + self.eta
            if not self._feasible_with(deadline):
                return None
            self.in_flight += self.group_size
            self.unconsumed[deadline] += 1
            self.admitted_groups += 1
            self.next_group_id += 1
            return Ticket(self.next_group_id - 1, policy_version, deadline, self.group_size)

    def release(self, ticket: Ticket, accepted: bool) -> None:
        """One attempt of `ticket` ended: `accepted` if it finished (whatever its reward), False if the
        infrastructure failed it. Either way its slot returns; a failed attempt must be retried with
        `try_retry` and is not the agent's failure."""
        with self.cond:
            self.in_flight -= 1
            if not accepted:
                ticket.infra_failures += 1
                self.infra_failures += 1
            self.cond.notify_all()

    def try_retry(self, ticket: Ticket) -> bool:
        """Take a slot to rerun an attempt that failed by infrastructure. The group is already counted
        against the staleness bound, and a retry starts at a version ≥ the group's, so only capacity matters."""
        with self.cond:
            if self.in_flight + 1 > self.max_in_flight:
                return False
            self.in_flight += 1
            return True

    def withdraw(self, ticket: Ticket, running: int, abandoned: bool = False) -> None:
        """Take back a group that will never reach the buffer: abandoned after repeated infrastructure
        failures (`abandoned`, counted), interrupted at the end of a run, or admitted when no work was
        left. Its `running` attempts' slots return and its place under the staleness bound is freed,
        so the trainer never waits for it."""
        with self.cond:
            self.in_flight -= running
            self._retire(ticket)
            if abandoned:
                self.abandoned_groups += 1
            self.cond.notify_all()

    # called by the buffer, under self.cond
    def _retire(self, ticket: Ticket) -> None:
        self.unconsumed[ticket.deadline] -= 1
        if not self.unconsumed[ticket.deadline]:
            del self.unconsumed[ticket.deadline]
        self.batch_cond.notify_all()


class RolloutBuffer:
    """Completed groups waiting for the trainer. Yields each rollout at most once, earliest deadline first."""

    def __init__(self, admission: AdmissionController):
        self.admission = admission
        self.cond = admission.cond
        self.ready: dict[int, Group] = {}
        self._ready_deadlines: Counter[int] = Counter()  # deadline -> groups in self.ready
        self.consumed_ids: set[str] = set()
        self.lags: list[int] = []
        self._lag_counts: Counter[int] = Counter()  # the same lags as a histogram, for percentiles per step
        self.dropped_zero_variance = 0

    def put(self, group: Group) -> bool:
        """Add a completed group. Returns False (and ignores it) if any of its rollouts was already consumed."""
        with self.cond:
            if any(r.rollout_id in self.consumed_ids for r in group.rollouts) or group.group_id in self.ready:
                return False
            self.ready[group.group_id] = group
            self._ready_deadlines[group.ticket.deadline] += 1
            self.cond.notify_all()
            self.admission.batch_cond.notify_all()
            return True

    def drop(self, group: Group) -> None:
        """Discard a completed group (dynamic sampling); it frees its place under the staleness bound."""
        with self.cond:
            self.admission._retire(group.ticket)
            self.dropped_zero_variance += 1
            self.cond.notify_all()

    def _pick(self, s: int) -> list[Group] | None:
        """The B ready groups with the smallest (deadline, group id), if taking them keeps the bound.

        The check needs only how many of them have each deadline, which the per-deadline counts of the
        ready groups give in O(distinct deadlines); the groups themselves are picked only once the check
        passes (once per step, O(ready · log B)). A trainer waiting for a straggler group is re-checked on
        every group that finishes, so a full sort of the ready groups here would cost O(ready) per group."""
        B, adm = self.admission.batch_groups, self.admission
        if len(self.ready) < B:
            return None
        left = Counter(adm.unconsumed)
        need = B
        for d in sorted(self._ready_deadlines):
            n = min(need, self._ready_deadlines[d])
            left[d] -= n
            need -= n
            if not need:
                break
        below = 0
        for j in range(min([s, *left]), max([s, *left]) + 1):
            below += left.get(j, 0)
            if j >= s and below > (j - s) * B:
                return None
        return heapq.nsmallest(B, self.ready.values(), key=lambda g: (g.ticket.deadline, g.group_id))

    def take_batch(self, n_groups: int, trainer_version: int, timeout_s: float | None = None) -> Batch | None:
        """The batch for trainer step `trainer_version` (steps done so far), or None after `timeout_s`."""
        adm = self.admission
        if n_groups != adm.batch_groups:
            raise ValueError(f"take_batch(n_groups={n_groups}) but admission was sized for {adm.batch_groups} groups")
        end = None if timeout_s is None else time.monotonic() + timeout_s
        with self.cond:
            if trainer_version != adm.next_batch:
                raise ValueError(f"trainer_version={trainer_version} but the next batch is {adm.next_batch}")
            while (picked := self._pick(trainer_version)) is None:
                left = None if end is None else end - time.monotonic()
                if left is not None and left <= 0:
                    return None
                adm.batch_cond.wait(left)
            batch = Batch(trainer_version, picked, buffer_state=self.state_dict)
            for g in picked:
                del self.ready[g.group_id]
                self._ready_deadlines[g.ticket.deadline] -= 1
                if not self._ready_deadlines[g.ticket.deadline]:
                    del self._ready_deadlines[g.ticket.deadline]
                adm._retire(g.ticket)
                for r in g.rollouts:
                    self.consumed_ids.add(r.rollout_id)
                    batch.lags.append(trainer_version - r.policy_version)
            self.lags.extend(batch.lags)
            self._lag_counts.update(batch.lags)
            adm.next_batch += 1
            self.cond.notify_all()
            return batch

    def metrics(self) -> dict[str, float]:
        with self.cond:
            return {
                "version_lag_p50": _percentile_of_counts(self._lag_counts, 50),
                "version_lag_p99": _percentile_of_counts(self._lag_counts, 99),
                "version_lag_max": float(max(self._lag_counts, default=0)),
                "admitted_groups": self.admission.admitted_groups,
                "in_flight_rollouts": self.admission.in_flight,
                "buffered_groups": len(self.ready),
                "consumed_rollouts": len(self.consumed_ids),
                "infra_failures": self.admission.infra_failures,
                "abandoned_groups": self.admission.abandoned_groups,
                "dropped_zero_variance_groups": self.dropped_zero_variance,
            }

    def state_dict(self) -> dict:
        """Accepted-but-unconsumed groups and consumed ids; save together with the trainer checkpoint."""
        with self.cond:
            return {
                "next_batch": self.admission.next_batch,
                "next_group_id": self.admission.next_group_id,
                "ready": [(g.ticket, list(g.rollouts)) for g in self.ready.values()],
                "consumed_ids": sorted(self.consumed_ids),
                "lags": list(self.lags),
            }

    def load_state_dict(self, state: dict) -> None:
        """Restore after a crash. In-flight groups of the crashed run are gone; they are simply regenerated."""
        with self.cond:
            adm = self.admission
            adm.next_batch = state["next_batch"]
            adm.unconsumed.clear()
            adm.in_flight = 0
            self.consumed_ids = set(state["consumed_ids"])
            self.lags = list(state["lags"])
            self._lag_counts = Counter(self.lags)
            self.ready = {}
            self._ready_deadlines = Counter()
            adm.next_group_id = state["next_group_id"]
            for ticket, rollouts in state["ready"]:
                self.ready[ticket.group_id] = Group(ticket, list(rollouts))
                self._ready_deadlines[ticket.deadline] += 1
                adm.unconsumed[ticket.deadline] += 1
            adm.batch_cond.notify_all()


class GroupAssembler:
    """Collects the attempts of each group as they finish, in any order; hands a group to the buffer
    the moment its last attempt finishes. With `drop_zero_variance`, groups whose rewards are all equal
    carry no GRPO signal and are dropped (counted in the buffer's metrics). `on_group(group, dropped)` is
    called before the group enters the buffer, so whatever it records (e.g. persisting accepted groups) is
    done before the trainer can take the group; if it raises, the group is neither buffered nor dropped
    and the caller must withdraw its ticket."""

    def __init__(
        self,
        buffer: RolloutBuffer,
        drop_zero_variance: bool = False,
        on_group: Callable[[Group, bool], None] | None = None,
    ):
        self.buffer, self.drop_zero_variance, self.on_group = buffer, drop_zero_variance, on_group
        self._lock = threading.Lock()
        self._partial: dict[int, list[Rollout]] = {}

    def add(self, ticket: Ticket, rollout: Rollout) -> Group | None:
        """Record a finished attempt (infrastructure failures are not added; they are retried). Returns the
        group if this completed it."""
        with self._lock:
            got = self._partial.setdefault(ticket.group_id, [])
            if any(r.rollout_id == rollout.rollout_id for r in got):
                return None
            got.append(rollout)
            if len(got) < ticket.group_size:
                return None
            group = Group(ticket, self._partial.pop(ticket.group_id))
        drop = self.drop_zero_variance and len({r.reward for r in group.rollouts}) == 1
        if self.on_group:  # first: a caller that persists accepted groups does so before the trainer sees them
            self.on_group(group, drop)
        if drop:
            self.buffer.drop(group)
        else:
            self.buffer.put(group)
        return group

    def discard(self, group_id: int) -> None:
        """Forget the finished attempts of a group that was withdrawn (abandoned or interrupted)."""
        with self._lock:
            self._partial.pop(group_id, None)
