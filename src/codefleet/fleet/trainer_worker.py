"""One rank of a `TrainerGroup` (fleet/trainer_group.py, whose docstring tells how the ranks step together): the
`TrainerWorker` actor, with its `rl.trainer.Trainer` (or sharded trainer) and the collectives around its step, its
checkpoints and the weights it hands out.

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

Weight publication: `TrainerGroup.publish()` has rank 0 return its state dict as one
object in the Ray object store. It is the return value of an actor call, so
the driver owns it (it outlives the worker, unlike an actor's `ray.put`). The
tensors travel as numpy arrays (`_SharedWeights`), which Ray stores as raw
out-of-band buffers; `ray.get` on any process of the node rebuilds a
`dict[str, Tensor]` whose tensors are views of the shared-memory object
(zero-copy, read-only: `Engine.update_weights` copies them into its model).
`TrainerGroup.publish_buckets()` instead has every rank send its share of the tensors (split by bytes) as flat
buckets of `bucket_mb`, one object each (`fleet.weight_sync`), for `broadcast_weights` to hand to the engines.
"""

from __future__ import annotations

import json
import os
import socket
import warnings
from dataclasses import asdict
from datetime import timedelta

import numpy as np
import ray
import torch
import torch.distributed as dist

from codefleet.contracts import TRAINERS
from codefleet.fleet.gpus import actor_device
from codefleet.fleet.weight_sync import BucketSender, GroupSender, SenderPlan, specs_of, split_names
from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.rl.batch import Sample
from codefleet.rl.sharded import ShardedTrainer
from codefleet.rl.trainer import Example, TrainConfig
from codefleet.store import safe_files, storage

SHARDED_STATE = "sharded"  # a sharded backend's checkpoint: its DCP state (for resuming) in this subdirectory


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
