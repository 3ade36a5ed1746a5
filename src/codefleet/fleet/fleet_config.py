"""The configs of the fleet's actors, each read by one component: the Ray cluster a run starts or joins
(`ray_init`), the inference engines (`inference`), the trainer workers (`trainer_group`), the weights' way from
the trainer to the engines (`policy_actors`, `weight_sync`), the rollout workers (`rollouts`) and where engines and
trainer workers run (`placement`). A run holds one of each (`cluster`, `engine`, `trainer`, `weight_sync`,
`rollouts`, `placement` in `recipe.config.TrainRunConfig`).

They live in this one module, apart from their components, because the components import Ray and torch and a
run's configuration loads without either. One module rather than six: the six are read together when a run is
sized for a cluster (docs/capacity.md, deploy/render.py), and the rules that span them (colocated placement pairs
each engine with a trainer worker; GPU shares add up per node) are easier to follow on one page.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLACEMENTS = ("disaggregated", "colocated")  # PlacementConfig.layout
WEIGHT_SYNCS = ("whole", "buckets", "collective")  # WeightSyncConfig.method


@dataclass
class RayClusterConfig:
    """The Ray cluster of a run (`fleet.ray_init`): joined at an address, or a local one started with these
    logical resources."""

    address: str = ""  # the Ray cluster: "" = RAY_ADDRESS, or a local Ray started here
    num_cpus: float = 4.0  # logical CPUs of a local Ray (never the physical count)
    sandbox_slots: int = 64  # logical "sandbox" resources of a local Ray: sandboxes at once


@dataclass
class EngineConfig:
    """RL's inference engine actors (`fleet.inference.start_engines`)."""

    count: int = 1  # inference engine actors
    backend: str = "codefleet"  # the inference engine, by name (codefleet.contracts.ENGINES)
    threads: int = 2  # torch threads per engine
    # GPUs per engine actor, a share of one (0.5: two actors on one GPU); needs backend vllm. 0 = CPU
    gpus: float = 0.0
    # how long a weight broadcast waits for an engine that does not answer (restarting, or its node gone with no
    # room elsewhere) before the run goes on without it; it loads the newest checkpoint itself when it is back
    wait_s: float = 300.0
    # extra logical resources per engine actor, to pin engines to nodes on a cluster, e.g. {"engine_node": 1}
    resources: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainerWorkersConfig:
    """The trainer workers of RL and SFT (`fleet.trainer_group.TrainerGroup`); how many SFT runs: `sft.workers`."""

    workers: int = 2  # data-parallel trainer workers of RL
    cpus: float = 0.5  # logical CPUs per trainer worker
    backend: str = (
        "dp"  # the trainer of SFT and RL, by name (codefleet.contracts.TRAINERS): "dp" | "fsdp2" | "fsdp2_ep"
    )
    # GPUs per trainer worker (NCCL then): 1, or a share of one with a single worker (beside an engine). 0 = CPU
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # extra logical resources per trainer worker


@dataclass
class WeightSyncConfig:
    """How RL's new weights reach the engines (`fleet.policy_actors`, `fleet.weight_sync`)."""

    # "whole" (one object) | "buckets" (in the object store) | "collective" (buckets broadcast over a process group
    # per trainer rank: gloo on CPU, NCCL on GPU)
    method: str = "whole"
    bucket_mb: int = 64  # the bucket size of "buckets" and "collective"


@dataclass
class RolloutWorkersConfig:
    """The actors running the agent harness for RL's attempts (`fleet.rollouts.start_workers`)."""

    workers: int = 2  # rollout worker actors; RL's attempts at once (controller.rollout_slots) are spread over them
    cpus: float = 0.25  # logical CPUs per rollout worker
    resources: dict[str, float] = field(default_factory=dict)  # extra logical resources per worker, e.g. {"rollout": 1}


@dataclass
class PlacementConfig:
    """Where engines and trainer workers run: Ray placement groups (`fleet.placement.Placement`)."""

    # "disaggregated" (bundles of their own) | "colocated" (engine i and trainer rank i share a bundle, the engines
    # sleeping while the trainer steps; as many engines as trainer workers)
    layout: str = "disaggregated"
    wait_s: float = 300.0  # how long to wait for the cluster to have room for them before refusing
