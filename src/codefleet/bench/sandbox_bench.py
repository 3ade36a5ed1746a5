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
  processes (bwrap, bwrap's PID 1, bash) per sandbox.

Each figure and its peer are timed alternately in the same run (each create
followed by one `bwrap true`; exec and `subprocess.run` in alternating
blocks), so a burst of load on the shared machine hits both sides. Timing is
shared-machine noisy: read medians and the ratios to the peers.

`--backend auto` measures the local backend (no isolation) where the namespace
backend cannot run, and says why in `note`.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from codefleet.bench.report import report
from codefleet.sandbox import SandboxConfig, SandboxPool, create_sandbox, procs, resolve_backend
from codefleet.sandbox.bwrap import unavailable_reason


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def _timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def _alternated(timed: dict[str, tuple[Callable[[], object], int]], rounds: int = 10) -> dict[str, list[float]]:
    """Milliseconds of each of `n` calls per named function, run in `rounds` alternating blocks (round i calls
    every function its share of times before round i + 1 starts), so load bursts hit every function alike."""
    out: dict[str, list[float]] = {name: [] for name in timed}
    for i in range(rounds):
        for name, (fn, n) in timed.items():
            share = n * (i + 1) // rounds - n * i // rounds
            out[name] += _timed(fn, share)
    return out


def _make_repo(root: str, files: int = 40) -> str:
    repo = os.path.join(root, "repo")
    for i in range(files):
        d = os.path.join(repo, f"pkg{i % 4}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"mod{i}.py"), "w") as f:
            f.write(f"def f{i}(x):\n    return x + {i}\n" * 20)
    return repo


def _sandbox_pids(sb) -> list[int]:
    if sb.backend == "namespace":
        init = sb._init_pid
        return [pid for pid, _ in sb._pids] + sorted(procs.descendants(init))
    return [sb._proc.pid] + sorted(procs.descendants(sb._proc.pid))


def run(quick: bool = False, backend: str = "auto", log=print) -> dict:
    requested, backend = backend, resolve_backend(backend)
    n_create, n_exec, n_fork, n_live = (40, 500, 5, 100) if quick else (200, 3000, 20, 500)
    work = tempfile.mkdtemp(prefix="codefleet-bench-", dir="/var/tmp")
    os.chmod(work, 0o755)  # the sandbox user walks through it to the state directory (sandbox/state.py)
    config = SandboxConfig(backend=backend, state_dir=os.path.join(work, "state"))
    repo = _make_repo(work)
    results: dict = {"backend": backend, "quick": quick}
    if requested == "auto" and backend == "local":
        results["note"] = (f"measured the local backend (no isolation): the namespace backend cannot run here "
                           f"({unavailable_reason()})")
    try:
        bwrap = None
        if backend == "namespace" and shutil.which("bwrap"):
            argv = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net",
                    "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                    "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev", "true"]
            bwrap = lambda: subprocess.run(argv, check=True)

        create_sandbox(repo, config).close()  # warm up: owner dir, reaper, /etc scan
        log(f"create x{n_create} ...")
        created, bwrap_true = [], []
        for _ in range(n_create):  # alternated: one create (timed to ready, without its close), one `bwrap true`
            t = time.perf_counter()
            sb = create_sandbox(repo, config)
            created.append((time.perf_counter() - t) * 1000)
            sb.close()
            if bwrap:
                bwrap_true += _timed(bwrap, 1)
        results["create_ms_p50"] = _pct(created, 0.5)
        results["create_ms_p99"] = _pct(created, 0.99)
        if bwrap:
            results["bwrap_true_ms_p50"] = statistics.median(bwrap_true)

        with SandboxPool(repo, config, size=4) as pool:
            pool.wait_full(30)
            acquired = []
            for _ in range(20):
                pool.wait_full(30)
                t = time.perf_counter()
                sb = pool.acquire()
                acquired.append((time.perf_counter() - t) * 1000)
                sb.close()
            results["pool_acquire_ms_p50"] = statistics.median(acquired)

        log(f"exec x{n_exec} ...")
        with create_sandbox(repo, config) as sb:
            for _ in range(50):
                sb.exec("true")
                subprocess.run(["true"], check=True)
            timed = {"exec": (lambda: sb.exec("true"), n_exec),
                     "subprocess": (lambda: subprocess.run(["true"], check=True), 100 if quick else 300)}
            times = _alternated(timed, rounds=20)
            execs = times["exec"]
            results["subprocess_ms_p50"] = statistics.median(times["subprocess"])
            results["exec_ms_p50"] = _pct(execs, 0.5)
            results["exec_ms_p99"] = _pct(execs, 0.99)
            results["exec_external_ms_p50"] = statistics.median(_timed(lambda: sb.exec("/bin/true"), n_exec // 5))

            log(f"fork(4) x{n_fork} ...")
            sb.exec("mkdir -p build && for i in $(seq 50); do echo $i > build/f$i.txt; done; rm pkg0/mod0.py")
            per_child = []
            for _ in range(n_fork):
                t = time.perf_counter()
                kids = sb.fork(4)
                per_child.append((time.perf_counter() - t) * 1000 / 4)
                assert kids[0].exec("cat build/f7.txt").output.strip() == "7"
                for k in kids:
                    k.close()
            results["fork_ms_p50"] = statistics.median(per_child)

        log(f"{n_live} live sandboxes ...")
        live = []
        try:
            with ThreadPoolExecutor(4) as ex:
                futures = [ex.submit(create_sandbox, repo, config) for _ in range(n_live)]
                for f in futures:
                    try:
                        live.append(f.result())
                    except Exception as e:  # report how far we got
                        log(f"  stopped creating: {e}")
                        break
            answering = sum(1 for sb in live if sb.exec("echo ok").output == "ok\n")
            rss = pss = 0
            for sb in live:
                for pid in _sandbox_pids(sb):
                    r, p = procs.rss_kb(pid)
                    rss += r
                    pss += p
            results["max_live_sandboxes"] = answering
            results["rss_mb_per_sandbox"] = rss / 1024 / max(len(live), 1)
            results["pss_mb_per_sandbox"] = pss / 1024 / max(len(live), 1)
        finally:
            with ThreadPoolExecutor(4) as ex:
                list(ex.map(lambda s: s.close(), live))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results["exec_vs_subprocess"] = results["exec_ms_p50"] / results["subprocess_ms_p50"]
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in results.items()}


_TARGETS = {
    "create_ms_p50": "<= 15", "fork_ms_p50": "<= 15 per child", "exec_ms_p50": "<= 1 and < subprocess",
    "rss_mb_per_sandbox": "<= 10", "max_live_sandboxes": ">= 500 (full run)",
}


def table(r: dict) -> str:
    rows = [("metric", "value", "target / peer")]
    for key in ("create_ms_p50", "create_ms_p99", "pool_acquire_ms_p50", "exec_ms_p50", "exec_ms_p99",
                "exec_external_ms_p50", "fork_ms_p50", "max_live_sandboxes", "rss_mb_per_sandbox",
                "pss_mb_per_sandbox", "subprocess_ms_p50", "bwrap_true_ms_p50", "exec_vs_subprocess"):
        if key in r:
            peer = _TARGETS.get(key, "peer" if key in ("subprocess_ms_p50", "bwrap_true_ms_p50") else "")
            rows.append((key, f"{r[key]:.3f}" if isinstance(r[key], float) else str(r[key]), peer))
    w0, w1 = max(len(a) for a, _, _ in rows), max(len(b) for _, b, _ in rows)
    return "\n".join(f"{a:<{w0}}  {b:>{w1}}  {c}" for a, b, c in rows)


def run_cli(quick: bool = False, as_json: bool = False, backend: str = "auto") -> int:
    return report(lambda log: run(quick=quick, backend=backend, log=log),
                  lambda r: f"codefleet bench sandbox ({r['backend']} backend{', quick' if quick else ''})",
                  table, as_json, note_key="note", name="sandbox")