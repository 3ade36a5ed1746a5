"""The Sandbox contract, its config and its errors.

A sandbox is an isolated, stateful machine around a copy-on-write copy of a
repository: a persistent shell (cwd, environment and background jobs survive
between commands), a file API confined to the workspace, `fork(n)` for a
group of attempts that start from one state, and `close()` that frees
everything. Backends are siblings chosen by name (`codefleet.contracts.SANDBOXES`:
`namespace`, `vm`, `local`, and any a package installs).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

WORKSPACE = "/workspace"


class SandboxError(RuntimeError):
    """Base class: something about a sandbox went wrong; the message says what to do."""


class SandboxUnavailableError(SandboxError):
    """The host cannot build this kind of sandbox (missing tool, no namespaces)."""


class SandboxDeadError(SandboxError):
    """The sandbox (or its shell) died and could not be brought back."""


class SandboxClosedError(SandboxError):
    """The sandbox was closed; create a new one."""


class PathEscapeError(SandboxError, PermissionError):
    """A path given to the file API points outside the workspace."""


@dataclass
class SandboxConfig:
    """Limits and layout of one sandbox. Defaults suit an agent fixing a repo.

    Every limit is per sandbox. `memory_mb`, `max_processes` and `cpu_cores`
    are enforced by cgroups (v1 or v2) where the host lets us create them,
    and by rlimits otherwise (`SandboxInfo.limits` says which).
    """

    backend: str = "auto"  # "auto" or a name in codefleet.contracts.SANDBOXES: "namespace", "vm", "local", ...
    timeout_s: float = 60.0  # default wall-clock limit per command
    output_limit_bytes: int = 64 * 1024  # head + tail kept from each command
    memory_mb: int = 2048  # memory of all its processes together (without cgroups: address space per process)
    max_processes: int = 256  # processes and threads at once
    cpu_cores: float = 1.0  # CPU bandwidth (cgroup quota)
    cpu_time_s: int = 3600  # CPU seconds per process (RLIMIT_CPU)
    workspace_mb: int = 2048  # room for changes to the workspace
    tmp_mb: int = 512  # size of the private /tmp (and of /var/tmp and /dev/shm); counts against memory_mb
    max_file_mb: int = 1024  # largest single file a command may write
    ro_binds: list[str] = field(default_factory=list)  # extra host paths, read-only
    env: dict[str, str] = field(default_factory=dict)  # environment variables exported in its shell
    state_dir: str | None = None  # where mounts and layers live; see state.py
    # the userland instead of the host's /usr, /etc...: a root filesystem, an image archive (imported once per node)
    # or an imported image's id (docs/environments.md)
    environment: str | None = None

    def __post_init__(self) -> None:
        for name, kind in _POSITIVE_FIELDS.items():
            _check_positive(f"SandboxConfig.{name}", getattr(self, name), kind)
        check_env_names(self.env)
        if self.environment is not None and (not isinstance(self.environment, str) or not self.environment):
            raise ValueError(
                f"SandboxConfig.environment is {self.environment!r}; it must be a root filesystem, an "
                "image archive or an imported image's id, or None for the host's userland"
            )


# The numeric fields of SandboxConfig: each must be above 0 (a limit of 0 or less would break the sandbox's
# start with an error that names something else, or, for timeout_s, time out every command at once).
_POSITIVE_FIELDS = {
    "timeout_s": float,
    "output_limit_bytes": int,
    "memory_mb": int,
    "max_processes": int,
    "cpu_cores": float,
    "cpu_time_s": int,
    "workspace_mb": int,
    "tmp_mb": int,
    "max_file_mb": int,
}


def _check_positive(where: str, value: object, kind: type) -> None:
    """Raise ValueError unless `value` is a `kind` (int, or float where an int is fine too) above 0;
    bool, NaN and infinity are refused."""
    allowed = int if kind is int else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, allowed)
        or (isinstance(value, float) and not math.isfinite(value))
        or value <= 0
    ):
        what = "a whole number" if kind is int else "a finite number"
        raise ValueError(f"{where} is {value!r}; it must be {what} greater than 0")


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env_names(env: dict[str, str]) -> None:
    """Raise ValueError for a key of `env` that is not a shell variable name (it is exported as written)."""
    for name in env:
        if not isinstance(name, str) or not _ENV_NAME.fullmatch(name):
            raise ValueError(
                f"SandboxConfig.env: {name!r} is not a variable name; use letters, digits and '_', "
                "not starting with a digit"
            )
