"""A chaos soak: one real `codefleet train` on a local multi-node Ray cluster while faults are injected, then the
run's invariants (invariants.py) and a report.

    report = soak(SoakConfig("my-run.yaml", minutes=3, seed=0, out="chaos/"))

The cluster (`ray.cluster_utils.Cluster`, every node a set of processes on this machine): a head with the logical
resource `head`, where the training driver, the engines and the trainer workers go, and `worker_nodes` nodes with
`sandbox` and `rollout` resources, where the sandbox hosts and rollout workers go. The soak sets those placements
(`engine.resources`, `trainer.resources`, `rollouts.resources`) on top of RUN_CONFIG and the overrides; everything
else is the run's own configuration.

Timeline. The run starts; the fault window opens when RL's first group is accepted (the earlier stages are not
what is soaked) and lasts `minutes`. Faults follow faults.schedule. A removed worker node is replaced by a fresh
one `node_back_s` later, as an autoscaler would. If the training process exits with an error, the soak resumes
it (`codefleet train --resume`) up to `max_resumes` times, each listed in the report; a resume is a human's
action in production, so a fault that needed one is not counted as survived. When the window closes the run
goes on to its last step. Then the invariants are checked (the cluster still up, so leaked actors are visible),
the cluster is shut down, and everything is written to OUT/chaos-report.json.

Survived means: injected; what it killed was back (as many live actors of its kind as before it, restarted by
Ray or replaced by the run; for a node, as many sandbox hosts); the run committed a new RL step after it (or
finished) without a resume in between; and every invariant holds at the end. A fault planned after RL's last
step is listed as not injected: give the run enough `rl.steps` to outlast the window.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import ray
import yaml
from ray.cluster_utils import Cluster

from codefleet.chaos import faults, invariants
from codefleet.chaos.faults import ACTOR_CLASS, Fault, NoTarget
from codefleet.fleet.ray_init import ray_output_to
from codefleet.store import safe_files

RUN_TIMEOUT_S = 3600.0  # a run that has not finished in this long after the window closes is stuck


@dataclass
class SoakConfig:
    run_config: str  # a YAML file of TrainRunConfig fields (`codefleet train --config`)
    minutes: float = 5.0  # the fault window
    seed: int = 0
    out: str = "chaos"  # OUT/run (the run directory), OUT/train.log, OUT/chaos-report.json
    overrides: list[str] = field(default_factory=list)  # KEY=VALUE for `codefleet train`
    worker_nodes: int = 2
    sandboxes_per_node: int = 8
    head_cpus: float = 3.0
    node_cpus: float = 2.0
    node_back_s: float = 20.0  # a removed node's replacement joins this much later
    max_resumes: int = 2
    per_kind: int = 1  # faults of each kind in the window
    kinds: tuple[str, ...] = faults.KINDS


class _Run:
    """The `codefleet train` process, resumed when it fails."""

    def __init__(self, cfg: SoakConfig, address: str, env: dict):
        self.cfg, self.address, self.env = cfg, address, env
        self.run_dir = os.path.join(cfg.out, "run")
        self.log_path = os.path.join(cfg.out, "train.log")
        self.resumes: list[dict] = []
        self.proc = self._start(
            [
                "--out",
                self.run_dir,
                "--config",
                cfg.run_config,
                *cfg.overrides,
                # roles to nodes by logical resources: the driver's parts on the head, the rollouts' on the workers
                "engine.resources={head: 1}",
                "trainer.resources={head: 1}",
                "rollouts.resources={rollout: 1}",
            ]
        )

    def _start(self, args: list[str]) -> subprocess.Popen:
        with open(self.log_path, "ab") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "codefleet.cli", "train", "--no-progress", "--address", self.address, *args],
                stdout=log,
                stderr=log,
                env=self.env,
            )

    def poll(self, t_s: float) -> int | None:
        """None while running (resumed after a failure if resumes are left); else the final exit code."""
        code = self.proc.poll()
        if code is None or code == 0 or len(self.resumes) >= self.cfg.max_resumes:
            return code
        error = _tail(os.path.join(self.run_dir, "error.txt")) or _tail(self.log_path)
        self.resumes.append({"at_s": round(t_s, 1), "exit_code": code, "error": error})
        print(f"[codefleet chaos] the run exited with {code} ({error}); resuming it", file=sys.stderr, flush=True)
        self.proc = self._start(["--resume", self.run_dir])
        return None


def _tail(path: str, chars: int = 300) -> str:
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f.read()[-4000:].splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][-chars:] if lines else ""


def _latest_step(run_dir: str) -> int:
    try:
        with open(os.path.join(run_dir, "checkpoints", "LATEST")) as f:
            return int(f.read().strip().removeprefix("rl-step-"))
    except (OSError, ValueError):
        return 0


def _rl_started(run_dir: str) -> bool:
    accepted = os.path.join(run_dir, "accepted")
    return os.path.isdir(accepted) and any(n.endswith(".json") for n in os.listdir(accepted))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Cluster:
    def __init__(self, cfg: SoakConfig):
        self.cfg = cfg
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": cfg.head_cpus,
                "resources": {"head": 8},
                "include_dashboard": True,
                "dashboard_port": _free_port(),
            },
        )  # not 8265: another Ray on the machine may hold it
        self.workers = [self.add() for _ in range(cfg.worker_nodes)]
        self.cluster.wait_for_nodes()
        self.due: list[float] = []  # times at which a replacement node joins

    def add(self):
        c = self.cfg
        return self.cluster.add_node(num_cpus=c.node_cpus, resources={"sandbox": c.sandboxes_per_node, "rollout": 4})

    def remove_one(self, rng: random.Random, now_s: float) -> tuple[str, str]:
        """(what was removed, its node id)."""
        if len(self.workers) < 2:
            raise NoTarget("only one worker node is left")
        node = self.workers.pop(rng.randrange(len(self.workers)))
        self.cluster.remove_node(node, allow_graceful=False)
        self.due.append(now_s + self.cfg.node_back_s)
        return f"worker node {node.node_id[:8]} (a fresh one joins in {self.cfg.node_back_s:g} s)", node.node_id

    def replace_due(self, now_s: float) -> None:
        for t in [t for t in self.due if t <= now_s]:
            self.due.remove(t)
            self.workers.append(self.add())

    def shutdown(self) -> None:
        self.cluster.shutdown()


def _inject(
    fault: Fault, rng: random.Random, cluster: _Cluster, dashboard_url: str, state_dir: str, now_s: float
) -> str | tuple[str, str]:
    """What was hit, or (what was hit, the pid or node id that is gone)."""
    if fault.kind in ACTOR_CLASS:
        return faults.kill_actor_process(fault.kind, rng, dashboard_url)
    if fault.kind == "sandbox_processes":
        return faults.kill_sandbox_processes(rng, state_dir)
    if fault.kind == "sandbox_disk":
        return faults.fill_sandbox_disk(rng, namespace="codefleet")
    if fault.kind == "worker_node":
        return cluster.remove_one(rng, now_s)
    raise ValueError(f"unknown fault kind {fault.kind!r}; kinds: {', '.join(faults.KINDS)}")


def _live_codefleet_actors(dashboard_url: str) -> list[str]:
    out = []
    for name in ACTOR_CLASS.values():
        out += [f"{name} pid {a.pid}" for a in faults.alive_actors(name, dashboard_url)]
    return out


def soak(cfg: SoakConfig, log: Callable[[str], None] | None = None) -> dict:
    """Run the soak (module docstring); progress lines go to `log` (default: the terminal's standard error, while
    Ray's own output goes to OUT/ray.log)."""
    if not os.path.isfile(cfg.run_config):
        raise FileNotFoundError(
            f"RUN_CONFIG {cfg.run_config} is not a file; give a YAML file of training settings (docs/configuration.md)"
        )
    if os.path.exists(os.path.join(cfg.out, "run")):
        raise FileExistsError(f"{cfg.out}/run exists; give chaos a new --out directory")
    os.makedirs(cfg.out, exist_ok=True)
    with ray_output_to(os.path.join(cfg.out, "ray.log")) as terminal:
        return _soak(cfg, log or (lambda msg: print(f"[codefleet chaos] {msg}", file=terminal, flush=True)))


def _soak(cfg: SoakConfig, log: Callable[[str], None]) -> dict:
    cfg.run_config = os.path.abspath(cfg.run_config)
    rng = random.Random(cfg.seed)
    plan = faults.schedule(cfg.minutes * 60, cfg.seed, cfg.kinds, cfg.per_kind)
    state_dir = tempfile.mkdtemp(prefix="codefleet-chaos-state-", dir="/var/tmp")  # the sandbox user walks through
    env = {
        **os.environ,
        "CODEFLEET_STATE_DIR": state_dir,
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    env.pop("RAY_ADDRESS", None)
    saved_env = dict(os.environ)
    os.environ.update({k: env[k] for k in ("CODEFLEET_STATE_DIR", "RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")})
    t0 = time.monotonic()
    cluster = run = None
    try:
        cluster = _Cluster(cfg)  # its processes inherit CODEFLEET_STATE_DIR: every sandbox lives under state_dir
        context = ray.init(address=cluster.cluster.address, log_to_driver=False, namespace="codefleet-chaos")
        dashboard_url = context.dashboard_url
        run = _Run(cfg, cluster.cluster.address, env)
        log(f"cluster: head + {cfg.worker_nodes} worker nodes; run {run.run_dir}, log {run.log_path}")
        hosts_seen: dict[int, str] = {}  # SandboxHost pid -> node id, for the leak report
        report = _drive(cfg, plan, rng, cluster, run, dashboard_url, state_dir, log, hosts_seen)
        time.sleep(2)  # actors of the finished driver are being torn down
        deadline = time.monotonic() + 60
        while (left := _live_codefleet_actors(dashboard_url)) and time.monotonic() < deadline:
            time.sleep(1)
        whose = _whose(plan, hosts_seen)
        leak_check = invariants.leaks(state_dir, left, whose)
    finally:
        if run is not None and run.proc.poll() is None:  # the soak itself failed: the run goes with it
            run.proc.kill()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        os.environ.clear()
        os.environ.update(saved_env)
    facts = invariants.read_run(run.run_dir)
    checks = invariants.run_checks(facts, os.path.join(run.run_dir, "rollouts")) + [leak_check]
    after = invariants.leaks(state_dir, [], whose)  # the cluster is gone: nothing of it may be left either
    checks.append(invariants.Check("no_leaks_after_shutdown", after.ok, after.detail))
    if all(c.ok for c in checks):
        shutil.rmtree(state_dir, ignore_errors=True)
    ok = all(c.ok for c in checks)
    for f in plan:
        resumed_after = any(r["at_s"] >= (f.injected_s or 0) for r in run.resumes)
        f.survived = bool(
            f.injected_s is not None
            and ok
            and not resumed_after
            and (f.next_step_s is not None or facts.final_version >= facts.steps)
            and (f.alive_before is None or f.restored_s is not None)
        )
    report.update(
        {
            "ok": ok,
            "faults_injected": sum(f.injected_s is not None for f in plan),
            "faults_survived": sum(bool(f.survived) for f in plan),
            "rollouts_lost": len(invariants.lost_rollouts(facts)),
            "rollouts_accepted": len(facts.accepted),
            "rollouts_trained": sum(len(v) for v in facts.trained.values()),
            "steps": facts.final_version,
            "resumes": run.resumes,
            "wall_s": round(time.monotonic() - t0, 1),
            "faults": [f.as_dict() for f in plan],
            "checks": [asdict(c) for c in checks],
            "state_dir": state_dir,
            "config": {**asdict(cfg), "kinds": list(cfg.kinds)},
        }
    )
    # OUT may be shared storage: a link planted as the report is refused, never written through (docs/security.md)
    safe_files.write_file_beneath(cfg.out, "chaos-report.json", json.dumps(report, indent=2), mode=0o644)
    return report


def _rl_steps(run_dir: str) -> int:
    with open(os.path.join(run_dir, "config.yaml")) as f:
        return int(yaml.safe_load(f)["rl"]["steps"])


def _whose(plan: list[Fault], hosts_seen: dict[int, str]) -> Callable[[int], str]:
    """What the sandbox owner with a pid was, and which fault hit it, for the leak report."""

    def whose(pid: int) -> str:
        node = hosts_seen.get(pid)
        what = f"SandboxHost pid {pid} on node {node[:8]}" if node else f"pid {pid}, not a SandboxHost the soak saw"
        for f in plan:
            if f.injected_s is not None and f.gone == str(pid):
                return f"{what}, killed by fault {f.kind} at {f.injected_s:g} s"
            if f.injected_s is not None and node and f.gone == node:
                return f"{what}, on the node fault {f.kind} removed at {f.injected_s:g} s"
        return f"{what}, hit by no fault"

    return whose


def _note_hosts(hosts_seen: dict[int, str], dashboard_url: str) -> None:
    for a in faults.alive_actors(ACTOR_CLASS["sandbox_host"], dashboard_url):
        if a.pid:
            hosts_seen[a.pid] = a.node_id


def _check_restored(plan: list[Fault], now_s: float, dashboard_url: str) -> None:
    """Set restored_s of the faults whose kind is back to its count of live actors from before them."""
    waiting = [f for f in plan if f.injected_s is not None and f.alive_before is not None and f.restored_s is None]
    for f in waiting:
        if faults.count_alive(faults.RESTORES[f.kind], dashboard_url, f.gone) >= f.alive_before:
            f.restored_s = round(now_s - f.injected_s, 1)


def _drive(
    cfg: SoakConfig,
    plan: list[Fault],
    rng: random.Random,
    cluster: _Cluster,
    run: _Run,
    dashboard_url: str,
    state_dir: str,
    log,
    hosts_seen: dict[int, str],
) -> dict:
    """Wait for RL, inject the plan, follow the run to its end; fills in each fault's outcome."""
    t0 = time.monotonic()
    while not _rl_started(run.run_dir):
        if run.poll(time.monotonic() - t0) is not None:
            raise RuntimeError(f"the run ended before RL started: {_tail(run.log_path)}; see {run.log_path}")
        time.sleep(0.5)
    start = time.monotonic()
    window_s = cfg.minutes * 60
    log(f"RL started after {start - t0:.0f} s; {len(plan)} faults over {window_s:.0f} s")
    pending = list(plan)
    code = None
    step, step_changed_at = _latest_step(run.run_dir), start
    next_restore_check = 0.0
    steps = _rl_steps(run.run_dir)
    deadline = start + window_s + RUN_TIMEOUT_S
    while time.monotonic() < deadline:
        now = time.monotonic() - start
        code = run.poll(time.monotonic() - t0)
        new_step = _latest_step(run.run_dir)
        if new_step != step:
            step, step_changed_at = new_step, now
            for f in plan:
                if f.injected_s is not None and f.next_step_s is None and f.step_at_injection < step:
                    f.next_step_s = round(now - f.injected_s, 1)
        if now >= next_restore_check:
            next_restore_check = now + 2.0
            _check_restored(plan, now, dashboard_url)
            _note_hosts(hosts_seen, dashboard_url)
        if code is not None:
            break
        cluster.replace_due(now)
        if pending and step >= steps:  # RL is over (evaluation runs): nothing of it is left to break
            for f in pending:
                f.detail = f"RL ended {now - step_changed_at:.0f} s before its time"
            log(
                f"RL ended at {step_changed_at:.0f} s, before {len(pending)} faults' times; make rl.steps larger to "
                "cover the window"
            )
            pending.clear()
        for fault in [f for f in pending if f.at_s <= now]:
            try:
                _note_hosts(hosts_seen, dashboard_url)  # who was there just before (a node's hosts die with it)
                if fault.kind in faults.RESTORES:
                    fault.alive_before = faults.count_alive(faults.RESTORES[fault.kind], dashboard_url)
                hit = _inject(fault, rng, cluster, dashboard_url, state_dir, now)
                fault.target, fault.gone = hit if isinstance(hit, tuple) else (hit, "")
                fault.injected_s, fault.step_at_injection = round(now, 1), step
                log(f"{now:6.1f} s  {fault.kind}: {fault.target}")
                pending.remove(fault)
            except NoTarget as e:  # tried again until the window closes
                fault.detail = str(e)
                if now >= window_s:
                    log(f"{now:6.1f} s  {fault.kind}: not injected ({e})")
                    pending.remove(fault)
            except Exception as e:  # noqa: BLE001 - a failed injection is reported, the soak goes on
                fault.detail = f"injection failed: {e!r}"
                log(f"{now:6.1f} s  {fault.kind}: injection failed ({e!r})")
                pending.remove(fault)
        time.sleep(0.25 if pending else 1.0)
    else:
        run.proc.kill()
        raise RuntimeError(
            f"the run did not finish within {RUN_TIMEOUT_S:.0f} s after the fault window; see {run.log_path}"
        )
    for f in pending:
        f.detail = f.detail or "the run finished before its time"
    log(f"the run ended with exit code {code} at step {step} ({len(run.resumes)} resumes)")
    return {"exit_code": code, "rl_started_after_s": round(start - t0, 1), "last_step_at_s": round(step_changed_at, 1)}


def table(report: dict) -> str:
    rows = [("t (s)", "fault", "target / outcome", "restored (s)", "next step (s)", "survived")]
    for f in report["faults"]:
        rows.append(
            (
                f"{f['injected_s']:.0f}" if f["injected_s"] is not None else "-",
                f["kind"],
                (f["target"] or f["detail"])[:70],
                f"{f['restored_s']:.1f}" if f["restored_s"] is not None else "-",
                f"{f['next_step_s']:.1f}" if f["next_step_s"] is not None else "-",
                "yes" if f["survived"] else "no",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
    lines.append("")
    lines += [f"{'ok  ' if c['ok'] else 'FAIL'}  {c['name']}: {c['detail']}" for c in report["checks"]]
    lines.append(
        f"faults injected {report['faults_injected']}, survived {report['faults_survived']}, rollouts lost "
        f"{report['rollouts_lost']}, steps {report['steps']}, resumes {len(report['resumes'])}, "
        f"{report['wall_s']:.0f} s"
    )
    return "\n".join(lines)
