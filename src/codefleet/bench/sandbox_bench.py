"""`codefleet bench sandbox`: how fast sandboxes start, answer, fork, and how many fit.

Measured in one run, on this machine, next to the floor every sandbox pays
one way or another:

- `subprocess_ms_p50`: `subprocess.run(["true"])` with no isolation — the
  cost of starting any process from Python. The persistent shell must beat it.
- `bwrap_true_ms_p50`: `bwrap ... true` with our namespaces — the isolation
  tool's own start-up cost, which a cold create cannot go below.

Figures:
- create: a new sandbox over a small repository, ready for its first command
  (overlay + tmpfs mounted, cgroup made, bwrap and bash up, setup run);
  cold, not from the warm pool. `pool_acquire_ms_p50` is the warm-pool path.
- exec: round trip of `true` in the persistent shell (`exec_external_ms_p50`:
  `/bin/true`, which forks a process inside the sandbox).
- fork: `fork(4)` of a sandbox with changes in its workspace, per child.
- live: sandboxes held open at once, all answering a command, with the
  resident memory (RSS, and PSS which splits shared pages fairly) of their
  processes (bwrap, bwrap's PID 1, bash) per sandbox, and the CPU they burn
  while idle.

The `vm` backend (sandbox/vm.py) adds, for microVMs of 256 MB:
- boot: from nothing to a first answered command — the snapshot (`Template`)
  built by booting a VM, then a sandbox restored from it and `true` run in it.
  Each sample boots in a fresh private snapshot directory, so it is a real cold
  boot; `boot_to_agent_ms_p50` is the boot alone (QEMU start to the guest
  agent's first answer, what Firecracker's "start to guest init" measures).
- restore: `VMSandbox.restore_s` of each create (its workspace disk made, QEMU
  started, the snapshot loaded, the disk mounted, the shell started).
- live: VMs started one batch at a time until the cap, a failed start, the
  time budget, or free memory (MemAvailable) falling under a reserve; the
  reason is `live_stop`. Memory is the QEMU process's RSS and PSS (PSS shows
  how much of the snapshot's RAM file the VMs share copy-on-write).
Under QEMU's TCG (`accel`: a host whose /dev/kvm cannot run the guest kernel)
the figures are TCG's, one to two orders of magnitude slower than KVM's; the
speed targets are KVM's and `note` says so. `--backend both` runs namespace
and vm in one run and reports each, side by side, with vm's ratio to namespace.

Each figure and its peer are timed alternately in the same run (each create
followed by one `bwrap true`; exec and `subprocess.run` in alternating
blocks), so a burst of load on the shared machine hits both sides. Timing is
shared-machine noisy: read medians and the ratios to the peers.

`--backend auto` measures the local backend (no isolation) where the namespace
backend cannot run, and says why in `note`.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from codefleet.bench.proc_usage import cpu_ticks, guest_ram_pss_kb, mem_available_mb, sandbox_pids
from codefleet.bench.report import report
from codefleet.bench.timing import alternated, percentile, timed_ms
from codefleet.sandbox import (
    SandboxConfig,
    SandboxPool,
    SandboxUnavailableError,
    create_sandbox,
    procs,
    resolve_backend,
    vm,
    vm_disks,
)
from codefleet.sandbox.bwrap import unavailable_reason


@dataclass(frozen=True)
class Sizes:
    n_create: int
    n_exec: int
    n_fork: int  # fork(4) calls
    n_live: int  # cap on sandboxes held at once
    pool_rounds: int = 20
    n_boot: int = 0  # cold boots (vm)
    live_workers: int = 4
    live_budget_s: float = math.inf


SIZES = {  # backend: (full, quick)
    "vm": (
        Sizes(
            n_create=20, n_exec=500, n_fork=3, n_live=400, pool_rounds=5, n_boot=3, live_workers=2, live_budget_s=900
        ),  # the cap is above what fits in 24 GB: the run finds this host's limit
        Sizes(n_create=5, n_exec=100, n_fork=1, n_live=10, pool_rounds=2, n_boot=1, live_workers=2, live_budget_s=180),
    ),
    "other": (
        Sizes(n_create=200, n_exec=3000, n_fork=20, n_live=500),
        Sizes(n_create=40, n_exec=500, n_fork=5, n_live=100),
    ),
}
VM_MEMORY_MB = 256  # the nominal VM size; every vm figure uses it
VM_RESERVE_MB = 4096  # the live phase stops starting VMs when MemAvailable falls below this (room for the rest)


def make_repo(root: str, files: int = 40) -> str:
    repo = os.path.join(root, "repo")
    for i in range(files):
        d = os.path.join(repo, f"pkg{i % 4}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"mod{i}.py"), "w") as f:
            f.write(f"def f{i}(x):\n    return x + {i}\n" * 20)
    return repo


def _first_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def _cold_boots(repo: str, config: SandboxConfig, n: int, root: str, log) -> tuple[dict, str]:
    """`n` cold boots to a first command, each in a fresh snapshot directory under `root` (CODEFLEET_VM_TEMPLATES,
    set for the rest of the vm run); the figures and the last directory, whose snapshot the later phases
    restore."""
    boots, to_agent, tdir = [], [], ""
    for i in range(n):
        if tdir:
            shutil.rmtree(tdir, ignore_errors=True)
        tdir = os.path.join(root, f"boot{i}")
        os.environ["CODEFLEET_VM_TEMPLATES"] = tdir
        t = time.perf_counter()
        template = vm.Template(
            vm_disks.environment_disk(), config.memory_mb, max(1, math.ceil(config.cpu_cores)), config.workspace_mb
        ).ensure(180)
        with create_sandbox(repo, config) as sb:
            sb.exec("true")
        boots.append((time.perf_counter() - t) * 1000)
        to_agent.append(template.boot_s * 1000)
        if len(os.listdir(tdir)) != 2:  # the template and its lock: the sandbox restored from the one built here
            raise RuntimeError(
                f"the sandbox did not restore the snapshot just booted ({sorted(os.listdir(tdir))}): "
                "VMSandbox's snapshot shape changed (update _cold_boots in bench/sandbox_bench.py), "
                "or the guest's code changed during the run"
            )
        log(f"  cold boot {i + 1}/{n}: {boots[-1]:.0f} ms (boot to agent {to_agent[-1]:.0f} ms)")
    return {
        "boot_ms_p50": percentile(boots, 0.5),
        "boot_ms_p99": percentile(boots, 0.99),
        "boot_to_agent_ms_p50": percentile(to_agent, 0.5),
    }, tdir


def _hold_live(repo: str, config: SandboxConfig, sizes: Sizes, log) -> tuple[list, str]:
    """Sandboxes started `live_workers` at a time until the cap, a failure, the time budget or the memory
    reserve; those started and the reason it stopped."""
    live: list = []
    stop = f"reached the cap of {sizes.n_live}"
    started = time.monotonic()
    with ThreadPoolExecutor(sizes.live_workers) as ex:
        while len(live) < sizes.n_live:
            if time.monotonic() - started > sizes.live_budget_s:
                stop = f"the time budget of {sizes.live_budget_s:.0f} s ran out"
                break
            if mem_available_mb() < VM_RESERVE_MB:
                stop = f"free memory (MemAvailable) fell under the {VM_RESERVE_MB} MB reserve"
                break
            batch = [
                ex.submit(create_sandbox, repo, config)
                for _ in range(min(sizes.live_workers, sizes.n_live - len(live)))
            ]
            failed = None
            for f in batch:
                try:
                    live.append(f.result())
                except Exception as e:  # noqa: BLE001 - report how far we got, and why it stopped
                    failed = failed or e
            if failed is not None:
                stop = f"a start failed ({_first_line(failed)})"
                log(f"  stopped creating: {stop}")
                break
            if config.backend == "vm" and len(live) % 10 == 0:
                log(f"  {len(live)} live, {mem_available_mb():.0f} MB available, {time.monotonic() - started:.0f} s")
    return live, stop


def _run_backend(backend: str, quick: bool, log) -> dict:
    sizes = SIZES["vm" if backend == "vm" else "other"][quick]
    work = tempfile.mkdtemp(prefix=f"codefleet-bench-{os.getpid()}-", dir="/var/tmp")  # the pid: whose it is
    os.chmod(work, 0o755)  # the sandbox user walks through it to the state directory (sandbox/state.py)
    config = SandboxConfig(backend=backend, state_dir=os.path.join(work, "state"))
    if backend == "vm":
        config = SandboxConfig(backend=backend, state_dir=config.state_dir, memory_mb=VM_MEMORY_MB, tmp_mb=64)
    repo = make_repo(work)
    results: dict = {"backend": backend, "quick": quick}
    saved_templates = os.environ.get("CODEFLEET_VM_TEMPLATES")
    snapshots = tdir = ""
    try:
        bwrap = None
        if backend == "namespace" and shutil.which("bwrap"):
            argv = [
                "bwrap",
                "--unshare-user",
                "--unshare-pid",
                "--unshare-ipc",
                "--unshare-uts",
                "--unshare-net",
                "--ro-bind",
                "/usr",
                "/usr",
                "--symlink",
                "usr/bin",
                "/bin",
                "--symlink",
                "usr/lib",
                "/lib",
                "--symlink",
                "usr/lib64",
                "/lib64",
                "--proc",
                "/proc",
                "--dev",
                "/dev",
                "true",
            ]

            def bwrap():
                return subprocess.run(argv, check=True)

        if backend == "vm":
            results["accel"] = vm.accel()
            results["memory_mb"] = config.memory_mb
            log(f"[vm] cold boot x{sizes.n_boot} ({results['accel']}) ...")
            snapshots = tempfile.mkdtemp(prefix=f"codefleet-bench-vm-{os.getpid()}-", dir="/dev/shm")  # tmpfs
            boots, tdir = _cold_boots(repo, config, sizes.n_boot, snapshots, log)
            results.update(boots)
        else:
            create_sandbox(repo, config).close()  # warm up: owner dir, reaper, /etc scan
        log(f"[{backend}] create x{sizes.n_create} ...")
        created, restored, bwrap_true = [], [], []
        for _ in range(sizes.n_create):  # alternated: one create (timed to ready, without its close), one `bwrap true`
            t = time.perf_counter()
            sb = create_sandbox(repo, config)
            created.append((time.perf_counter() - t) * 1000)
            restored.append(getattr(sb, "restore_s", 0.0) * 1000)
            sb.close()
            if bwrap:
                bwrap_true += timed_ms(bwrap, 1)
        results["create_ms_p50"] = percentile(created, 0.5)
        results["create_ms_p99"] = percentile(created, 0.99)
        if backend == "vm":
            results["restore_ms_p50"] = percentile(restored, 0.5)
        if bwrap:
            results["bwrap_true_ms_p50"] = statistics.median(bwrap_true)

        with SandboxPool(repo, config, size=4) as pool:
            pool.wait_full(300)
            acquired = []
            for _ in range(sizes.pool_rounds):
                pool.wait_full(300)
                t = time.perf_counter()
                sb = pool.acquire()
                acquired.append((time.perf_counter() - t) * 1000)
                sb.close()
            results["pool_acquire_ms_p50"] = statistics.median(acquired)

        log(f"[{backend}] exec x{sizes.n_exec} ...")
        with create_sandbox(repo, config) as sb:
            for _ in range(50):
                sb.exec("true")
                subprocess.run(["true"], check=True)
            timed = {
                "exec": (lambda: sb.exec("true"), sizes.n_exec),
                "subprocess": (lambda: subprocess.run(["true"], check=True), 100 if quick else 300),
            }
            times = alternated(timed, rounds=20)
            execs = times["exec"]
            results["subprocess_ms_p50"] = statistics.median(times["subprocess"])
            results["exec_ms_p50"] = percentile(execs, 0.5)
            results["exec_ms_p99"] = percentile(execs, 0.99)
            externals = timed_ms(lambda: sb.exec("/bin/true"), sizes.n_exec // 5)
            results["exec_external_ms_p50"] = statistics.median(externals)

            log(f"[{backend}] fork(4) x{sizes.n_fork} ...")
            sb.exec("mkdir -p build && for i in $(seq 50); do echo $i > build/f$i.txt; done; rm pkg0/mod0.py")
            per_child = []
            for _ in range(sizes.n_fork):
                t = time.perf_counter()
                kids = sb.fork(4)
                per_child.append((time.perf_counter() - t) * 1000 / 4)
                assert kids[0].exec("cat build/f7.txt").output.strip() == "7"
                for k in kids:
                    k.close()
            results["fork_ms_p50"] = statistics.median(per_child)

        log(f"[{backend}] up to {sizes.n_live} live sandboxes ...")
        started = time.monotonic()
        live, stop = _hold_live(repo, config, sizes, log)
        try:
            answering = sum(1 for sb in live if sb.exec("echo ok").output == "ok\n")
            pids = [pid for sb in live for pid in sandbox_pids(sb)]
            rss = pss = 0
            for pid in pids:
                r, p = procs.rss_kb(pid)
                rss += r
                pss += p
            window_s = 3.0
            ticks = cpu_ticks(pids)
            time.sleep(window_s)
            busy_s = (cpu_ticks(pids) - ticks) / os.sysconf("SC_CLK_TCK")
            results["max_live_sandboxes"] = answering
            results["rss_mb_per_sandbox"] = rss / 1024 / max(len(live), 1)
            results["pss_mb_per_sandbox"] = pss / 1024 / max(len(live), 1)
            if backend == "vm":  # QEMU's own share: all but the guest's RAM, which maps the snapshot's RAM file
                guest_kb = sum(guest_ram_pss_kb(sb.vm.proc.pid, tdir) for sb in live)
                results["vmm_pss_mb_per_sandbox"] = (pss - guest_kb) / 1024 / max(len(live), 1)
            results["idle_cpu_pct_per_sandbox"] = busy_s / window_s * 100 / max(len(live), 1)
            if backend == "vm":
                results["live_stop"] = stop
        finally:
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda s: s.close(), live))
        if backend == "vm":
            results["live_wall_s"] = time.monotonic() - started
            results["snapshots_booted"] = sum(1 for name in os.listdir(tdir) if name != "lock")  # 1 unless rebuilt
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if snapshots:
            shutil.rmtree(snapshots, ignore_errors=True)
            if saved_templates is None:
                os.environ.pop("CODEFLEET_VM_TEMPLATES", None)
            else:
                os.environ["CODEFLEET_VM_TEMPLATES"] = saved_templates
    results["exec_vs_subprocess"] = results["exec_ms_p50"] / results["subprocess_ms_p50"]
    if backend == "vm":
        notes = []
        if results["accel"] == "tcg":
            notes.append(
                "accel=tcg: this host's /dev/kvm cannot run the guest kernel, so the VMs ran under QEMU's "
                "TCG emulation; the speed targets (restore <= 100 ms, exec <= 1 ms, fork <= 50 ms per child) "
                "are for KVM and do not apply, and the figures are TCG's as measured"
            )
        if results["snapshots_booted"] > 1:
            notes.append(
                f"{results['snapshots_booted'] - 1} more snapshot(s) booted after the cold boots: the "
                "guest's code or the host's userland changed while the bench ran, so a create or more "
                "included a cold boot"
            )
        if sizes.n_boot == 1:
            notes.append("quick: one cold boot, so boot_ms_p99 is that one sample")
        if notes:
            results["note"] = "; ".join(notes)
    return results


def _rounded(r: dict) -> dict:
    return {
        k: (round(v, 4) if isinstance(v, float) else _rounded(v) if isinstance(v, dict) else v) for k, v in r.items()
    }


RATIO_KEYS = (
    "create_ms_p50",
    "pool_acquire_ms_p50",
    "exec_ms_p50",
    "exec_ms_p99",
    "exec_external_ms_p50",
    "fork_ms_p50",
    "max_live_sandboxes",
    "rss_mb_per_sandbox",
    "pss_mb_per_sandbox",
)


def run(quick: bool = False, backend: str = "auto", log=print) -> dict:
    if backend in ("vm", "both") and (why := vm.vm_unavailable_reason()) is not None:
        raise SandboxUnavailableError(f"the vm backend cannot run here: {why}")
    if backend == "both":
        ns, vms = _run_backend("namespace", quick, log), _run_backend("vm", quick, log)
        results = {
            "backend": "both",
            "quick": quick,
            "namespace": ns,
            "vm": vms,
            "vm_over_namespace": {k: vms[k] / ns[k] for k in RATIO_KEYS if ns.get(k) and k in vms},
        }
        if vms.get("note"):
            results["note"] = vms["note"]
        return _rounded(results)
    requested, backend = backend, resolve_backend(backend)
    results = _run_backend(backend, quick, log)
    if requested == "auto" and backend == "local":
        results["note"] = (
            f"measured the local backend (no isolation): the namespace backend cannot run here ({unavailable_reason()})"
        )
    return _rounded(results)


_TARGETS = {
    "create_ms_p50": "<= 15",
    "fork_ms_p50": "<= 15 per child",
    "exec_ms_p50": "<= 1 and < subprocess",
    "rss_mb_per_sandbox": "<= 10",
    "max_live_sandboxes": ">= 500 (full run)",
}
_VM_TARGETS = {  # the targets (for KVM) and the anchors it names
    "boot_ms_p50": "E2B cold start p50 442 (third-party)",
    "boot_to_agent_ms_p50": "Firecracker <= 125 (spec)",
    "restore_ms_p50": "<= 100 (KVM)",
    "exec_ms_p50": "<= 1 (KVM)",
    "fork_ms_p50": "<= 50 per child (KVM); forkd ~1",
    "max_live_sandboxes": ">= 100 at 256 MB (full run)",
    "vmm_pss_mb_per_sandbox": "Firecracker VMM <= 5 MiB (spec)",
}
_ROWS = (
    "boot_ms_p50",
    "boot_ms_p99",
    "boot_to_agent_ms_p50",
    "create_ms_p50",
    "create_ms_p99",
    "restore_ms_p50",
    "pool_acquire_ms_p50",
    "exec_ms_p50",
    "exec_ms_p99",
    "exec_external_ms_p50",
    "fork_ms_p50",
    "max_live_sandboxes",
    "rss_mb_per_sandbox",
    "pss_mb_per_sandbox",
    "vmm_pss_mb_per_sandbox",
    "idle_cpu_pct_per_sandbox",
    "live_wall_s",
    "subprocess_ms_p50",
    "bwrap_true_ms_p50",
    "exec_vs_subprocess",
)
_PEERS = ("subprocess_ms_p50", "bwrap_true_ms_p50")


def _cell(v: object) -> str:
    return "" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def _aligned(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(
            c.ljust(w) if i in (0, len(row) - 1) else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=False))
        ).rstrip()
        for row in rows
    )


def table(r: dict) -> str:
    if r["backend"] == "both":
        ns, vms, ratio = r["namespace"], r["vm"], r["vm_over_namespace"]
        rows = [("metric", "namespace", "vm", "vm/namespace", "vm target / anchor")]
        for key in _ROWS:
            if key in ns or key in vms:
                rows.append(
                    (
                        key,
                        _cell(ns.get(key)),
                        _cell(vms.get(key)),
                        f"{ratio[key]:.1f}x" if key in ratio else "",
                        _VM_TARGETS.get(key, ""),
                    )
                )
        extra = [f"vm: accel {vms['accel']}, {vms['memory_mb']} MB per VM; live VMs stopped: {vms['live_stop']}"]
        return _aligned(rows) + "\n" + "\n".join(extra)
    targets = _VM_TARGETS if r["backend"] == "vm" else _TARGETS
    rows = [("metric", "value", "target / peer")]
    for key in _ROWS:
        if key in r:
            rows.append((key, _cell(r[key]), targets.get(key, "peer" if key in _PEERS else "")))
    out = _aligned(rows)
    if r["backend"] == "vm":
        out += f"\naccel {r['accel']}, {r['memory_mb']} MB per VM; live VMs stopped: {r['live_stop']}"
    return out


def run_cli(quick: bool = False, as_json: bool = False, backend: str = "auto") -> int:
    def title(r: dict) -> str:
        which = "namespace and vm backends" if r["backend"] == "both" else f"{r['backend']} backend"
        return f"codefleet bench sandbox ({which}{', quick' if quick else ''})"

    return report(
        lambda log: run(quick=quick, backend=backend, log=log), title, table, as_json, note_key="note", name="sandbox"
    )
