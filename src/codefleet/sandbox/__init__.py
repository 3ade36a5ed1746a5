"""Sandboxes: isolated, stateful, copy-on-write machines for one rollout each.

    from codefleet.sandbox import create_sandbox, SandboxConfig
    with create_sandbox("path/to/repo") as sb:
        sb.exec("cd src && export X=1")
        print(sb.exec("pwd; echo $X").output)
        attempts = sb.fork(8)          # a GRPO group, all from this state

Backends: `namespace` (bubblewrap + overlayfs; the default on Linux) and
`local` (no isolation). `auto` picks namespace where it works.
"""

from __future__ import annotations

from codefleet.sandbox.base import (
    PathEscapeError,
    Sandbox,
    SandboxClosedError,
    SandboxConfig,
    SandboxDeadError,
    SandboxError,
    SandboxUnavailableError,
)
from codefleet.sandbox.pool import SandboxPool

BACKENDS = ("namespace", "local")


def resolve_backend(name: str = "auto") -> str:
    from codefleet.sandbox.namespace import unavailable_reason

    if name == "auto":
        return "namespace" if unavailable_reason() is None else "local"
    if name not in BACKENDS:
        raise ValueError(f"unknown sandbox backend {name!r}; choose one of {', '.join(BACKENDS)} or 'auto'")
    return name


def create_sandbox(repo: str | None = None, config: SandboxConfig | None = None) -> Sandbox:
    """A new sandbox over a copy-on-write view of `repo` (an empty workspace if None)."""
    config = config or SandboxConfig()
    backend = resolve_backend(config.backend)
    if backend == "namespace":
        from codefleet.sandbox.namespace import NamespaceSandbox

        return NamespaceSandbox(repo, config)
    from codefleet.sandbox.local import LocalSandbox

    return LocalSandbox(repo, config)


__all__ = [
    "BACKENDS", "PathEscapeError", "Sandbox", "SandboxClosedError", "SandboxConfig", "SandboxDeadError",
    "SandboxError", "SandboxPool", "SandboxUnavailableError", "create_sandbox", "resolve_backend",
]
