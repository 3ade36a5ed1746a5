"""Starting or joining Ray the same way everywhere (training, analytics, benchmarks).

    started = init_ray(num_cpus=4, resources={"sandbox": 64})   # False: Ray was already up here

`address` (or RAY_ADDRESS) names a cluster to join; otherwise a fresh local
Ray starts with *logical* resources given explicitly — never the machine's
CPU count, and never silently joining a `ray start` cluster someone left on
the machine (`address="local"`). Auth tokens and usage stats are off for
local runs unless the environment says otherwise.
"""

from __future__ import annotations

import os

import ray


def init_ray(num_cpus: float = 2, resources: dict[str, float] | None = None, address: str = "",
             object_store_mb: int | None = None) -> bool:
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address and address != "local":
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(address="local", num_cpus=num_cpus, resources=resources or {}, include_dashboard=False,
                 object_store_memory=object_store_mb * 2**20 if object_store_mb else None, log_to_driver=False,
                 configure_logging=False)
    return True
