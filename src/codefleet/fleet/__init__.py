"""The Ray layer, and the only package (with the top-floor commands) that imports Ray.

    sandbox_fleet, sandbox_host  one `SandboxHost` actor per node, `SandboxFleet` to reach them
    controller, controller_api   the asynchronous RL controller (groups of attempts streamed under a staleness
                                 bound while the trainer steps), its config and the reports it gives back
    controller_attempts          what the controller keeps of attempts in flight, and how it cancels one
    staleness                    the controller's pure core: admission by staleness bound, group assembly, the
                                 rollout buffer
    inference                    engine actors (codefleet or vLLM) and the client the agent loop uses
    rollouts                     rollout workers running the agent harness
    trainer_group                the trainer workers (data-parallel, FSDP2, expert-parallel) as one group
    trainer_worker               one worker: its trainer, its checkpoints and the weights it hands out
    weight_sync                  weights from trainer to engines, in buckets
    placement, gpus, ray_init    placement groups, GPUs, starting or joining Ray
    fleet_config                 the configs of the Ray cluster and of these actors (how many, what each takes,
                                 where), loaded without Ray or torch

The training application that composes these (`codefleet train` and `codefleet eval`) is `codefleet.recipe`.
Names are imported lazily, so the pure modules (e.g. `codefleet.fleet.staleness`) load without importing Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "AttemptResult": "codefleet.fleet.controller",
    "Controller": "codefleet.fleet.controller",
    "ControllerConfig": "codefleet.fleet.controller",
    "GroupRunner": "codefleet.fleet.controller",
    "RunReport": "codefleet.fleet.controller",
    "StepReport": "codefleet.fleet.controller",
    "TrainerClient": "codefleet.fleet.controller",
    "RemoteSandbox": "codefleet.fleet.sandbox_fleet",
    "SandboxFleet": "codefleet.fleet.sandbox_fleet",
    "HostCore": "codefleet.fleet.sandbox_host",
    "HostStats": "codefleet.fleet.sandbox_host",
    "SandboxCapacityError": "codefleet.fleet.sandbox_host",
    "SandboxHost": "codefleet.fleet.sandbox_host",
    "EngineActor": "codefleet.fleet.inference",
    "RemoteEngine": "codefleet.fleet.inference",
    "AgentGroupRunner": "codefleet.fleet.rollouts",
    "RolloutWorker": "codefleet.fleet.rollouts",
    "TrainerGroup": "codefleet.fleet.trainer_group",
    "TrainerWorker": "codefleet.fleet.trainer_worker",
    "TrainerWorkerError": "codefleet.fleet.trainer_group",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'codefleet.fleet' has no attribute {name!r}")
