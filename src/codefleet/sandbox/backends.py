"""The one call that makes a sandbox, from the backend its config names (`codefleet.contracts.SANDBOXES`)."""

from __future__ import annotations

from codefleet.contracts import SANDBOXES, Sandbox
from codefleet.sandbox.base import SandboxConfig
from codefleet.sandbox.bwrap import never_works_here


def resolve_backend(name: str = "auto") -> str:
    """The backend `name` stands for. 'auto' is 'local' only where namespace sandboxes can never work
    on this host (no bubblewrap, user namespaces off in the kernel); any other failure of theirs is an
    error, never a silent fall back to no isolation."""
    if name == "auto":
        return "local" if never_works_here() else "namespace"
    if name not in SANDBOXES:
        raise ValueError(f"unknown sandbox backend {name!r}; choose one of {', '.join(SANDBOXES.names())} or 'auto'")
    return name


def backend_class(config: SandboxConfig) -> type:
    """The class of the backend `config` selects, once its capabilities are checked against what `config` asks."""
    name = resolve_backend(config.backend)
    cls = SANDBOXES.get(name)
    if config.environment is not None and not cls.environments:
        raise ValueError(
            f"SandboxConfig.environment needs a backend that runs an image's userland, and sandbox "
            f"backend {name!r} runs the host's own: use backend 'namespace' (or 'vm')"
        )
    return cls


def create_sandbox(repo: str | None = None, config: SandboxConfig | None = None) -> Sandbox:
    """A new sandbox over a copy-on-write view of `repo` (an empty workspace if None)."""
    config = config or SandboxConfig()
    return backend_class(config)(repo, config)
