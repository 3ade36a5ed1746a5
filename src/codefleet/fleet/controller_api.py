"""The controller's contract: its config, what a rollout runner and a trainer must provide, and the
reports it gives back. `fleet/controller.py` is the machinery behind it; these names are re-exported there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from codefleet.fleet.staleness import Batch, Rollout, Ticket

if TYPE_CHECKING:  # only GroupRunner's annotations name Ray: the run's configuration loads without it
    import ray


@dataclass
class ControllerConfig:
    """The asynchronous RL controller: how many attempts run at once, how they are grouped and batched, how far
    the trainer may run ahead of them, and how infrastructure failures are retried."""

    eta: int = 1  # staleness bound: the most policy versions a trained token may lag (0 = synchronous)
    rollout_slots: int = 8  # attempts running at once
    batch_groups: int = 2  # groups per optimizer step
    group_size: int = 4  # attempts per task, the group advantages are relative to (G)
    # an attempt still running after this is an infrastructure failure: it is cancelled and retried
    rollout_timeout_s: float = 900.0
    max_infra_retries: int = 3  # infrastructure failures of one attempt before its whole group is abandoned
    # a failed attempt is started again this long after its failure, doubled for each further failure of it (up
    # to retry_backoff_max_s): an actor restarting after its node died answers "unavailable" at once for seconds
    retry_backoff_s: float = 2.0
    retry_backoff_max_s: float = 30.0  # the longest wait before an attempt is started again
    max_abandoned_in_a_row: int = 8  # this many groups abandoned (or broken) with no success between: stop the run
    drop_zero_variance: bool = False  # drop groups whose rewards are all equal (they carry no GRPO signal)

    def __post_init__(self) -> None:
        if self.rollout_timeout_s <= 0:
            raise ValueError(f"rollout_timeout_s={self.rollout_timeout_s} must be > 0")
        if self.max_infra_retries < 0:
            raise ValueError(f"max_infra_retries={self.max_infra_retries} must be >= 0")
        if self.retry_backoff_s < 0 or self.retry_backoff_max_s < self.retry_backoff_s:
            raise ValueError(
                f"retry_backoff_s={self.retry_backoff_s} must be >= 0 and at most retry_backoff_max_s="
                f"{self.retry_backoff_max_s}"
            )


class ControllerError(RuntimeError):
    """`Controller.run()` stopped: a failing trainer step or callback, a runner breaking its contract, or a stop
    rule (every attempt failing by infrastructure, every item broken). The message says which; the cause is
    chained."""


@dataclass
class AttemptResult:
    """What an attempt's ObjectRef resolves to."""

    rollout: Rollout | None  # None when the infrastructure failed, or the item cannot be attempted
    infra_error: str = ""  # why, when rollout is None: the attempt is retried
    task_error: str = ""  # set instead when the item itself is broken (its set-up fails): the group is dropped


class GroupRunner(Protocol):
    def start(self, ticket: Ticket, item: Any, attempts: list[int]) -> list[ray.ObjectRef]:
        """Start these attempt indices of the group for work item `item`; one ObjectRef per attempt,
        each resolving to an AttemptResult (a raised exception or dead actor is an infrastructure
        failure too). Retries call start() again with the failed indices. Called from the dispatcher
        thread; it must not block long and must not raise for infrastructure failures (return a ref
        that fails instead). Rollout ids must be unique per attempt, e.g. f"{ticket.group_id}/{attempt}",
        and `policy_version` the version the attempt actually started with (≥ ticket.policy_version).
        On a timeout the controller frees the slot at once and `ray.cancel`s the ref: that cancels the
        coroutine of an async actor, but a regular or threaded actor's running method only sees a flag,
        `ray.get_runtime_context().is_canceled()`, which it should check between turns to free its thread.
        An item that can never be attempted (a task whose set-up fails) resolves to
        `AttemptResult(None, task_error=why)`: its group is dropped at once, not retried, and the controller's
        `on_broken(item, why)` decides whether the item comes again."""
        ...


class TrainerClient(Protocol):
    def train(self, batch: Batch) -> dict[str, float]:
        """One trainer step on the batch, blocking; when it returns the policy is version
        batch.trainer_version + 1 and the engines already serve it. Returns metrics. A trainer that checkpoints
        saves `batch.buffer_state()` with the step (the controller's `buffer_state()`, this batch consumed), so
        it needs no handle on the controller."""
        ...


@dataclass
class StepReport:
    step: int  # the step just done (= the version it trained from)
    version: int  # policy version after it
    metrics: dict[str, float]  # from trainer.train()
    wall_s: float  # waiting_s + train_s
    waiting_s: float  # trainer idle, waiting for this batch
    train_s: float  # inside trainer.train()
    batch_lag_max: int
    buffer: dict[str, float]  # RolloutBuffer.metrics()
    rollouts_per_s: float  # so far in this run()
    trainer_busy_fraction: float  # so far in this run()


@dataclass
class RunReport:
    """What one `Controller.run()` did. What is measured:

    - `rollouts_per_s`: rollouts trained in this `run()` / seconds from the start of `run()` to the end
      of its last trainer step (start-up included).
    - `trainer_busy_fraction`: seconds inside `trainer.train()` / seconds from the moment the first
      batch of this `run()` was handed to the trainer to the end of its last step. The wait for the
      first batch (the pipeline filling) is excluded; every later wait for a batch counts as idle.
    - `StepReport.waiting_s` (per step): seconds the trainer spent in `take_batch` before that step's batch.
    - version lags: trainer step minus the rollout's start version, for the rollouts trained in this run.
    """

    steps: int  # trainer steps done in this run()
    version: int  # policy version at the end
    ended_by: str  # "steps", "stop" or "no_more_items"
    wall_s: float  # start of run() to the end of its last trainer step
    trained_rollouts: int
    rollouts_per_s: float
    trainer_busy_s: float
    trainer_busy_fraction: float
    version_lag_p50: float
    version_lag_p99: float
    version_lag_max: int
    infra_failures: int
    abandoned_groups: int
    dropped_groups: int
    last_infra_error: str = ""
    broken_groups: int = 0  # dropped because their item cannot be attempted (AttemptResult.task_error)
    last_task_error: str = ""
    lags: list[int] = field(default_factory=list, repr=False)  # one per trained rollout

    @classmethod
    def nothing_to_do(cls, version: int) -> RunReport:
        """The report of a run() asked for the version the policy already has."""
        return cls(
            steps=0,
            version=version,
            ended_by="steps",
            wall_s=0.0,
            trained_rollouts=0,
            rollouts_per_s=0.0,
            trainer_busy_s=0.0,
            trainer_busy_fraction=0.0,
            version_lag_p50=0.0,
            version_lag_p99=0.0,
            version_lag_max=0,
            infra_failures=0,
            abandoned_groups=0,
            dropped_groups=0,
        )
