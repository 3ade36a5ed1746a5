"""The asynchronous RL controller on Ray: it streams groups of attempts under a staleness bound
into the trainer's buffer while the trainer keeps stepping.

The policy (who may start, which groups form a batch, why every trained rollout has lag ≤ η) is
the pure core in `staleness.py`; this module only drives it with Ray and threads. The contract
(ControllerConfig, GroupRunner, TrainerClient, AttemptResult, the reports and what they measure) is in
`controller_api.py`.

Two threads.
- The dispatcher is the thread that calls `run()`. It admits groups
  (`AdmissionController.try_admit(self.version)`; each admitted group takes `next(items)`), starts
  their attempts through the `GroupRunner` (one ObjectRef per attempt) and handles each attempt
  the moment its ref resolves, in completion order, not group order. Every ref's `future()` posts
  to one `queue.SimpleQueue` when it resolves, so the dispatcher blocks on that queue: no polling,
  and no scan over all in-flight refs per completion (as `ray.wait` over 64 refs would do). The
  trainer's version bumps and `stop()` wake it through the same queue.
- The trainer thread loops: `buffer.take_batch(batch_groups, version)` (earliest deadline first;
  it waits rather than break the bound), `trainer.train(batch)`, then `version += 1` and it wakes
  the dispatcher, which re-checks admission at once. A weight update never waits for in-flight
  attempts: they keep running and are trained later (each rollout carries the version it started
  with; the runner reports it, and it must be ≥ the version its group was admitted at).

Groups. A finished attempt returns its slot and goes to the `GroupAssembler`; the group's last
attempt calls `on_group(group, dropped)` synchronously and only then puts the group in the buffer
(or drops it if `drop_zero_variance` and all rewards are equal), so whatever `on_group` persists is
durable before the trainer can take the group.

Infrastructure failures. An attempt whose ref raises (a dead actor, a crashed sandbox), that
resolves to `AttemptResult(rollout=None)`, or that runs past `rollout_timeout_s` (then it is
`ray.cancel`led) is an infrastructure failure: it returns its slot, is counted, and the same
attempt index is started again with `runner.start(ticket, item, [attempt])` once its back-off has passed
(`retry_backoff_s`, doubled per further failure of that attempt, at most `retry_backoff_max_s`) and a slot is
free (a retry that is due goes before new groups). The back-off matters when a node dies: its actors are
restarted elsewhere, and until then every call to them fails at once. It is never scored as the agent's
failure. An attempt that fails more than `max_infra_retries` times abandons its group: the group's other
attempts are cancelled and its ticket is withdrawn, so the trainer does not wait for it.

Broken items. An attempt that resolves to `AttemptResult(None, task_error=why)` says the item itself
cannot be attempted (a task whose set-up fails): retrying would fail the same way, and scoring it would
teach the policy nothing. Its group is withdrawn at once (other attempts cancelled), counted in
`broken_groups`, and `on_broken(item, why)` is called (the RL stage takes the task out of its stream).

Ending. `run(n_steps)` returns once the trainer has reached version `n_steps` (versions count
from 0, so a resumed controller at `start_version=3` does 2 steps in `run(5)`), after `stop()`, or
when `items` is exhausted and no batch can be formed any more. In-flight attempts are then
cancelled and their groups withdrawn (their finished attempts are discarded; a later `run()` on
this controller starts their items again first); buffered groups stay, and `buffer_state()` holds
them for a checkpoint. `run()` may be called again to continue.

Errors. An exception in `trainer.train`, `on_step`, `on_group` or `on_broken`, a runner breaking its
contract (see `GroupRunner`), or a stop rule (`max_abandoned_in_a_row`) stops the run the same way and
`run()` raises a ControllerError (a RuntimeError) naming the step or group, with the original exception
as its cause; Ctrl-C (KeyboardInterrupt) and SystemExit (the CLI's SIGTERM) leave as they are after clean-up.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from codefleet.fleet.controller_api import (  # noqa: F401 - the contract, re-exported
    AttemptResult,
    ControllerConfig,
    ControllerError,
    GroupRunner,
    RunReport,
    StepReport,
    TrainerClient,
)
from codefleet.fleet.controller_attempts import Attempt, GroupState, cancel, describe_failure
from codefleet.fleet.staleness import AdmissionController, Group, GroupAssembler, RolloutBuffer, _percentile

log = logging.getLogger(__name__)

_WAKE = ("wake",)
_POLL_S = 0.05  # how often the waiting trainer thread re-checks stop / no-more-work


class _Fatal(RuntimeError):
    """A contract violation or a failing callback: the run stops and run() re-raises."""


class Controller:
    def __init__(
        self,
        config: ControllerConfig,
        runner: GroupRunner,
        trainer: TrainerClient,
        items: Iterator[Any],
        *,
        start_version: int = 0,
        buffer_state: dict | None = None,
        on_group: Callable[[Group, bool], None] | None = None,
        on_step: Callable[[StepReport], None] | None = None,
        on_broken: Callable[[Any, str], None] | None = None,
    ):
        self.config, self.runner, self.trainer, self.items = config, runner, trainer, iter(items)
        self.on_step, self.on_broken = on_step, on_broken
        self.admission = AdmissionController(config.eta, config.rollout_slots, config.batch_groups, config.group_size)
        self.buffer = RolloutBuffer(self.admission)
        if buffer_state is not None:
            if buffer_state["next_batch"] != start_version:
                raise ValueError(
                    f"start_version={start_version} but buffer_state was saved before step "
                    f"{buffer_state['next_batch']}; pass the version of the checkpoint the state was saved with"
                )
            self.buffer.load_state_dict(buffer_state)
        else:
            self.admission.next_batch = start_version
        self.assembler = GroupAssembler(self.buffer, config.drop_zero_variance, on_group)
        self._version = start_version
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._tokens = itertools.count()
        self._pending: dict[int, Attempt] = {}  # insertion order = start order = deadline order
        self._groups: dict[int, GroupState] = {}  # admitted, not yet complete or withdrawn
        # (due time, order, group_id, attempt) waiting for their back-off and a slot, a heap: earliest due first
        self._retries: list[tuple[float, int, int, int]] = []
        self._requeued: list[Any] = []  # items of groups interrupted at the end of a run, started first next time
        self._exhausted = False  # items raised StopIteration
        self._drained = False  # exhausted and nothing in flight: no further group will arrive
        self._stopping = False  # stop() was called: final
        self._halt = False  # this run() is ending (stop, error, or done)
        self._running = False
        self._last_infra_error = ""
        self._abandoned_in_a_row = 0
        self._broken_groups = 0
        self._broken_in_a_row = 0
        self._last_task_error = ""

    @property
    def version(self) -> int:
        """The policy version the engines serve now."""
        return self._version

    def buffer_state(self) -> dict:
        """RolloutBuffer.state_dict(): buffered groups and consumed ids, to save with a checkpoint."""
        return self.buffer.state_dict()

    def stop(self) -> None:
        """End the current run() promptly (and any later one at once). Safe from another thread or a
        signal handler: it only sets a flag and posts to a reentrant queue. A train() in progress is
        let finish."""
        self._stopping = True
        self._events.put(_WAKE)

    # ---- run ----------------------------------------------------------------------------------

    def run(self, n_steps: int) -> RunReport:
        """Run until the policy reaches version `n_steps`, stop(), or no more work; see the module docstring."""
        if self._running:
            raise RuntimeError("Controller.run() is already running; call it from one thread at a time")
        if n_steps < self._version:
            raise ValueError(
                f"run(n_steps={n_steps}) but the policy is already at version {self._version}; "
                "n_steps is the version to reach, counted from 0"
            )
        adm, buf = self.admission, self.buffer
        if n_steps == self._version:
            return RunReport.nothing_to_do(self._version)
        self._running = True
        base = (adm.infra_failures, adm.abandoned_groups, buf.dropped_zero_variance, self._broken_groups)
        start_version = self._version
        self._t_start = time.monotonic()
        self._t_first_batch: float | None = None
        self._t_end = self._t_start
        self._busy_s, self._trained, self._lags = 0.0, 0, []
        self._ended_by = "stop" if self._stopping else "steps"
        self._error: tuple[str, BaseException] | None = None
        self._halt = False
        trainer_thread = threading.Thread(
            target=self._train_loop, args=(n_steps,), name="codefleet-trainer", daemon=True
        )
        trainer_thread.start()
        try:
            self._dispatch(trainer_thread)
        except (KeyboardInterrupt, SystemExit):
            raise  # as it is, after the clean-up below
        except BaseException as e:
            if self._error is None:
                self._error = (str(e) if isinstance(e, _Fatal) else f"the controller failed: {e!r}", e)
        finally:
            self._halt = True  # the trainer thread leaves its wait (a train() in progress finishes first)
            trainer_thread.join()
            self._interrupt_in_flight()
            self._running = False
        if self._error is not None:
            msg, cause = self._error
            raise ControllerError(
                f"{msg}. The run stopped and in-flight attempts were cancelled; resume from the last checkpoint "
                "(buffer_state() saved with it), since a failed step may have consumed its batch."
            ) from cause
        wall_s = self._t_end - self._t_start
        busy_window_s = self._t_end - self._t_first_batch if self._t_first_batch is not None else 0.0
        return RunReport(
            steps=self._version - start_version,
            version=self._version,
            ended_by=self._ended_by,
            wall_s=wall_s,
            trained_rollouts=self._trained,
            rollouts_per_s=self._trained / wall_s if wall_s > 0 else 0.0,
            trainer_busy_s=self._busy_s,
            trainer_busy_fraction=self._busy_s / busy_window_s if busy_window_s > 0 else 0.0,
            version_lag_p50=_percentile(self._lags, 50),
            version_lag_p99=_percentile(self._lags, 99),
            version_lag_max=max(self._lags, default=0),
            infra_failures=adm.infra_failures - base[0],
            abandoned_groups=adm.abandoned_groups - base[1],
            dropped_groups=buf.dropped_zero_variance - base[2],
            last_infra_error=self._last_infra_error,
            broken_groups=self._broken_groups - base[3],
            last_task_error=self._last_task_error,
            lags=list(self._lags),
        )

    # ---- trainer thread -----------------------------------------------------------------------

    def _ending(self) -> bool:
        return self._stopping or self._halt or self._error is not None

    def _train_loop(self, n_steps: int) -> None:
        B = self.config.batch_groups
        try:
            while self._version < n_steps and not self._ending():
                t_wait = time.monotonic()
                batch = None
                while batch is None:
                    if self._ending():
                        return
                    drained = self._drained  # read before trying: a True here means no group can still arrive
                    batch = self.buffer.take_batch(B, self._version, timeout_s=_POLL_S)
                    if batch is None and drained:
                        self._ended_by = "no_more_items"
                        return
                t_got = time.monotonic()
                if self._t_first_batch is None:
                    self._t_first_batch = t_got
                step = self._version
                try:
                    metrics = self.trainer.train(batch)
                except BaseException as e:
                    self._error = (f"trainer.train failed at step {step}: {e!r}", e)
                    return
                t_done = time.monotonic()
                self._busy_s += t_done - t_got
                self._trained += len(batch.lags)
                self._lags.extend(batch.lags)
                self._version = step + 1
                self._t_end = t_done
                self._events.put(_WAKE)  # admission may open at the new version
                if self.on_step is not None:
                    report = StepReport(
                        step=step,
                        version=step + 1,
                        metrics=dict(metrics or {}),
                        wall_s=t_done - t_wait,
                        waiting_s=t_got - t_wait,
                        train_s=t_done - t_got,
                        batch_lag_max=max(batch.lags, default=0),
                        buffer=self.buffer.metrics(),
                        rollouts_per_s=self._trained / (t_done - self._t_start),
                        trainer_busy_fraction=self._busy_s / max(t_done - self._t_first_batch, 1e-9),
                    )
                    try:
                        self.on_step(report)
                    except BaseException as e:
                        self._error = (f"on_step failed after step {step}: {e!r}", e)
                        return
        except BaseException as e:
            self._error = (f"the trainer loop failed at step {self._version}: {e!r}", e)
        finally:
            if self._error is None and self._ended_by != "no_more_items":
                self._ended_by = "steps" if self._version >= n_steps else "stop"
            self._t_end = max(self._t_end, self._t_start) if self._ended_by == "steps" else time.monotonic()
            self._events.put(_WAKE)

    # ---- dispatcher ---------------------------------------------------------------------------

    def _dispatch(self, trainer_thread: threading.Thread) -> None:
        while not self._ending() and trainer_thread.is_alive():
            self._fill()
            if self._exhausted and not self._requeued and not self._groups:
                self._drained = True
            timeout_s = 1.0
            if self._pending:
                oldest = next(iter(self._pending.values()))
                timeout_s = min(timeout_s, max(oldest.deadline_s - time.monotonic(), 0.0))
            if self._retries:
                timeout_s = min(timeout_s, max(self._retries[0][0] - time.monotonic(), 0.0))
            try:
                event = self._events.get(timeout=timeout_s)
            except queue.Empty:
                event = None
            while event is not None:
                if event[0] == "done":
                    self._handle_done(event[1], event[2])
                try:
                    event = self._events.get_nowait()
                except queue.Empty:
                    event = None
            self._expire_timeouts()

    def _fill(self) -> None:
        """Start the retries that are due (first), then admit new groups while the bound and the slots allow."""
        adm = self.admission
        if self._ending():
            return
        now = time.monotonic()
        while self._retries and self._retries[0][0] <= now:
            _, _, group_id, attempt = self._retries[0]
            g = self._groups.get(group_id)
            if g is not None:
                if not adm.try_retry(g.ticket):
                    return  # no slot: new groups must not overtake the retry
                g.held_slots += 1
                self._start(g, [attempt])
            heapq.heappop(self._retries)
        while self._requeued or not self._exhausted:
            ticket = adm.try_admit(self._version)
            if ticket is None:
                return
            try:
                item = self._requeued.pop(0) if self._requeued else next(self.items)
            except StopIteration:
                self._exhausted = True
                adm.withdraw(ticket, running=ticket.group_size)
                return
            g = GroupState(ticket, item, held_slots=ticket.group_size)
            self._groups[ticket.group_id] = g
            self._start(g, list(range(ticket.group_size)))

    def _start(self, g: GroupState, attempts: list[int]) -> None:
        try:
            refs = self.runner.start(g.ticket, g.item, attempts)
        except Exception as e:
            raise _Fatal(
                f"GroupRunner.start failed for group {g.ticket.group_id} attempts {attempts}: {e!r}; start() must "
                "not raise for infrastructure failures: return a ref that fails (or resolves to "
                "AttemptResult(None, why)) instead"
            ) from e
        if len(refs) != len(attempts):
            raise _Fatal(
                f"GroupRunner.start returned {len(refs)} refs for {len(attempts)} attempts; return one per attempt"
            )
        deadline_s = time.monotonic() + self.config.rollout_timeout_s
        for attempt, ref in zip(attempts, refs, strict=True):
            token = next(self._tokens)
            self._pending[token] = Attempt(token, g.ticket.group_id, attempt, ref, deadline_s)
            g.running[attempt] = token
            ref.future().add_done_callback(functools.partial(self._post_done, token))

    def _post_done(self, token: int, future: Any) -> None:  # runs on a Ray thread
        self._events.put(("done", token, future))

    def _handle_done(self, token: int, future: Any) -> None:
        att = self._pending.pop(token, None)
        if att is None:
            return  # timed out, abandoned or interrupted earlier: its slot was already returned
        g = self._groups[att.group_id]
        del g.running[att.attempt]
        try:
            result = future.result()
        except Exception as e:
            self._failed(g, att, describe_failure(e))
            return
        if not isinstance(result, AttemptResult):
            raise _Fatal(
                f"an attempt of group {att.group_id} resolved to {type(result).__name__}; GroupRunner refs "
                "must resolve to AttemptResult"
            )
        if result.rollout is None and result.task_error:
            self._broken(g, att, result.task_error)
            return
        if result.rollout is None:
            self._failed(g, att, result.infra_error or "the runner gave no reason")
            return
        r = result.rollout
        if r.group_id != g.ticket.group_id or r.rollout_id in g.rollout_ids:
            raise _Fatal(
                f"rollout {r.rollout_id!r} (group {r.group_id}) returned for group {g.ticket.group_id} "
                f"attempt {att.attempt}: rollout ids must be unique per attempt and name their group, "
                "e.g. f'{group_id}/{attempt}'"
            )
        if r.policy_version < g.ticket.policy_version:
            raise _Fatal(
                f"rollout {r.rollout_id!r} reports policy_version {r.policy_version} but its group was "
                f"admitted at version {g.ticket.policy_version}; report the version the attempt started with"
            )
        g.rollout_ids.add(r.rollout_id)
        self._abandoned_in_a_row = self._broken_in_a_row = 0
        self.admission.release(g.ticket, accepted=True)
        g.held_slots -= 1
        try:
            complete = self.assembler.add(g.ticket, r)
        except Exception as e:
            raise _Fatal(f"on_group failed for group {g.ticket.group_id}: {e!r}") from e
        if complete is not None:
            del self._groups[g.ticket.group_id]

    def _failed(self, g: GroupState, att: Attempt, why: str) -> None:
        self.admission.release(g.ticket, accepted=False)
        g.held_slots -= 1
        g.failures[att.attempt] += 1
        self._last_infra_error = f"group {att.group_id} attempt {att.attempt}: {why}"
        if g.failures[att.attempt] > self.config.max_infra_retries:
            log.warning(
                "abandoning group %d: attempt %d failed %d times by infrastructure (last: %s)",
                att.group_id,
                att.attempt,
                g.failures[att.attempt],
                why,
            )
            self._withdraw(g, abandoned=True)
            self._abandoned_in_a_row += 1
            if self._abandoned_in_a_row >= self.config.max_abandoned_in_a_row:
                raise _Fatal(
                    f"{self._abandoned_in_a_row} groups in a row were abandoned with no attempt succeeding: "
                    f"the infrastructure fails every attempt (last: {why}); check the rollout workers' "
                    "logs, fix the cause and resume from the last checkpoint"
                )
        else:
            c = self.config
            backoff_s = min(c.retry_backoff_s * 2 ** (g.failures[att.attempt] - 1), c.retry_backoff_max_s)
            heapq.heappush(self._retries, (time.monotonic() + backoff_s, next(self._tokens), att.group_id, att.attempt))

    def _broken(self, g: GroupState, att: Attempt, why: str) -> None:
        self._broken_groups += 1  # not an infrastructure failure: the withdrawal returns this attempt's slot too
        self._last_task_error = f"group {att.group_id}: {why}"
        log.warning("dropping group %d: its item cannot be attempted: %s", att.group_id, why)
        self._withdraw(g, abandoned=False)
        if self.on_broken is not None:
            try:
                self.on_broken(g.item, why)
            except Exception as e:
                raise _Fatal(f"on_broken failed for group {att.group_id}: {e!r}") from e
        self._broken_in_a_row += 1
        if self._broken_in_a_row >= self.config.max_abandoned_in_a_row:
            raise _Fatal(
                f"{self._broken_in_a_row} groups in a row were dropped because their item cannot be "
                f"attempted, with no attempt succeeding between (last: {why}); check the work items"
            )

    def _withdraw(self, g: GroupState, abandoned: bool) -> None:
        for token in g.running.values():
            att = self._pending.pop(token)
            cancel(att.ref)
        g.running.clear()
        self.admission.withdraw(g.ticket, running=g.held_slots, abandoned=abandoned)
        self.assembler.discard(g.ticket.group_id)
        del self._groups[g.ticket.group_id]

    def _expire_timeouts(self) -> None:
        now = time.monotonic()
        while self._pending:
            att = next(iter(self._pending.values()))
            if att.deadline_s > now:
                return
            del self._pending[att.token]
            cancel(att.ref)
            g = self._groups[att.group_id]
            del g.running[att.attempt]
            self._failed(g, att, f"timed out after {self.config.rollout_timeout_s} s (cancelled)")

    def _interrupt_in_flight(self) -> None:
        """End of run: cancel running attempts and withdraw their groups; their items start first in the
        next run() (as new groups: finished attempts of an interrupted group are discarded)."""
        for g in sorted(self._groups.values(), key=lambda g: g.ticket.group_id):
            self._requeued.append(g.item)
            self._withdraw(g, abandoned=False)
        self._retries.clear()
        self._drained = False
