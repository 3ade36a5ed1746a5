"""Starting or joining Ray the same way everywhere (training, analytics, benchmarks).

    started = init_ray(num_cpus=4, resources={"sandbox": 64})   # False: Ray was already up here
    with ray_running(num_cpus=4, resources={"sandbox": 64}):     # ... and stopped after, if it started it

`address` (or RAY_ADDRESS) names a cluster to join; otherwise a fresh local
Ray starts with *logical* resources given explicitly — never the machine's
CPU count, and never silently joining a `ray start` cluster someone left on
the machine (`address="local"`). Auth tokens and usage stats are off for
local runs unless the environment says otherwise. `ray_output_to(path)` keeps
Ray's own output out of a command's terminal.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO

import ray

from codefleet.store import safe_files


def init_ray(
    num_cpus: float = 2,
    resources: dict[str, float] | None = None,
    address: str = "",
    object_store_mb: int | None = None,
) -> bool:
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = address or os.environ.get("RAY_ADDRESS", "")
    if address and address != "local":
        ray.init(address=address, log_to_driver=False)
    else:
        ray.init(
            address="local",
            num_cpus=num_cpus,
            resources=resources or {},
            include_dashboard=False,
            object_store_memory=object_store_mb * 2**20 if object_store_mb else None,
            log_to_driver=False,
            configure_logging=False,
        )
    return True


@contextlib.contextmanager
def ray_running(num_cpus: float = 2, resources: dict[str, float] | None = None, address: str = "") -> Iterator[bool]:
    """`init_ray` for the block, and `ray.shutdown()` after it when the block's own call started Ray (a caller that
    already had Ray up keeps it). Yields whether it started Ray."""
    started = init_ray(num_cpus, resources, address)
    try:
        yield started
    finally:
        if started:
            ray.shutdown()


@contextlib.contextmanager
def ray_output_to(path: str, root: str | None = None) -> Iterator[TextIO]:
    """Send this process's standard output and error (file descriptors 1 and 2) to the file `path` while the block
    runs, and yield a stream to the terminal's standard error for the command's own lines. Ray writes to those
    descriptors from its own threads and processes: its start-up lines, the warnings of its libraries, and the
    last log lines of every node that dies, which it prints to each driver. `root`: the directory the user named
    (default: `path`'s own); `path` is appended to without following any link below it (safe_files.LinkRefused)."""
    sys.stdout.flush()
    sys.stderr.flush()
    with safe_files.append_beneath(root or os.path.dirname(path) or ".", path) as f:
        saved = {fd: os.dup(fd) for fd in (1, 2)}
        for fd in saved:
            os.dup2(f.fileno(), fd)
    try:
        if _writes_to_fd2(sys.stderr):
            with os.fdopen(os.dup(saved[2]), "w") as terminal:
                yield terminal
        else:  # sys.stderr was replaced (a test capturing it, a caller's stream): the command's lines go there
            yield sys.stderr
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


def _writes_to_fd2(stream: TextIO) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation: a stream with no descriptor
        return False
