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

Checkpoints: a path must be readable by every worker (a shared filesystem on a
cluster); rank 0 writes it. A checkpoint may also be an fsspec URL
(`s3://bucket/run/checkpoints/sft`, codefleet.store.storage), for a cluster
whose nodes share nothing else: every worker reads its node's
`storage.local_copy` (downloaded once per node), and the writers write into
`storage.staged_dir`, a local directory uploaded to the URL before `save`
returns. A sharded save then has every rank write its DCP shards into a
directory of its own node and upload them, rank 0 with the `.metadata` and the
whole weights, so the URL holds the union a shared filesystem would. A run
directory may be prepared by someone else: the sharded save's temporary
directory (a predictable name beside the checkpoint) is made afresh through
codefleet.store.safe_files before any rank writes (`fresh_dir`), and renamed
without following links.

GPUs: a worker given one builds its trainer on it (`cuda`, the GPU Ray gave
the actor), its batches go there, and the process group uses NCCL; weights
leave it as CPU tensors (`publish`, buckets). Several workers need a whole GPU
each (NCCL refuses two ranks on one GPU), and a group asking for more GPUs than
the cluster has is refused before any worker starts. With no GPU nothing
changes: CPU and gloo.

Weight publication: `publish()` has rank 0 return its state dict as one
object in the Ray object store. It is the return value of an actor call, so
the driver owns it (it outlives the worker, unlike an actor's `ray.put`). The
tensors travel as numpy arrays (`_SharedWeights`), which Ray stores as raw
out-of-band buffers; `ray.get` on any process of the node rebuilds a
`dict[str, Tensor]` whose tensors are views of the shared-memory object
(zero-copy, read-only: `Engine.update_weights` copies them into its model).
`publish_buckets()` instead has every rank send its share of the tensors (split by bytes) as flat buckets of
`bucket_mb`, one object each (`fleet.weight_sync`), for `broadcast_weights` to hand to the engines.

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

import json
import os
import socket
import time
import warnings
from dataclasses import asdict
from datetime import timedelta
from typing import Any

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError, RayError

from codefleet.contracts import TRAINERS
from codefleet.fleet.fleet_config import TrainerWorkersConfig
from codefleet.fleet.gpus import actor_device, actor_options, check_gpus
from codefleet.fleet.weight_sync import (
    Buckets,
    BucketSender,
    GroupSender,
    SenderPlan,
    publish_buckets,
    specs_of,
    split_names,
)
from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.rl.batch import Sample
from codefleet.rl.sharded import ShardedTrainer
from codefleet.rl.trainer import Example, TrainConfig, check_examples, check_samples, has_signal, loss_units, sft_units
from codefleet.store import safe_files, storage

SHARDED_STATE = "sharded"  # a sharded backend's checkpoint: its DCP state (for resuming) in this subdirectory
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


def is_sharded(backend: str) -> bool:
    """Whether TRAINERS' `backend` is a sharded trainer (`rl.sharded`): built, saved and read by all ranks at once."""
    return TRAINERS.get(backend).sharded


def fresh_dir(path: str) -> None:
    """The empty directory `path` (a checkpoint's temporary sibling, whose name is predictable): whatever is there
    is removed first, a link as the link itself, and `path` is made through safe_files, with no link below its
    parent followed. Rank 0 does it before the first barrier of the save, so no rank writes into a planted link;
    the sharded trainer's own save then prepares its directory inside the same way (rl.sharded)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    safe_files.remove_beneath(parent, path, ignore_errors=True)
    safe_files.makedirs_beneath(parent, path)


def _save_whole(trainer: ShardedTrainer, state: dict[str, torch.Tensor], path: str) -> None:
    """A sharded trainer's gathered weights as a normal checkpoint (`checkpoint.save`: HF when it came from HF).
    (Outside `TrainerWorker.save`: cloudpickle would ship `torch.distributed.config` with a method that reads
    both `dist` and an attribute named `config`.)"""
    model = Transformer(trainer.model.config, init_weights=False)
    model.load_state_dict(state)
    checkpoint.save(
        model,
        path,
        metadata={"policy_version": trainer.version, "train_config": json.loads(json.dumps(asdict(trainer.config)))},
    )


# ---- zero-copy weights through the object store ---------------------------------------


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    try:
        return t.numpy()
    except TypeError:  # bfloat16, float8: carried as integers of the same width
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]).numpy()


def _rebuild_weights(names: list[str], arrays: list[np.ndarray], dtypes: list[str]) -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():  # the object store's buffers are read-only; nobody writes to them
        warnings.simplefilter("ignore", UserWarning)
        return {n: torch.from_numpy(a).view(getattr(torch, d)) for n, a, d in zip(names, arrays, dtypes)}


class _SharedWeights:
    """A state dict that pickles as numpy arrays (out-of-band buffers in Ray) and unpickles as tensors."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def __reduce__(self):
        names = list(self.state)
        return (
            _rebuild_weights,
            (
                names,
                [_as_numpy(self.state[n]) for n in names],
                [str(self.state[n].dtype).removeprefix("torch.") for n in names],
            ),
        )


# ---- the worker actor ------------------------------------------------------------------


@ray.remote
class TrainerWorker:
    """One data-parallel rank: a `Trainer` plus the collectives around its step."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        checkpoint: str | None,
        model_config: ModelConfig | None,
        config: TrainConfig,
        threads: int,
        backend: str,
    ):
        torch.set_num_threads(threads)
        self.device = actor_device()  # the GPU Ray gave this worker, else cpu
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.rank, self.world_size, self.config = rank, world_size, config
        self.backend = backend
        self.sharded = is_sharded(backend)
        self.start = (checkpoint, model_config)
        if self.sharded:  # its construction is a collective: built in init_distributed
            self.snapshot: dict[str, torch.Tensor] = {}  # the whole weights gathered for the bucket sender
            self.sender = BucketSender(lambda: self.snapshot)
        else:
            self.trainer = self._build(checkpoint, model_config)
            self.sender = BucketSender(lambda: self.trainer.model.state_dict())  # live, on its device
        self.group_sender = GroupSender(self.sender, self.device)

    def _build(self, checkpoint: str | None, model_config: ModelConfig | None):
        cls = TRAINERS.get(self.backend)
        if checkpoint is None:
            torch.manual_seed(self.config.seed)
            return cls(Transformer(model_config).to(self.device), self.config)
        checkpoint = storage.local_copy(checkpoint)  # a URL: this node's copy
        state = os.path.join(checkpoint, SHARDED_STATE)
        return cls.load(state if self.sharded and os.path.isdir(state) else checkpoint, self.config, device=self.device)

    def rendezvous(self) -> str:
        """A tcp:// address on this node with a free port, for the others to join."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def init_distributed(self, init_method: str, timeout_s: float) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            init_method=init_method,
            world_size=self.world_size,
            rank=self.rank,
            timeout=timedelta(seconds=timeout_s),
        )
        if self.sharded:  # broadcasts rank 0's weights itself
            self.trainer = self._build(*self.start)
            return
        for t in self.trainer.model.state_dict().values():  # rank 0's weights everywhere
            dist.broadcast(t, src=0)

    def version(self) -> int:
        return self.trainer.version

    def where(self) -> dict:
        """Where this rank runs: node, placement group (None outside one), device."""
        context = ray.get_runtime_context()
        return {
            "node_id": context.get_node_id(),
            "placement_group": context.get_placement_group_id(),
            "device": str(self.device),
        }

    def device_info(self) -> dict:
        """Where this rank runs: its device, the GPU's name and the peak GPU memory its tensors took (GB)."""
        cuda = self.device.type == "cuda"
        return {
            "device": str(self.device),
            "name": torch.cuda.get_device_name(self.device) if cuda else "cpu",
            "peak_mem_gb": torch.cuda.max_memory_allocated(self.device) / 1e9 if cuda else None,
        }

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        return self.trainer.logprobs(samples)

    def sft_step(self, examples: list[Example], total_tokens: int) -> dict[str, float]:
        metrics = self.trainer.forward_backward(examples, "sft", total_tokens)
        return {**metrics, **self._reduce_and_step()}

    def rl_step(self, samples: list[Sample], total_units: int) -> dict[str, float]:
        metrics = self.trainer.forward_backward(samples, "rl", total_units)
        return {**metrics, **self._reduce_and_step()}

    def skip_step(self) -> dict[str, float]:
        return self.trainer.skip_step()

    def _reduce_and_step(self) -> dict[str, float]:
        if self.world_size > 1 and not self.sharded:  # a sharded trainer sums in its backward
            self.trainer.all_reduce(dist.all_reduce)
        return self.trainer.optim_step()

    def weights(self) -> tuple[int, _SharedWeights | None]:
        """The whole weights; a sharded trainer gathers them on every rank (a collective), rank 0 returns them."""
        # serialised into the object store as this call returns, before the next step can change the parameters
        state = self.trainer.weights(clone=False)
        return self.trainer.version, None if self.sharded and self.rank else _SharedWeights(state)

    def bucket_plan(self, bucket_mb: float) -> SenderPlan:
        """This rank's share of the tensors (`split_names` over the ranks), cut into buckets. A sharded trainer
        first gathers the whole weights on every rank (a collective), which its buckets are then read from."""
        if self.sharded:
            self.snapshot = self.trainer.weights(clone=False)
        share = split_names(specs_of(self.sender.weights()), self.world_size)[self.rank]
        return self.sender.plan(share, bucket_mb)

    def bucket(self, index: int):
        return self.sender.bucket(index)

    def sync_group_address(self, timeout_s: float) -> tuple[str, str]:
        """This rank's weight-sync group with the engines (`fleet.weight_sync.GroupSync`): its rendezvous."""
        return self.group_sender.address(timeout_s)

    def join_sync_group(self, world: int, backend: str, timeout_s: float) -> None:
        self.group_sender.join(world, backend, timeout_s)

    def send_sync_group(self) -> int:
        """Broadcast the buckets of the last `bucket_plan` to the engines."""
        return self.group_sender.send()

    def save(self, path: str, tmp_suffix: str) -> None:
        """The dp trainer: rank 0 writes `path`. A sharded one: every rank writes its shards into
        `TMP/SHARDED_STATE` (what a resume reads; TMP is the directory's name + `tmp_suffix`), then rank 0 the
        whole weights gathered from every rank into TMP (a normal, or HF, checkpoint that engines and
        `checkpoint.load` read) and renames TMP to `path`. (`rl.sharded.consolidate` would read the shards back,
        but DCP inside a process group is a collective.) A URL `path`: each rank writes into a directory of its
        own node, uploaded when it is done (module docstring); rank 0 clears the URL before the first barrier."""
        last = (checkpoint.CONFIG_FILE,)
        if not self.sharded:
            with storage.staged_dir(path, last=last) as local:
                self.trainer.save(local)
            return
        with storage.staged_dir(path, replace=self.rank == 0, last=last) as local:
            tmp = local + tmp_suffix
            if self.rank == 0:
                fresh_dir(tmp)
            self.trainer.save(os.path.join(tmp, SHARDED_STATE))  # collectives, with barriers
            state = self.trainer.weights(clone=False)  # a collective too
            if self.rank == 0:
                _save_whole(self.trainer, state, tmp)
                checkpoint.swap_in(tmp, local, f"{local}.old-{os.getpid()}")  # as Trainer.save
            dist.barrier()
            # not rank 0's disk (a URL's staging): this rank's shards are its part
            if os.path.isdir(tmp) and not os.path.islink(tmp):
                safe_files.replace_beneath(os.path.dirname(os.path.abspath(local)), tmp, local)

    def load(self, path: str) -> int:
        self.trainer = self._build(path, None)
        return self.trainer.version


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
