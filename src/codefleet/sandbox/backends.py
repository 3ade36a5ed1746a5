"""The sandbox backends by name (`codefleet.contracts.SANDBOXES`), and the one call that makes a sandbox."""

from __future__ import annotations

from codefleet.contracts import SANDBOXES, Sandbox
from codefleet.sandbox.base import SandboxConfig
from codefleet.sandbox.bwrap import never_works_here
from codefleet.sandbox.local import LocalSandbox
from codefleet.sandbox.namespace import NamespaceSandbox
from codefleet.sandbox.vm import VMSandbox

SANDBOXES.register("namespace", NamespaceSandbox)
SANDBOXES.register("local", LocalSandbox)
SANDBOXES.register("vm", VMSandbox)


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
