"""The faults `codefleet chaos` injects, when, and how.

Kinds, each what a large cluster sees every day (what is done; who must cope):

- `rollout_worker`: SIGKILL a `RolloutWorker` actor's process; Ray restarts it, the controller retries its
  attempts.
- `sandbox_host`: SIGKILL a `SandboxHost` actor's process (its sandboxes die with it); the fleet starts a new
  host, the attempts are retried.
- `engine`: SIGKILL an `EngineActor` process; Ray restarts it, it loads the newest checkpoint, episodes go
  elsewhere.
- `trainer_worker`: SIGKILL one `TrainerWorker`; the RL stage starts a new trainer group from the last
  checkpoint.
- `sandbox_processes`: SIGKILL every process inside one live sandbox (as the OOM killer would); the attempt
  fails as infrastructure and is retried.
- `sandbox_disk`: fill one live sandbox's workspace to the last byte, from inside it; the agent's commands
  fail with ENOSPC, the attempt still ends.
- `worker_node`: remove a whole worker node (raylet and every process on it), and add a fresh one
  `node_back_s` later; placement, the fleet and the controller must cope.

The schedule is seeded: the kinds are shuffled and cycled, so that every kind comes once before any comes
twice, at times drawn uniformly inside equal slots of the window (no two faults closer than half a slot).
A fault whose target does not exist at its time (no live sandbox between two groups, the last worker node)
is tried again every quarter second, while the later faults go on at their times, until the window closes; if
its target never appears it is listed as not injected, with the reason.

Targets are found through Ray's state API (actors by class name and their PIDs) and `/proc` (sandbox processes:
the bwraps running under the process name of an owner in this soak's sandbox state directory, and their
descendants). Processes are signalled from this machine, so every node must be local: the soak's cluster is
`ray.cluster_utils`.
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass

import ray
from ray.util.state import list_actors

from codefleet.fleet.sandbox_host import host_name, sandbox_nodes
from codefleet.sandbox.state import process_name

KINDS = (
    "rollout_worker",
    "sandbox_host",
    "engine",
    "trainer_worker",
    "sandbox_processes",
    "sandbox_disk",
    "worker_node",
)
ACTOR_CLASS = {
    "rollout_worker": "RolloutWorker",
    "sandbox_host": "SandboxHost",
    "engine": "EngineActor",
    "trainer_worker": "TrainerWorker",
}
RESTORES = {**ACTOR_CLASS, "worker_node": "SandboxHost"}  # what must be back after the fault


@dataclass
class Fault:
    kind: str
    at_s: float  # planned: seconds after RL started
    injected_s: float | None = None  # when it was done
    target: str = ""  # what was hit
    detail: str = ""  # what happened, or why it was not injected
    step_at_injection: int | None = None  # the run's newest committed RL step then
    next_step_s: float | None = None  # seconds from the injection to the run's next committed step
    # actor kinds and worker_node: seconds until as many actors of the kind (sandbox hosts for a node) were alive
    # again as before it, restarted by Ray or replaced by the run
    restored_s: float | None = None
    alive_before: int | None = None
    gone: str = ""  # the killed actor's pid, or the removed node's id: what no longer counts as alive
    survived: bool | None = None  # decided at the end (soak.py)

    def as_dict(self) -> dict:
        return asdict(self)


def schedule(window_s: float, seed: int, kinds: tuple[str, ...] = KINDS, per_kind: int = 1) -> list[Fault]:
    """`per_kind` faults of every kind in `window_s`, in a seeded order, one per equal slot at a random point of
    its middle half."""
    rng = random.Random(seed)
    order: list[str] = []
    for _ in range(per_kind):
        cycle = list(kinds)
        rng.shuffle(cycle)
        order += cycle
    slot_s = window_s / max(len(order), 1)
    return [Fault(kind, round(slot_s * (i + 0.25 + 0.5 * rng.random()), 2)) for i, kind in enumerate(order)]


class NoTarget(Exception):
    """Nothing of this kind to hit right now."""


def alive_actors(class_name: str, dashboard_url: str) -> list:
    """ALIVE actors of `class_name` in the cluster whose dashboard is at `dashboard_url`."""
    address = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
    return list_actors(
        address=address,
        filters=[("class_name", "=", class_name), ("state", "=", "ALIVE")],
        raise_on_missing_output=False,
    )


def count_alive(class_name: str, dashboard_url: str, gone: str = "") -> int:
    """Live actors of `class_name`, not counting one whose pid or node is `gone` (the state API may still list
    it for a moment after its death)."""
    return sum(1 for a in alive_actors(class_name, dashboard_url) if gone not in (str(a.pid), a.node_id))


def kill_actor_process(kind: str, rng: random.Random, dashboard_url: str) -> tuple[str, str]:
    """(what was killed, its pid)."""
    actors = [a for a in alive_actors(ACTOR_CLASS[kind], dashboard_url) if a.pid]
    if not actors:
        raise NoTarget(f"no live {ACTOR_CLASS[kind]}")
    actor = rng.choice(actors)
    os.kill(actor.pid, signal.SIGKILL)
    return f"{ACTOR_CLASS[kind]} {actor.actor_id[:8]} pid {actor.pid} on node {actor.node_id[:8]}", str(actor.pid)


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    return children


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def sandbox_roots(state_dir: str) -> list[int]:
    """PIDs of the outermost bwrap of every live sandbox of the owners under `state_dir` (each runs under its owner's
    process name, sandbox/state.py; its command line names no host path)."""
    try:
        names = {process_name(owner) for owner in os.listdir(state_dir)}
    except FileNotFoundError:
        return []
    pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    bwraps = {p for p in pids if cmdline(p).split(" ", 1)[0] in names}
    children = _children()
    inner = {c for p in bwraps for c in children.get(p, [])}
    return sorted(bwraps - inner)


def descendants(pid: int, children: dict[int, list[int]] | None = None) -> list[int]:
    children = _children() if children is None else children
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def kill_sandbox_processes(rng: random.Random, state_dir: str) -> str:
    """SIGKILL what runs inside one sandbox: every descendant of its bwrap, innermost first."""
    roots = sandbox_roots(state_dir)
    children = _children()
    busy = [r for r in roots if len(descendants(r, children)) >= 2]  # bwrap's init and at least the shell
    if not busy:
        raise NoTarget("no live sandbox")
    root = rng.choice(busy)
    victims = descendants(root, children)
    for pid in reversed(victims):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return f"{len(victims)} processes of the sandbox under bwrap pid {root}"


FILL_COMMAND = (
    "avail=$(df -k --output=avail /workspace | tail -n 1); "
    "fallocate -l $((avail * 1024)) /workspace/.chaos-fill 2>/dev/null "
    "|| head -c $((avail * 1024)) /dev/zero > /workspace/.chaos-fill; "
    "df -k --output=avail /workspace | tail -n 1"
)


def fill_sandbox_disk(rng: random.Random, namespace: str) -> str:
    """Fill one live sandbox's workspace from inside it, through its host (a command as an agent would run)."""
    candidates = []
    for node_id in sandbox_nodes():
        try:  # the run's own hosts, by name; one that is missing or dead is skipped, never started from here
            host = ray.get_actor(host_name(node_id), namespace=namespace)
            candidates += [(node_id, host, sid) for sid in ray.get(host.ids.remote(), timeout=10)]
        except (ValueError, ray.exceptions.RayError):
            continue
    if not candidates:
        raise NoTarget("no live sandbox")
    node_id, host, sid = rng.choice(candidates)
    try:
        result = ray.get(host.run_oneoff.remote(sid, ["sh", "-c", FILL_COMMAND], 60.0), timeout=90)
    except ray.exceptions.RayTaskError as e:  # it closed in between: the run took it back first
        raise NoTarget(f"sandbox {sid} closed before it was filled ({type(e.cause).__name__})") from None
    left = result.output.strip().splitlines()[-1] if result.output.strip() else "?"
    return f"sandbox {sid} on node {node_id[:8]}: workspace filled, {left} KiB left"


Injector = Callable[[random.Random], str]
