"""Where the engines and the trainer workers run: Ray placement groups, disaggregated or colocated.

    placement = Placement.reserve(engines=2, trainer_workers=2, engine=Role(1.0), trainer=Role(0.5),
                                  colocated=False, timeout_s=300)
    start_engines(..., placement=placement.engines)      # one scheduling strategy per engine
    TrainerGroup(..., placement=placement.trainer)      # one per rank
    placement.remove()

A `Role` is what one actor asks for: logical CPUs, a share of a GPU and custom resources (the same numbers
its actor options carry, `fleet.gpus.actor_options`). Reserving them as placement groups before any actor starts
makes the placement all or nothing: a cluster without room for every trainer rank fails in one sentence
instead of starting some ranks that then wait in a collective for the others.

- Disaggregated (`placement.layout=disaggregated`): the trainer workers in one group packed together (their
  collectives run every step) and the engines in another spread over the nodes, each actor in a bundle of its
  own: trainer and engines never share a bundle's devices.
- Colocated (`placement.layout=colocated`, as many engines as trainer workers): one group of bundles, each the
  sum of one engine's and one trainer worker's resources (e.g. 0.5 + 0.5 of a GPU: one GPU each pair); engine
  i and trainer rank i share bundle i. The engines sleep while the trainer steps (`EngineActor.sleep`,
  `fleet.policy_actors`), so the two take turns on the devices. Both keep their memory, so they must fit together.

A run's `placement` section (`fleet.fleet_config.PlacementConfig`) chooses between them and sets the wait.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from codefleet.fleet.fleet_config import PlacementConfig


@dataclass(frozen=True)
class Role:
    cpus: float
    gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)

    def bundle(self) -> dict[str, float]:
        return {k: v for k, v in {"CPU": self.cpus, "GPU": self.gpus, **self.resources}.items() if v > 0}


def _merged(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in {**a, **b}}


@dataclass
class Placement:
    engines: list[PlacementGroupSchedulingStrategy]
    trainer: list[PlacementGroupSchedulingStrategy]
    groups: list[PlacementGroup]
    colocated: bool

    @classmethod
    def reserve(
        cls,
        engines: int,
        trainer_workers: int,
        engine: Role,
        trainer: Role,
        colocated: bool = False,
        timeout_s: float = PlacementConfig.wait_s,
    ) -> Placement:
        """Reserve the bundles (see the module docstring); raises ValueError, after `timeout_s`, if the cluster
        has no room for them, and reserves nothing then."""
        per_rank = engine.gpus + trainer.gpus if colocated else trainer.gpus  # the GPU of a trainer rank's bundle
        if trainer_workers > 1 and trainer.gpus > 0 and per_rank < 1:
            raise ValueError(
                f"{trainer_workers} trainer workers in bundles of {per_rank:g} GPU could share a GPU, "
                "and NCCL refuses two ranks on one: make each trainer worker's bundle a whole GPU "
                "(colocated: engine.gpus + trainer.gpus = 1), or use one worker"
            )
        if colocated:
            if engines != trainer_workers:
                raise ValueError(
                    f"colocated placement pairs each engine with a trainer worker, but there are "
                    f"{engines} engines and {trainer_workers} trainer workers: make them equal"
                )
            shared = _merged(engine.bundle(), trainer.bundle())
            groups = [
                cls._wait(
                    placement_group([shared] * engines, strategy="PACK"),
                    f"{engines} bundles of {shared} (an engine and a trainer worker each)",
                    timeout_s,
                )
            ]
            strategies = [
                PlacementGroupSchedulingStrategy(groups[0], placement_group_bundle_index=i) for i in range(engines)
            ]
            return cls(strategies, list(strategies), groups, True)
        trainer_group = cls._wait(
            placement_group([trainer.bundle()] * trainer_workers, strategy="PACK"),
            f"{trainer_workers} trainer workers of {trainer.bundle()}",
            timeout_s,
        )
        try:
            engine_group = cls._wait(
                placement_group([engine.bundle()] * engines, strategy="SPREAD"),
                f"{engines} engines of {engine.bundle()}",
                timeout_s,
            )
        except ValueError:
            remove_placement_group(trainer_group)
            raise
        return cls(
            [PlacementGroupSchedulingStrategy(engine_group, placement_group_bundle_index=i) for i in range(engines)],
            [
                PlacementGroupSchedulingStrategy(trainer_group, placement_group_bundle_index=r)
                for r in range(trainer_workers)
            ],
            [trainer_group, engine_group],
            False,
        )

    @staticmethod
    def _wait(group: PlacementGroup, what: str, timeout_s: float) -> PlacementGroup:
        try:
            ray.get(group.ready(), timeout=timeout_s)
        except GetTimeoutError:
            remove_placement_group(group)
            free = {
                k: round(v, 2)
                for k, v in ray.available_resources().items()
                if not k.startswith(("node:", "memory", "object_store_memory"))
            }
            raise ValueError(
                f"Ray could not place {what} within {timeout_s:g} s (free now: {free}): add nodes, "
                "or ask for fewer or smaller actors (engine.count, trainer.workers and their "
                "cpus, gpus and resources)"
            ) from None
        return group

    def remove(self) -> None:
        for group in self.groups:
            remove_placement_group(group)
