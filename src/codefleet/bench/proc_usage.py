"""What the sandbox bench reads of processes from /proc: which processes a sandbox is made of, the CPU
they burn, the share of a VM's memory that is its guest's RAM, and the memory the host has left."""

from __future__ import annotations

import math
import os

from codefleet.sandbox import procs


def sandbox_pids(sb) -> list[int]:
    """The processes a sandbox is made of: bwrap, its PID 1 and what runs under it (namespace); QEMU (vm); the
    shell and its descendants (local)."""
    if sb.backend == "namespace":
        init = sb._init_pid
        return [pid for pid, _ in sb._pids] + sorted(procs.descendants(init))
    if sb.backend == "vm":
        return [sb.vm.proc.pid]  # QEMU: the guest's memory and all its processes
    return [sb._proc.pid] + sorted(procs.descendants(sb._proc.pid))


def mem_available_mb() -> float:
    """The host's MemAvailable in MB (inf where /proc/meminfo does not say)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return math.inf


def cpu_ticks(pids: list[int]) -> int:
    """The CPU time (user + system, in clock ticks) `pids` have used; a process gone counts 0."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def guest_ram_pss_kb(pid: int, snapshots: str) -> int:
    """PSS in KiB of what QEMU process `pid` maps from a snapshot's RAM file under `snapshots` (its guest's
    RAM; the file may have been replaced since, if the guest's code changed mid-run), 0 if it is gone."""
    total, inside = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's first line
                    path = head[5].strip().removesuffix(" (deleted)") if len(head) == 6 else ""
                    inside = path.startswith(snapshots + os.sep) and os.path.basename(path) == "memory"
                elif inside and head[0] == "Pss:":
                    total += int(head[1])
    except OSError:
        return 0
    return total
