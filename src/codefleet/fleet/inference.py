"""Inference on Ray: engine actors and the client the agent loop uses to reach them.

    engines = start_engines(checkpoint_dir, n=1, num_cpus=1)
    policy = LocalEnginePolicy(engine=RemoteEngine(engines[0]), ...).for_episode()

`EngineActor` is a thin async actor around `codefleet.inference.engine.Engine`
(continuous batching in the engine's own thread): `generate(prompt, params)`
awaits the engine's future, so every episode's turn joins the same decode
steps; `update_weights(weights, version)` lands between two decode steps and
in-flight turns simply continue under the new weights (each token keeps the
version that sampled it). Weights arrive either as one object from the Ray object
store (see `TrainerGroup.publish`), passed by reference so each engine reads
the shared copy, or in buckets (`receive_buckets`, see `fleet.weight_sync` and
`TrainerGroup.publish_buckets`), assembled in the actor and applied as one version.

An engine whose process dies is restarted by Ray (`max_restarts=-1`) with the arguments it was created
with; given `restart_from` (a file naming the newest checkpoint directory beside it, e.g. a run's
`checkpoints/LATEST`), a restarted engine loads that checkpoint and its `policy_version` instead of the
weights it started with, so it does not serve an old policy under a new version. `broadcast_weights`
waits for an engine that is restarting, up to a limit: one that is still not back (its node gone with no
room elsewhere) is left *away* and gets later broadcasts without being waited for; it loads the newest
checkpoint itself when it returns, and an update older than the weights it serves is ignored. An engine
dead for good (killed with `no_restart`, out of restarts) is told apart by `engine_gone` and left out.
Rollout workers route episodes around both.

The checkpoint, and `restart_from`, may be fsspec URLs (a run directory on object storage,
codefleet.store.storage): an engine reads LATEST and the checkpoint's metadata at the URL and loads the
weights from its node's `storage.local_copy`.

`RemoteEngine` gives a rollout worker the slice of the Engine API that
`LocalEnginePolicy` uses (`submit(...).result()`, `max_seq_len`,
`tokenizer`; a dead actor raises `EngineDiedError`), so the policy client is the same code in process and on Ray;
an episode holds one RemoteEngine, so all its turns go to the same engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid

import ray
import torch
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError

from codefleet.contracts import ENGINES
from codefleet.fleet.fleet_config import EngineConfig
from codefleet.fleet.gpus import actor_options, check_gpus
from codefleet.fleet.weight_sync import BucketReceiver, Buckets, GroupReceiver, receive_buckets
from codefleet.model.checkpoint import CONFIG_FILE, METADATA_FILE
from codefleet.store import storage
from codefleet.types import Failure


def _as_tensors(weights: dict) -> dict[str, torch.Tensor]:
    return {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in weights.items()}


@ray.remote(max_restarts=-1, max_task_retries=0)
class EngineActor:
    def __init__(
        self,
        checkpoint: str,
        max_batch: int = 32,
        max_seq_len: int | None = None,
        threads: int = 1,
        version: int = 0,
        restart_from: str | None = None,
        backend: str = "codefleet",
        record_routing: bool = True,
        num_gpus: float = 0.0,
    ):
        torch.set_num_threads(threads)
        if restart_from and ray.get_runtime_context().was_current_actor_reconstructed:
            checkpoint, version = newest_checkpoint(restart_from) or (checkpoint, version)
        # on a GPU (Ray set CUDA_VISIBLE_DEVICES to it) vLLM picks the device and sizes its memory to the share
        gpu = {"gpu_share": num_gpus} if num_gpus > 0 else {}
        if gpu and not torch.cuda.is_available():
            raise RuntimeError(
                f"this engine was given GPU {ray.get_gpu_ids()} but torch {torch.__version__} here "
                "cannot use it: install the GPU builds of torch and vllm on the GPU nodes "
                "(scripts/setup_vllm.sh does on a machine with an NVIDIA GPU)"
            )
        self.engine = ENGINES.get(backend).load(
            storage.local_copy(checkpoint),
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            record_routing=record_routing,
            **gpu,
        )
        self.engine.version = version
        self.receiver = BucketReceiver()  # staging for bucketed updates, allocated by the first
        self.receiving = asyncio.Lock()  # one bucketed update at a time (they share the staging)
        self.group_receiver = GroupReceiver()  # weight sync over process groups (GroupSync), once joined
        self.apply_s = 0.0

    async def generate(self, prompt: list[int], params):
        return await asyncio.wrap_future(self.engine.submit(prompt, params))

    async def update_weights(self, weights_ref: list, version: int) -> int:
        """`weights_ref` is `[ObjectRef]` (a list, so Ray passes the reference, not a copy per call), or one ref per
        shard of the state dict. An update older than the weights served (sent while this engine restarted from a
        newer checkpoint) is ignored."""
        if version < self.engine.version:
            return self.engine.version
        weights = {}
        for ref in weights_ref:  # one whole state dict, or one shard per sender
            weights.update(_as_tensors(await ref))
        await self._apply(weights, version)
        return self.engine.version

    async def receive_buckets(self, plans: list, refs: list, version: int) -> int:
        """One version in buckets (`fleet.weight_sync.Buckets`: a plan and a list of bucket refs per sender),
        applied with one `engine.update_weights` once every bucket is in; older than the weights served: ignored."""
        async with self.receiving:
            if version < self.engine.version:
                return self.engine.version
            try:
                await self._apply(await receive_buckets(self.receiver, plans, refs), version)
            finally:
                self.receiver.release()
            return self.engine.version

    async def join_sync_group(
        self, sender: int, address: str, rank: int, world: int, backend: str, timeout_s: float
    ) -> None:
        """Join sender `sender`'s weight-sync group (`fleet.weight_sync.GroupSync`), replacing an older one."""
        await asyncio.get_running_loop().run_in_executor(
            None, self.group_receiver.join, sender, address, rank, world, backend, timeout_s
        )

    def abort_sync_group(self, version: int) -> None:
        """The driver gave up on `version` over the sync groups: stop waiting for it (`GroupReceiver.abort`)."""
        self.group_receiver.abort(version)

    async def receive_sync_group(self, plans: list, version: int) -> int:
        """One version broadcast over the sync groups (every engine takes part, even one whose weights are newer,
        or the senders would wait), applied like `receive_buckets`."""
        async with self.receiving:
            loop = asyncio.get_running_loop()
            device = "cuda" if ray.get_gpu_ids() else "cpu"
            flats = await loop.run_in_executor(None, self.group_receiver.receive, plans, version, device)
            if version < self.engine.version:
                return self.engine.version
            try:
                self.receiver.begin(plans)
                for plan, buckets in zip(plans, flats, strict=True):
                    for bucket, flat in zip(plan.buckets, buckets, strict=True):
                        self.receiver.add(bucket, flat)
                await self._apply(self.receiver.state_dict(), version)
            finally:
                self.receiver.release()
            return self.engine.version

    async def _apply(self, weights: dict, version: int) -> None:
        """`Engine.update_weights`, timed (`info()["apply_s"]`: staging, the wait for the running step and the
        swap; `info()["pause_s"]`: the part of it during which no step ran, i.e. how long in-flight requests were
        paused by the last update)."""
        start = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(None, self.engine.update_weights, weights, version)
        self.apply_s = time.perf_counter() - start

    async def sleep(self) -> None:
        """Stop stepping until `wake` (colocated with a trainer worker: `fleet.placement`); requests wait."""
        await asyncio.get_running_loop().run_in_executor(None, self.engine.sleep)

    def wake(self) -> None:
        self.engine.wake()

    def info(self) -> dict:
        return {
            "version": self.engine.version,
            "max_seq_len": self.engine.max_seq_len,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "running": self.engine.n_running,
            "prefill_tokens": self.engine.prefill_tokens_computed,
            "prefix_hits": self.engine.prefix_hits,
            "prefix_tokens_reused": self.engine.prefix_tokens_reused,
            "apply_s": self.apply_s,
            "pause_s": self.engine.pause_s,
            "placement_group": ray.get_runtime_context().get_placement_group_id(),
        }


def newest_checkpoint(latest_file: str) -> tuple[str, int] | None:
    """(directory, policy version) of the checkpoint `latest_file` names (beside it), or None if there is none.
    A path or a URL, read where it is."""

    try:
        path = storage.join(storage.parent(latest_file), storage.read_bytes(latest_file).decode().strip())
        if not storage.exists(storage.join(path, CONFIG_FILE)):
            return None
    except (OSError, UnicodeDecodeError):
        return None
    try:
        metadata = json.loads(storage.read_bytes(storage.join(path, METADATA_FILE)))
    except FileNotFoundError:  # as checkpoint.read_metadata: no metadata, version 0
        metadata = {}
    return path, int(metadata.get("policy_version", 0))


class EngineDiedError(RuntimeError):
    """The engine actor serving this episode died (an infrastructure failure, not the agent's)."""

    failure = Failure.ENGINE_DIED


class EngineFailedError(RuntimeError):
    """The engine actor is alive but failed this request (an engine step raised: infrastructure, not the
    agent's doing)."""

    failure = Failure.ENGINE_FAILED


class _RefFuture:
    def __init__(self, ref: ray.ObjectRef):
        self.ref = ref

    def result(self, timeout: float | None = None):
        try:
            return ray.get(self.ref, timeout=timeout)
        except RayActorError as e:
            raise EngineDiedError(f"the engine actor died: {e}") from e
        except RayTaskError as e:
            raise EngineFailedError(f"the engine failed the request: {e}") from e


class RemoteEngine:
    """The part of the Engine API a LocalEnginePolicy needs, over an EngineActor."""

    def __init__(self, actor, tokenizer, max_seq_len: int):
        self.actor, self.tokenizer, self.max_seq_len = actor, tokenizer, max_seq_len

    def submit(self, prompt: list[int], params) -> _RefFuture:
        return _RefFuture(self.actor.generate.remote(prompt, params))


def start_engines(
    checkpoint: str,
    n: int = 1,
    *,
    num_cpus: float = 1.0,
    resources: dict | None = None,
    threads: int = 1,
    max_batch: int = 32,
    max_seq_len: int | None = None,
    version: int = 0,
    restart_from: str | None = None,
    backend: str = EngineConfig.backend,
    record_routing: bool = True,
    num_gpus: float = EngineConfig.gpus,
    placement: list | None = None,
) -> list:
    """`n` engine actors over `checkpoint`, placed by logical resources and `num_gpus` GPUs each (a share of one,
    e.g. 0.5; `fleet.gpus`); waits until they are up. A restarted engine loads the checkpoint `restart_from`
    names, if any (see the module docstring). `backend` names the engine (codefleet.contracts.ENGINES);
    `record_routing=False` when routing replay is off (a backend that cannot report routed experts refuses an MoE
    model otherwise). `placement`: a scheduling strategy per engine (`fleet.placement.Placement.engines`)."""
    engine = ENGINES.get(backend)  # an unknown name fails here, in one sentence, not in every actor
    if num_gpus > 0 and not engine.gpu:
        raise ValueError(
            f"the {backend} engine runs on CPU only but {num_gpus:g} GPU per engine was asked for: use "
            "engine.backend=vllm on GPUs, or engine.gpus=0"
        )
    check_gpus({f"{n} engines x {num_gpus:g} GPU": n * num_gpus})
    options = dict(**actor_options(num_cpus, resources, num_gpus), max_concurrency=1000)
    if engine.omp_threads_from_env:
        # OpenMP's thread count is per thread and starts from OMP_NUM_THREADS (Ray sets 1): vLLM's CPU attention
        # checks that the thread running a step has as many as the one that set it up, so every thread gets `threads`
        options["runtime_env"] = {"env_vars": {"OMP_NUM_THREADS": str(threads)}}
    strategies = placement or [None] * n
    if len(strategies) != n:
        raise ValueError(f"{len(strategies)} placements for {n} engines")
    prefix = f"codefleet-engine-{uuid.uuid4().hex[:8]}"  # named: rollout workers find them by name (fleet.rollouts)
    actors = [
        EngineActor.options(
            **options, name=f"{prefix}-{i}", **({"scheduling_strategy": where} if where else {})
        ).remote(
            checkpoint,
            max_batch=max_batch,
            max_seq_len=max_seq_len,
            threads=threads,
            version=version,
            restart_from=restart_from,
            backend=backend,
            record_routing=record_routing,
            num_gpus=num_gpus,
        )
        for i, where in enumerate(strategies)
    ]
    ray.get([a.info.remote() for a in actors])
    return actors


def actor_names(actors: list) -> list[str]:
    """The names of these actors in this job's namespace (start_engines names every engine), in order. ValueError
    names an actor without one."""
    named = {}
    for name in ray.util.list_named_actors():
        with contextlib.suppress(ValueError):  # gone since it was listed
            named[ray.get_actor(name)] = name
    missing = [a for a in actors if a not in named]
    if missing:
        raise ValueError(
            f"{missing[0]} has no name in this job's namespace; start engines with start_engines, "
            "which names them, or give the actor a name"
        )
    return [named[a] for a in actors]


def engine_state(engine, timeout_s: float = 30.0) -> str:
    """What one call to the engine actor finds: "up" if it answers within `timeout_s`, "gone" if it is dead for
    good (the call raises ActorDiedError), else "away" (Ray is restarting it: calls wait until it is back, which
    may be never if its node is gone and no other has room). A call in flight when the process died raises
    ActorUnavailableError if a restart follows and ActorDiedError if none does, but a fresh call is the answer
    that does not depend on timing."""
    try:
        ray.get(engine.info.remote(), timeout=timeout_s)
    except ActorDiedError:
        return "gone"
    except (RayActorError, GetTimeoutError):
        return "away"
    return "up"


def engine_gone(engine, timeout_s: float = 30.0) -> bool:
    return engine_state(engine, timeout_s) == "gone"


def broadcast_weights(
    engines: list,
    weights_ref: ray.ObjectRef | Buckets,
    version: int,
    timeout_s: float = 300.0,
    away: dict | None = None,
) -> tuple[list, dict]:
    """Load `weights_ref` into the engines (in parallel) and wait until they serve `version`: (serving, away).
    `weights_ref` is one state dict in the object store (`TrainerGroup.publish`) or `Buckets`
    (`TrainerGroup.publish_buckets`); either way the driver holds references only.

    An engine that dies and is restarted meanwhile is sent the weights again once it is back. One that has not
    taken them after `timeout_s` (restarting with no room on the cluster) is *away*: `away` maps it to a call
    that returns once it is back. Pass `away` in next time: an engine still away is neither sent the weights nor
    waited for (when it returns it loads the newest checkpoint itself), one that is back is sent them again.
    One dead for good (`engine_gone`) is left out of both. Raises EngineDiedError when no engine serves `version`."""
    deadline = time.monotonic() + timeout_s
    away = {e: probe for e, probe in (away or {}).items() if not ray.wait([probe], timeout=0)[0]}
    serving, pending = [], [e for e in engines if e not in away]
    while pending:
        if isinstance(weights_ref, Buckets):
            refs = [e.receive_buckets.remote(weights_ref.plans, weights_ref.refs, version) for e in pending]
        else:
            refs = [e.update_weights.remote([weights_ref], version) for e in pending]
        retry = []
        for engine, ref in zip(pending, refs, strict=True):
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
                serving.append(engine)
            except GetTimeoutError:
                away[engine] = engine.info.remote()
            except RayActorError:
                if engine_gone(engine):
                    continue
                if time.monotonic() >= deadline:
                    away[engine] = engine.info.remote()
                else:
                    retry.append(engine)
        pending = retry
        if pending:
            time.sleep(0.5)
    if not serving:
        raise EngineDiedError(
            f"no engine took policy version {version}: of {len(engines)}, {len(away)} are "
            f"restarting with no room on the cluster (or stuck) and the rest are dead for good; "
            "resume the run once the cluster has room"
        )
    return [e for e in engines if e in serving], {e: away[e] for e in engines if e in away}
