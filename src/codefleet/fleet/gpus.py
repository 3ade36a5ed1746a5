"""GPUs for the engine and trainer actors: what they ask Ray for, whether the cluster has it, which device a
trainer worker runs on.

    check_gpus({"4 engines x 1 GPU": 4.0, "4 trainer workers x 1 GPU": 4.0})   # before any actor starts
    options = actor_options(num_cpus=1.0, resources={"engine_node": 1}, num_gpus=0.5)
    device = actor_device()                  # inside an actor: cuda (the GPU Ray gave it) or cpu

Ray schedules GPUs as the `num_gpus` actor option (it refuses a "GPU" entry in `resources`) and sets
`CUDA_VISIBLE_DEVICES` in the actor to the GPUs it was given, so the actor sees them as cuda:0, cuda:1, ...
A share below 1 (0.5: two actors on one GPU) is Ray's bookkeeping only; the actors must fit their memory
themselves (vLLM's `gpu_memory_utilization` follows the engine's share). One actor uses at most one GPU:
the engine has no tensor parallelism and a trainer worker is one rank.

An actor asking for more GPUs than the cluster has waits for them forever; `check_gpus` turns that into
one sentence before anything starts. With 0 GPUs everything stays on CPU exactly as before: the options
carry no `num_gpus` and the workers use gloo.
"""

from __future__ import annotations

import ray
import torch


def actor_options(num_cpus: float, resources: dict[str, float] | None, num_gpus: float = 0.0) -> dict:
    """Ray actor options placing one actor by logical resources, with `num_gpus` (0 to 1) when it is positive."""
    if not 0 <= num_gpus <= 1:
        raise ValueError(
            f"num_gpus={num_gpus}: an engine or trainer actor uses one GPU at most (no tensor "
            "parallelism); give it a share between 0 and 1, and more actors for more GPUs"
        )
    options: dict = {"num_cpus": num_cpus, "resources": dict(resources or {})}
    if num_gpus > 0:
        options["num_gpus"] = num_gpus
    return options


def check_gpus(wanted: dict[str, float]) -> None:
    """Raise ValueError unless the Ray cluster has at least as many GPUs as `wanted` adds up to (its keys say who
    wants them, e.g. "4 engines x 1 GPU"). Call it before starting the actors: they would wait forever."""
    total = sum(wanted.values())
    if total <= 0:
        return
    have = float(ray.cluster_resources().get("GPU", 0))
    if total > have + 1e-9:
        who = " + ".join(f"{name} ({n:g})" for name, n in wanted.items() if n > 0)
        raise ValueError(
            f"this run asks for {total:g} GPUs ({who}) but the Ray cluster has {have:g}: add GPU nodes, "
            "or lower engine.gpus / trainer.gpus (0 runs on CPU)"
        )


def actor_device() -> torch.device:
    """The device of the calling Ray actor: its first GPU if Ray gave it any (cuda, as CUDA_VISIBLE_DEVICES maps
    it), else cpu. Raises if Ray gave it a GPU that this process's torch cannot use."""
    if not ray.get_gpu_ids():
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"Ray gave this actor GPU {ray.get_gpu_ids()} but torch {torch.__version__} here cannot "
            "use it (a CPU build, or no driver): install the CUDA build of torch on the GPU nodes "
            "(scripts/gpu_check.sh makes such an environment)"
        )
    return torch.device("cuda", torch.cuda.current_device())
