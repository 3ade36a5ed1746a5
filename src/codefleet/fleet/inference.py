"""Inference on Ray: engine actors and the client the agent loop uses to reach them.

    engines = start_engines(checkpoint_dir, n=1, num_cpus=1)
    policy = LocalEnginePolicy(engine=RemoteEngine(engines[0]), ...).for_episode()

`EngineActor` is a thin async actor around `codefleet.model.engine.Engine`
(continuous batching in the engine's own thread): `generate(prompt, params)`
awaits the engine's future, so every episode's turn joins the same decode
steps; `update_weights(weights, version)` lands between two decode steps and
in-flight turns simply continue under the new weights (each token keeps the
version that sampled it). Weights arrive as one object from the Ray object
store (see `TrainerGroup.publish`), passed by reference so each engine reads
the shared copy.

An engine whose process dies is restarted by Ray (`max_restarts=-1`) with the arguments it was created
with; given `restart_from` (a file naming the newest checkpoint directory beside it, e.g. a run's
`checkpoints/LATEST`), a restarted engine loads that checkpoint and its `policy_version` instead of the
weights it started with, so it does not serve an old policy under a new version. `broadcast_weights`
waits for an engine that is restarting. An engine dead for good (killed with `no_restart`, its node gone
with no room elsewhere, out of restarts) is told apart by `engine_gone`: the broadcast leaves it out and
returns the engines that remain, and rollout workers stop routing episodes to it.

`RemoteEngine` gives a rollout worker the slice of the Engine API that
`LocalEnginePolicy` uses (`submit(...).result()`, `max_seq_len`,
`tokenizer`; a dead actor raises `EngineDiedError`), so the policy client is the same code in process and on Ray;
an episode holds one RemoteEngine, so all its turns go to the same engine.
"""

from __future__ import annotations

import asyncio
import os
import time

import ray
import torch
from ray.exceptions import ActorDiedError, GetTimeoutError, RayActorError, RayTaskError


def _as_tensors(weights: dict) -> dict[str, torch.Tensor]:
    return {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in weights.items()}


@ray.remote(max_restarts=-1, max_task_retries=0)
class EngineActor:
    def __init__(self, checkpoint: str, max_batch: int = 32, max_seq_len: int | None = None, threads: int = 1,
                 version: int = 0, restart_from: str | None = None):
        from codefleet.model.engine import load_engine

        torch.set_num_threads(threads)
        if restart_from and ray.get_runtime_context().was_current_actor_reconstructed:
            checkpoint, version = newest_checkpoint(restart_from) or (checkpoint, version)
        self.engine = load_engine(checkpoint, max_batch=max_batch, max_seq_len=max_seq_len)
        self.engine.version = version

    async def generate(self, prompt: list[int], params):
        return await asyncio.wrap_future(self.engine.submit(prompt, params))

    async def update_weights(self, weights_ref: list, version: int) -> int:
        """`weights_ref` is `[ObjectRef]` (a list, so Ray passes the reference, not a copy per call)."""
        weights = _as_tensors(await weights_ref[0])
        await asyncio.get_running_loop().run_in_executor(None, self.engine.update_weights, weights, version)
        return self.engine.version

    def info(self) -> dict:
        return {"version": self.engine.version, "max_seq_len": self.engine.max_seq_len, "pid": os.getpid(),
                "node_id": ray.get_runtime_context().get_node_id(), "running": self.engine.n_running,
                "prefill_tokens": self.engine.prefill_tokens_computed, "prefix_hits": self.engine.prefix_hits,
                "prefix_tokens_reused": self.engine.prefix_tokens_reused}


def newest_checkpoint(latest_file: str) -> tuple[str, int] | None:
    """(directory, policy version) of the checkpoint `latest_file` names (beside it), or None if there is none."""
    from codefleet.model.checkpoint import CONFIG_FILE, read_metadata

    try:
        with open(latest_file) as f:
            path = os.path.join(os.path.dirname(latest_file), f.read().strip())
    except OSError:
        return None
    if not os.path.isfile(os.path.join(path, CONFIG_FILE)):
        return None
    return path, int(read_metadata(path).get("policy_version", 0))


class EngineDiedError(RuntimeError):
    """The engine actor serving this episode died (an infrastructure failure, not the agent's)."""


class EngineFailedError(RuntimeError):
    """The engine actor is alive but failed this request (an engine step raised: infrastructure, not the
    agent's doing)."""


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


def start_engines(checkpoint: str, n: int = 1, *, num_cpus: float = 1.0, resources: dict | None = None,
                  threads: int = 1, max_batch: int = 32, max_seq_len: int | None = None, version: int = 0,
                  restart_from: str | None = None) -> list:
    """`n` engine actors over `checkpoint`, placed by logical resources; waits until they are up. A restarted
    engine loads the checkpoint `restart_from` names, if any (see the module docstring)."""
    actors = [EngineActor.options(num_cpus=num_cpus, resources=resources or {}, max_concurrency=1000).remote(
        checkpoint, max_batch=max_batch, max_seq_len=max_seq_len, threads=threads, version=version,
        restart_from=restart_from) for _ in range(n)]
    ray.get([a.info.remote() for a in actors])
    return actors


def engine_gone(engine, timeout_s: float = 30.0) -> bool:
    """Whether the engine actor is dead for good: a call to it raises ActorDiedError. Calls to an engine that
    Ray is restarting wait until it is back, so one that answers, or is still coming back after `timeout_s`,
    is not gone. (A call in flight when the process died raises ActorUnavailableError if a restart follows and
    ActorDiedError if none does, but a fresh call is the one answer that does not depend on timing.)"""
    try:
        ray.get(engine.info.remote(), timeout=timeout_s)
    except ActorDiedError:
        return True
    except (RayActorError, GetTimeoutError):
        return False
    return False


def broadcast_weights(engines: list, weights_ref: ray.ObjectRef, version: int, timeout_s: float = 300.0) -> list:
    """Load `weights_ref` into every engine (in parallel) and wait until all serve `version`; returns the engines
    that do. An engine that dies and is restarted meanwhile is sent the weights again once it is back (until
    `timeout_s`); one dead for good (`engine_gone`) is left out. Raises EngineDiedError if none is left."""
    deadline = time.monotonic() + timeout_s
    pending, gone = list(engines), []
    while True:
        refs = [e.update_weights.remote([weights_ref], version) for e in pending]
        failed = []
        for engine, ref in zip(pending, refs):
            try:
                ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
            except GetTimeoutError:
                raise EngineDiedError(f"an engine did not take policy version {version} within {timeout_s:.0f} s: it "
                                      "is restarting with no room on the cluster, or stuck; resume the run once the "
                                      "cluster has room for it") from None
            except RayActorError:
                if engine_gone(engine):
                    gone.append(engine)
                elif time.monotonic() >= deadline:
                    raise
                else:
                    failed.append(engine)
        if not failed:
            break
        pending = failed
        time.sleep(0.5)
    live = [e for e in engines if not any(e is g for g in gone)]
    if not live:
        raise EngineDiedError(f"all {len(engines)} engines are dead for good; policy version {version} has no "
                              "engine to serve it: resume the run to start new ones")
    return live
