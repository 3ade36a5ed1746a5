"""Data-parallel training on Ray: N `TrainerWorker` actors, one `rl.trainer.Trainer` each, torch.distributed (gloo
on CPU, NCCL on GPUs).

    group = TrainerGroup(2, model_config=ModelConfig.tiny(), config=TrainConfig())
    group.sft_step(examples)  /  group.rl_step(samples)     # one optimizer step each
    ref, version = group.publish()                          # weights in the object store
    buckets = group.publish_buckets(bucket_mb=256)          # or in buckets from every rank (fleet.weight_sync)
    engine.update_weights(ray.get(ref), version)
    group.save("ckpt/");  group.shutdown()

A step shards the batch across the workers, longest first onto the worker with
the fewest tokens so far. Every worker runs `forward_backward` on its shard
with the *whole step's* loss units (`rl.trainer.loss_units`), so its
gradient is its share of the one-batch gradient; `Trainer.all_reduce` sums
the shares (and the router's expert loads) with one `all_reduce` each, and
every worker applies the same AdamW step, so the weights stay identical
without ever being broadcast (tests compare them with one in-process
`Trainer` on the full batch). A worker with an empty shard still takes part
with zero gradients. At start-up rank 0's weights are broadcast once, so the
workers agree even if their initialisation did not. `n_workers=1` skips
torch.distributed.

Workers are placed by Ray logical resources (`num_cpus_per_worker`,
`resources_per_worker`) and GPUs (`num_gpus_per_worker`, `fleet.gpus`); rank 0
picks a free port on its node and the others join it over TCP.
`torch.set_num_threads(threads_per_worker)` keeps a worker to its share of the
cores.

Checkpoints and weight publication, what each rank writes and sends: `fleet/trainer_worker.py`.

GPUs: a worker given one builds its trainer on it (`cuda`, the GPU Ray gave
the actor), its batches go there, and the process group uses NCCL; weights
leave it as CPU tensors (`publish`, buckets). Several workers need a whole GPU
each (NCCL refuses two ranks on one GPU), and a group asking for more GPUs than
the cluster has is refused before any worker starts. With no GPU nothing
changes: CPU and gloo.

Sharded backends (`backend` "fsdp2" / "fsdp2_ep", `rl.sharded`): the trainer's construction,
`weights()` and `save()` are collectives, so the workers join the process group first (even a group of one)
and build the trainer after; `publish`, `publish_buckets` and `save` run on every rank. The batch is sharded
as above and the gradient sums happen in FSDP2's backward. `save(path)` writes a normal checkpoint into
`path` (an HF directory for an HF model: what engines, evaluation and `checkpoint.load` read) with the DCP
shards in `path/sharded/`, which a `TrainerGroup(checkpoint=path)` of this backend resumes from exactly.

Failure: a worker that dies (`RayActorError`) or raises mid-step leaves the
others inside a collective, so the group is finished: the step raises
`TrainerWorkerError` naming the rank, every later call raises it again, and
the way on is a new group from the last checkpoint (`TrainerGroup(checkpoint=
path)`). Inputs are validated on the driver before anything is sent, so a
malformed batch raises `ValueError` and leaves the group usable.
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.exceptions import RayActorError, RayError

from codefleet.fleet.fleet_config import TrainerWorkersConfig
from codefleet.fleet.gpus import actor_options, check_gpus
from codefleet.fleet.trainer_worker import TrainerWorker, is_sharded
from codefleet.fleet.weight_sync import Buckets, SenderPlan, publish_buckets
from codefleet.model.config import ModelConfig
from codefleet.rl.batch import Sample
from codefleet.rl.trainer import Example, TrainConfig, check_examples, check_samples, has_signal, loss_units, sft_units
from codefleet.store import storage

SUMMED = ("loss", "tokens", "loss_units", "sequences", "micro_batches")  # metrics that add up across workers
FROM_RANK0 = ("grad_norm", "lr", "version")  # identical on every worker after the step


class TrainerWorkerError(RuntimeError):
    """A trainer worker died or failed mid-step; the group cannot continue."""


def shard_by_tokens(lengths: list[int], n: int) -> list[list[int]]:
    """Indices split into n shards of balanced total length: longest first, onto the lightest shard."""
    shards: list[list[int]] = [[] for _ in range(n)]
    load = [0] * n
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        shards[r].append(i)
        load[r] += lengths[i]
    return shards


def merge_metrics(per_worker: list[dict[str, float]]) -> dict[str, float]:
    """One step's metrics: counts and the loss summed, per-token metrics weighted by each worker's loss units,
    the optimizer's from rank 0."""
    out = {k: sum(m.get(k, 0.0) for m in per_worker) for k in SUMMED}
    weight = sum(m.get("loss_units", 0.0) for m in per_worker)
    for key in {k for m in per_worker for k in m} - set(SUMMED) - set(FROM_RANK0):
        pairs = [(m[key], m.get("loss_units", 0.0)) for m in per_worker if key in m]
        out[key] = sum(v * w for v, w in pairs) / weight if weight > 0 else pairs[0][0]
    out.update({k: per_worker[0][k] for k in FROM_RANK0 if k in per_worker[0]})
    return out


# ---- the group (driver side) ------------------------------------------------------------


class TrainerGroup:
    """N data-parallel trainer workers that step together. See the module docstring."""

    def __init__(
        self,
        n_workers: int = 2,
        *,
        checkpoint: str | None = None,
        model_config: ModelConfig | None = None,
        config: TrainConfig | None = None,
        num_cpus_per_worker: float = 1.0,
        resources_per_worker: dict[str, float] | None = None,
        threads_per_worker: int = 1,
        collective_timeout_s: float = 300.0,
        num_gpus_per_worker: float = 0.0,
        placement: list | None = None,
        backend: str = TrainerWorkersConfig.backend,
    ):
        """`placement`: a scheduling strategy per rank (`fleet.placement.Placement.trainer`)."""
        if n_workers < 1:
            raise ValueError(f"n_workers must be >= 1, got {n_workers}")
        if (checkpoint is None) == (model_config is None):
            raise ValueError(
                "TrainerGroup needs exactly one of checkpoint= (resume or start from saved weights) "
                "and model_config= (fresh weights from TrainConfig.seed)"
            )
        self.config = config or TrainConfig()
        self.backend = backend
        self.sharded = is_sharded(backend)
        self._broken: str | None = None
        options = actor_options(num_cpus_per_worker, resources_per_worker, num_gpus_per_worker)
        if n_workers > 1 and 0 < num_gpus_per_worker < 1 and placement is None:  # Placement.reserve checks its own
            raise ValueError(
                f"{n_workers} trainer workers with {num_gpus_per_worker:g} GPU each could share a GPU, "
                "and NCCL refuses two ranks on one GPU: give each worker 1 GPU, or use one worker"
            )
        check_gpus({f"{n_workers} trainer workers x {num_gpus_per_worker:g} GPU": n_workers * num_gpus_per_worker})
        strategies = placement or [None] * n_workers
        if len(strategies) != n_workers:
            raise ValueError(f"{len(strategies)} placements for {n_workers} trainer workers")
        self.workers = [
            TrainerWorker.options(**options, **({"scheduling_strategy": where} if where else {})).remote(
                rank, n_workers, checkpoint, model_config, self.config, threads_per_worker, self.backend
            )
            for rank, where in enumerate(strategies)
        ]
        if n_workers > 1 or self.sharded:  # a sharded trainer needs a process group, even of one
            init_method = self._get([self.workers[0].rendezvous.remote()])[0]
            self._get([w.init_distributed.remote(init_method, collective_timeout_s) for w in self.workers])
        self._version = self._get([self.workers[0].version.remote()])[0]

    @property
    def n_workers(self) -> int:
        return len(self.workers)

    @property
    def version(self) -> int:
        """The policy version of the weights (the number of optimizer steps taken)."""
        return self._version

    def sft_step(self, examples: list[Example]) -> dict[str, float]:
        """One optimizer step on the whole batch of (ids, mask) examples, sharded across the workers."""
        check_examples(examples)
        total = sft_units(examples)
        if total == 0:
            raise ValueError("no example has a masked (assistant) token after the first: nothing to train on")
        shards = shard_by_tokens([len(ids) for ids, _ in examples], self.n_workers)
        return self._step(
            [w.sft_step.remote([examples[i] for i in shard], total) for w, shard in zip(self.workers, shards)]
        )

    def rl_step(self, samples: list[Sample]) -> dict[str, float]:
        """One optimizer step of the RL loss (`config.loss`) on the whole batch, sharded across the workers."""
        check_samples(samples)
        total = loss_units(samples, self.config.loss)
        # no sampled token (every attempt of the batch ended before the policy's first turn) or every advantage 0:
        # count the step, move nothing; the run goes on with its next batch
        if total == 0 or not has_signal(samples, self.config.loss):
            return {**self._step([w.skip_step.remote() for w in self.workers]), "skipped": 1.0}
        shards = shard_by_tokens([len(s.tokens) for s in samples], self.n_workers)
        return {
            **self._step(
                [w.rl_step.remote([samples[i] for i in shard], total) for w, shard in zip(self.workers, shards)]
            ),
            "skipped": 0.0,
        }

    def _step(self, refs: list[ray.ObjectRef]) -> dict[str, float]:
        start = time.perf_counter()
        metrics = merge_metrics(self._get(refs))
        self._version = int(metrics["version"])
        return {**metrics, "step_s": time.perf_counter() - start}

    def device_info(self) -> list[dict]:
        """Each rank's device, GPU name and peak GPU memory (`TrainerWorker.device_info`), in rank order."""
        return self._get([w.device_info.remote() for w in self.workers])

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Each sample's per-token logprobs under the current weights (`Trainer.logprobs`: aligned with its tokens,
        0 where its loss_mask is 0), to compare with the engine's. A sharded trainer scores on every rank (its
        forward is a collective), each rank the whole batch."""
        check_samples(samples)
        workers = self.workers if self.sharded else self.workers[:1]
        return self._get([w.logprobs.remote(samples) for w in workers])[0]

    def publish(self) -> tuple[ray.ObjectRef, int]:
        """Rank 0's weights as one object in the store (a `dict[str, Tensor]` once fetched) and their version.
        A sharded backend gathers them with every rank taking part."""
        if not self.sharded:
            version_ref, weights_ref = self.workers[0].weights.options(num_returns=2).remote()
            version = self._get([version_ref])[0]
            return weights_ref, version
        refs = [w.weights.options(num_returns=2).remote() for w in self.workers]
        version = self._get([v for v, _ in refs])[0]
        return refs[0][1], version

    def publish_buckets(self, bucket_mb: float = 256.0) -> Buckets:
        """The weights in buckets in the object store, every rank sending its share (see `fleet.weight_sync`)."""
        return publish_buckets(self.workers, self.bucket_plans(bucket_mb), self._version)

    def bucket_plans(self, bucket_mb: float = 256.0) -> list[SenderPlan]:
        """Every rank's share of the weights cut into buckets, for `publish_buckets` or a `GroupSync`
        (`GroupSync(group.workers, engines).send(group.bucket_plans(mb), group.version)`)."""
        return self._get([w.bucket_plan.remote(bucket_mb) for w in self.workers])

    def save(self, path: str) -> None:
        """A full checkpoint (weights, optimizer, version) in `path`: rank 0 writes it (see `Trainer.save`); with
        a sharded backend every rank writes its shards and rank 0 the consolidated weights (`TrainerWorker.save`)."""
        if not self.sharded:
            self._get([self.workers[0].save.remote(path, "")])
            return
        path = storage.absolute(path)
        self._get([w.save.remote(path, f".tmp-{os.getpid()}") for w in self.workers])

    def load(self, path: str) -> None:
        """Every worker resumes from `path`, which all of them must be able to read (or a URL)."""
        versions = self._get([w.load.remote(path) for w in self.workers])
        self._version = versions[0]

    def shutdown(self) -> None:
        for w in self.workers:
            try:
                ray.kill(w)
            except Exception:  # already gone
                pass
        self._broken = self._broken or "the group was shut down"

    def _get(self, refs: list[ray.ObjectRef]) -> list[Any]:
        """Results of one call per worker (refs[i] from rank i), failing fast on the first worker that fails."""
        if self._broken:
            raise TrainerWorkerError(
                f"this TrainerGroup is unusable ({self._broken}); start a new one from the "
                "last checkpoint: TrainerGroup(checkpoint=PATH, ...)"
            )
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(ready[0])
            except RayError as e:
                rank = rank_of[ready[0]]
                what = "died" if isinstance(e, RayActorError) else "failed"
                self._broken = f"trainer worker rank {rank} {what}"
                self.shutdown()
                raise TrainerWorkerError(
                    f"trainer worker rank {rank} of {len(self.workers)} {what} mid-step and the other workers cannot "
                    "continue without it: resume from the last checkpoint with a new "
                    "TrainerGroup(checkpoint=PATH, ...). "
                    f"Cause: {type(e).__name__}: {e}"
                ) from e
        return ray.get(list(refs))
