"""The policy's actors in an RL run: the engine actors that serve the policy and the trainer group that trains
it, kept going through the failures a long run meets. The training recipe (`recipe/train_rl.py`) says what to
do with them; this module does it over Ray.

    actors = PolicyActors(group, engines, new_group=new_group, weight_sync="buckets", bucket_mb=256,
                          engine_wait_s=300, colocated=False, log=print)
    metrics = actors.train_step(samples, step, save=..., restart_from=...)
    serving, away, version = actors.publish(checkpoint_of_that_version)
    actors.keep(serving, away, version)

- Sleep and wake. Placed together (`fleet.placement`, `colocated`), an engine shares its devices with a trainer
  worker: `sleep()` before the step, `wake()` once the new weights are in. An engine that is dead or restarting
  is left to its fate (a restarted engine starts awake).
- Weight sync (`weight_sync`: the run's `weight_sync.method`, `fleet.fleet_config.WeightSyncConfig`). "whole": one
  state dict through the object store; "buckets": the weights in buckets through the object store
  (`fleet.weight_sync`); "collective": a broadcast over process groups formed
  with the engines once (`GroupSync`), while every engine is up. A failure of the groups sends that version
  through the object store instead (counted in `sync_fallbacks`), and the next version forms the groups anew with
  the engines serving then. An engine that does not take the weights in time is *away* (`broadcast_weights`).
- Trainer-worker restarts. A trainer worker that dies mid-step (its process or node is lost) is an
  infrastructure failure, not a reason to stop the run: `new_group(checkpoint)` starts a new TrainerGroup from
  the last committed checkpoint and the work is done again, up to `MAX_TRAINER_RESTARTS` times in a row. A worker
  that raised is not replaced: a full disk would raise again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TypeVar

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from codefleet.fleet.fleet_config import WEIGHT_SYNCS
from codefleet.fleet.inference import broadcast_weights
from codefleet.fleet.trainer_group import TrainerGroup, TrainerWorkerError
from codefleet.fleet.weight_sync import GroupSync, GroupSyncError

T = TypeVar("T")


class PolicyActors:
    """The engines and the trainer group of one RL run; see the module docstring.

    `new_group(checkpoint)` starts a TrainerGroup from a checkpoint (None: a dead worker ends the run);
    `engine_wait_s` is how long a weight broadcast waits for an engine; `log` takes the lines a run prints."""

    MAX_TRAINER_RESTARTS = 2

    def __init__(
        self,
        group: TrainerGroup,
        engines: list,
        *,
        new_group: Callable[[str], TrainerGroup] | None,
        weight_sync: str,
        bucket_mb: float,
        engine_wait_s: float,
        colocated: bool,
        log: Callable[[str], None],
    ):
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync={weight_sync!r}: use one of {', '.join(WEIGHT_SYNCS)}")
        self.group, self.engines, self.new_group = group, list(engines), new_group
        self.weight_sync, self.bucket_mb, self.engine_wait_s = weight_sync, bucket_mb, engine_wait_s
        self.colocated, self.log = colocated, log
        self.away: dict = {}  # engines that did not take weights in time -> a call that returns once they are back
        self.sync: GroupSync | None = None  # the weight-sync groups of weight_sync="collective", once formed
        self.sync_fallbacks = 0  # versions that went through the object store because the groups failed

    @property
    def version(self) -> int:
        """The policy version the trainer group holds."""
        return self.group.version

    # ---- engines ----------------------------------------------------------------------------

    def sleep(self) -> None:
        """The engines stop stepping (their requests wait) while a colocated trainer steps on their devices."""
        self._engines_call("sleep")

    def wake(self) -> None:
        self._engines_call("wake")

    def _engines_call(self, method: str, timeout_s: float = 60.0) -> None:
        """`method` on every engine serving, waited for; an engine that is dead or restarting is left to its fate
        (a restarted engine starts awake)."""
        refs = [getattr(e, method).remote() for e in self.engines if e not in self.away]
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        for ref in done:
            with contextlib.suppress(RayActorError):
                ray.get(ref)

    def keep(self, serving: list, away: dict, version: int) -> None:
        """Go on with the engines that serve `version` or are away (`publish`'s answer), leaving out the ones dead
        for good; say so when that changed."""
        if len(serving) + len(away) < len(self.engines) or len(away) != len(self.away):
            gone = len(self.engines) - len(serving) - len(away)
            self.log(
                f"engines: {len(serving)} serve version {version}"
                + (f", {len(away)} away (restarting, not waited for)" if away else "")
                + (f", {gone} dead for good and left out" if gone else "")
            )
        self.engines, self.away = [e for e in self.engines if e in serving or e in away], away

    def prefix_cache_report(self) -> None:
        """Log how much prefill the engines' prefix cache saved over the run (the turns of an episode share it)."""
        for i, engine in enumerate(self.engines):
            try:
                info = ray.get(engine.info.remote(), timeout=10)
            except (RayActorError, GetTimeoutError) as e:
                self.log(f"engine {i}: no prefix cache figures, it is not there ({type(e).__name__})")
                continue
            reused, computed = info["prefix_tokens_reused"], info["prefill_tokens"]
            self.log(
                f"engine {i}: prefix cache supplied {reused} of {reused + computed} prompt tokens "
                f"({reused / max(reused + computed, 1):.0%}, {info['prefix_hits']} hits)"
            )

    # ---- trainer ----------------------------------------------------------------------------

    def train_step(
        self, samples: list, step: int, save: Callable[[TrainerGroup], None], restart_from: Callable[[], str]
    ) -> dict:
        """One RL step from version `step`, then `save(group)` (the checkpoint of version step + 1); done again on
        a new trainer group from `restart_from()` (the last commit, at version `step`) if a worker dies."""

        def step_and_save() -> dict:
            m = dict(self.group.rl_step(samples))
            save(self.group)
            return m

        return self._with_restarts(step_and_save, restart_from, step, f"redo step {step}")

    def publish(self, checkpoint: str) -> tuple[list, dict, int]:
        """The trainer's weights, committed as `checkpoint`, to the engines: (serving, away, version), as
        `broadcast_weights`. A trainer worker that dies after the commit is replaced from `checkpoint` and the
        weights are published again."""
        version = self.group.version
        return self._with_restarts(self._sync_weights, lambda: checkpoint, version, f"publish version {version}")

    def shutdown(self) -> None:
        """Stop the trainer group in use (a worker that died was replaced); the engines stay."""
        self.group.shutdown()

    def _sync_weights(self) -> tuple[list, dict, int]:
        version = self.group.version
        if self.weight_sync == "collective" and not self.away:
            try:
                if self.sync is None or self.sync.engines != self.engines:
                    self.sync = GroupSync(self.group.workers, self.engines, min(self.engine_wait_s, 120.0))
                self.sync.send(self.group.bucket_plans(self.bucket_mb), version)
                return list(self.engines), {}, version
            except GroupSyncError as e:
                self.sync, self.sync_fallbacks = None, self.sync_fallbacks + 1
                self.log(
                    f"{e}; version {version} goes through the object store, and the groups are formed anew next time"
                )
        if self.weight_sync == "whole":
            weights, version = self.group.publish()
        else:
            weights = self.group.publish_buckets(self.bucket_mb)
        serving, away = broadcast_weights(self.engines, weights, version, self.engine_wait_s, self.away)
        return serving, away, version

    def _with_restarts(self, work: Callable[[], T], restart_from: Callable[[], str], version: int, what: str) -> T:
        """`work()`; when a trainer worker died in it (not one that raised), a new trainer group starts from the
        checkpoint `restart_from()` names, which must be at `version`, and `work` runs again, up to
        MAX_TRAINER_RESTARTS times in a row."""
        for restarts in range(self.MAX_TRAINER_RESTARTS + 1):
            try:
                return work()
            except TrainerWorkerError as e:
                if (
                    not isinstance(e.__cause__, RayActorError)
                    or self.new_group is None
                    or restarts == self.MAX_TRAINER_RESTARTS
                ):
                    raise
                restart = restart_from()
                self.log(f"{e}; starting a new trainer group from {restart} to {what}")
                self.group.shutdown()
                self.group, self.sync = self.new_group(restart), None  # collective groups held the old workers
                if self.group.version != version:
                    raise RuntimeError(
                        f"the last checkpoint is at version {self.group.version}, not {version}: resume the run instead"
                    ) from e
        raise AssertionError("the loop returns or raises")
