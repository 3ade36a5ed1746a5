"""The Ray layer. So far: the sandbox fleet (one `SandboxHost` actor per node, `SandboxFleet` to reach them)."""

from __future__ import annotations

from codefleet.fleet.sandbox_fleet import RemoteSandbox, SandboxFleet
from codefleet.fleet.sandbox_host import HostCore, HostStats, SandboxCapacityError, SandboxHost

__all__ = ["HostCore", "HostStats", "RemoteSandbox", "SandboxCapacityError", "SandboxFleet", "SandboxHost"]
