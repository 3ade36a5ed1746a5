"""Sandboxes: isolated, stateful, copy-on-write machines for one rollout each.

    from codefleet.sandbox import create_sandbox, SandboxConfig
    with create_sandbox("path/to/repo") as sb:
        sb.exec("cd src && export X=1")
        print(sb.exec("pwd; echo $X").output)
        attempts = sb.fork(8)          # a GRPO group, all from this state

Backends, registered by name in `codefleet.contracts.SANDBOXES`: `namespace`
(bubblewrap + overlayfs; the default on Linux), `vm` (a QEMU microVM per
sandbox, restored from a snapshot; docs/sandboxes/vm.md) and `local` (no isolation,
opt-in: it says so on stderr). `auto` picks namespace
unless this host cannot have it at all (resolve_backend).
"""

from __future__ import annotations

from codefleet.contracts import Sandbox
from codefleet.sandbox.backends import create_sandbox, resolve_backend
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
    "PathEscapeError", "Sandbox", "SandboxClosedError", "SandboxConfig", "SandboxDeadError",
    "SandboxError", "SandboxPool", "SandboxUnavailableError", "create_sandbox", "resolve_backend",
]
