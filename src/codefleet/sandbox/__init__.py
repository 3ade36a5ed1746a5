"""Sandboxes: isolated, stateful, copy-on-write machines for one rollout each.

    from codefleet.sandbox import create_sandbox, SandboxConfig
    with create_sandbox("path/to/repo") as sb:
        sb.exec("cd src && export X=1")
        print(sb.exec("pwd; echo $X").output)
        attempts = sb.fork(8)          # a GRPO group, all from this state

Backends: `namespace` (bubblewrap + overlayfs; the default on Linux) and
`local` (no isolation, opt-in: it says so on stderr). `auto` picks namespace
unless this host cannot have it at all (resolve_backend).
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
    """The backend `name` stands for. 'auto' is 'local' only where namespace sandboxes can never work
    on this host (no bubblewrap, user namespaces off in the kernel); any other failure of theirs is an
    error, never a silent fall back to no isolation."""
    from codefleet.sandbox.bwrap import never_works_here

    if name == "auto":
        return "local" if never_works_here() else "namespace"
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
