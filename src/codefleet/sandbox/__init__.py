"""Sandboxes: isolated, stateful, copy-on-write machines for one rollout each.

    from codefleet.sandbox import create_sandbox, SandboxConfig
    with create_sandbox("path/to/repo") as sb:
        sb.exec("cd src && export X=1")
        print(sb.exec("pwd; echo $X").output)
        attempts = sb.fork(8)          # a GRPO group, all from this state

Backends, registered by name in `codefleet.contracts.SANDBOXES`: `namespace`
(bubblewrap + overlayfs; the default on Linux) and `local` (no isolation,
opt-in: it says so on stderr). `auto` picks namespace
unless this host cannot have it at all (resolve_backend).
"""

from __future__ import annotations

from codefleet.contracts import SANDBOXES, Sandbox
from codefleet.sandbox.base import (
    PathEscapeError,
    SandboxClosedError,
    SandboxConfig,
    SandboxDeadError,
    SandboxError,
    SandboxUnavailableError,
)
from codefleet.sandbox.bwrap import never_works_here
from codefleet.sandbox.local import LocalSandbox
from codefleet.sandbox.namespace import NamespaceSandbox
from codefleet.sandbox.pool import SandboxPool

SANDBOXES.register("namespace", NamespaceSandbox)
SANDBOXES.register("local", LocalSandbox)


def resolve_backend(name: str = "auto") -> str:
    """The backend `name` stands for. 'auto' is 'local' only where namespace sandboxes can never work
    on this host (no bubblewrap, user namespaces off in the kernel); any other failure of theirs is an
    error, never a silent fall back to no isolation."""
    if name == "auto":
        return "local" if never_works_here() else "namespace"
    if name not in SANDBOXES:
        raise ValueError(f"unknown sandbox backend {name!r}; choose one of {', '.join(SANDBOXES.names())} or 'auto'")
    return name


def create_sandbox(repo: str | None = None, config: SandboxConfig | None = None) -> Sandbox:
    """A new sandbox over a copy-on-write view of `repo` (an empty workspace if None)."""
    config = config or SandboxConfig()
    return SANDBOXES.get(resolve_backend(config.backend))(repo, config)


__all__ = [
    "PathEscapeError", "Sandbox", "SandboxClosedError", "SandboxConfig", "SandboxDeadError",
    "SandboxError", "SandboxPool", "SandboxUnavailableError", "create_sandbox", "resolve_backend",
]
