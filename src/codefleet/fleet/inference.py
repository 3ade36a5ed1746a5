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

`RemoteEngine` gives a rollout worker the slice of the Engine API that
`LocalEnginePolicy` uses (`submit(...).result()`, `max_seq_len`,
`tokenizer`; a dead actor raises `EngineDiedError`), so the policy client is the same code in process and on Ray;
an episode holds one RemoteEngine, so all its turns go to the same engine.
"""

from __future__ import annotations

import asyncio
import os

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError


def _as_tensors(weights: dict) -> dict[str, torch.Tensor]:
    return {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in weights.items()}


@ray.remote(max_restarts=-1, max_task_retries=0)
class EngineActor:
    def __init__(self, checkpoint: str, max_batch: int = 32, max_seq_len: int | None = None, threads: int = 1,
                 version: int = 0):
        from codefleet.model.engine import load_engine

        torch.set_num_threads(threads)
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
                  threads: int = 1, max_batch: int = 32, max_seq_len: int | None = None, version: int = 0) -> list:
    """`n` engine actors over `checkpoint`, placed by logical resources; waits until they are up."""
    actors = [EngineActor.options(num_cpus=num_cpus, resources=resources or {}, max_concurrency=1000).remote(
        checkpoint, max_batch=max_batch, max_seq_len=max_seq_len, threads=threads, version=version) for _ in range(n)]
    ray.get([a.info.remote() for a in actors])
    return actors


def broadcast_weights(engines: list, weights_ref: ray.ObjectRef, version: int, timeout_s: float = 300.0) -> None:
    """Load `weights_ref` into every engine (in parallel) and wait until all serve `version`."""
    ray.get([e.update_weights.remote([weights_ref], version) for e in engines], timeout=timeout_s)
