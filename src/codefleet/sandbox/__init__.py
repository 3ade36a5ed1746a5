"""Sandboxes: isolated, stateful, copy-on-write machines for one rollout each.

    from codefleet.sandbox import create_sandbox, SandboxConfig
    with create_sandbox("path/to/repo") as sb:
        sb.exec("cd src && export X=1")
        print(sb.exec("pwd; echo $X").output)
        attempts = sb.fork(8)          # a GRPO group, all from this state

Backends, by name in `codefleet.contracts.SANDBOXES` (which imports one when it
is first asked for): `namespace` (bubblewrap + overlayfs; the default on Linux),
`vm` (a QEMU microVM per sandbox, restored from a snapshot; docs/sandboxes/vm.md),
`local` (no isolation, opt-in: it says so on stderr), and any backend an
installed package declares. `auto` picks namespace unless this host cannot have
it at all (resolve_backend).
"""

from __future__ import annotations

from codefleet.contracts import Sandbox
from codefleet.sandbox.backends import backend_class, create_sandbox, resolve_backend
from codefleet.sandbox.base import (
    PathEscapeError,
    SandboxClosedError,
    SandboxConfig,
    SandboxDeadError,
    SandboxError,
    SandboxUnavailableError,
)
from codefleet.sandbox.pool import SandboxPool

__all__ = [
    "PathEscapeError",
    "Sandbox",
    "SandboxClosedError",
    "SandboxConfig",
    "SandboxDeadError",
    "SandboxError",
    "SandboxPool",
    "SandboxUnavailableError",
    "backend_class",
    "create_sandbox",
    "resolve_backend",
]
