"""`codefleet bench env`: what an OCI image environment costs next to the host's userland.

One run builds an image on this machine (no registry, no network: bench/image_fixture.py copies the
host's python3, bash, git and coreutils with the libraries they load into a base layer, plus a small
top layer), then measures:

- import: the archive into an empty store (`import_s_cold`, a median over fresh stores: every layer
  verified, unpacked and the rootfs hard-linked together), then the same archive again
  (`import_s_cached`: a no-op that only reads the archive's index and config).
- create, fork, exec with `SandboxConfig(environment=rootfs)` against the host userland (the peer),
  interleaved in the same run: each round times one host and one image create (in alternating order),
  one `fork(4)` of each, and a block of `true`s in each persistent shell, so a burst of load on the
  shared machine hits both sides. The deltas are image p50 minus host p50; the target (issue 37) is
  create and fork within 2 ms of the host figures once the image is cached.
- build: `codefleet env build` of a spec with a few `run` steps on that image (`build_s_cold`: each
  step runs in bubblewrap over the layers below and becomes a layer; `build_s_cached`: the same spec
  again, every step found in the store). Building needs root; without it `not_measured` says so.
- disk: a second image that shares the first's base layer plus its own small top layer costs only
  that layer and the directories of its rootfs (its files are hard links to the layers'). Disk is the
  store's blocks with every inode counted once.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tarfile
import tempfile
import time

from codefleet.bench.image_fixture import BASELINE_TOOLS, Layer, host_userland_layer, oci_tarball
from codefleet.bench.report import report
from codefleet.bench.sandbox_bench import make_repo
from codefleet.bench.timing import alternated, percentile
from codefleet.sandbox import SandboxConfig, create_sandbox
from codefleet.sandbox.envbuild import BuildSpec, build
from codefleet.sandbox.environments import import_image

# Beyond the baseline (python3, bash, git, cat, mkdir, rm, cp, mktemp): what an agent's tools call.
EXTRA_TOOLS = ("/bin/ls", "/bin/grep", "/bin/sed", "/usr/bin/env", "/usr/bin/find", "/usr/bin/head")
TARGET_DELTA_MS = 2.0
FORK_CHILDREN = 4
# What `codefleet env build` runs over the imported image (its own tools; no network, no apt or pip).
BUILD_STEPS = [
    "mkdir -p /opt/tool && echo 1 > /opt/tool/version",
    "python3 -c \"open('/opt/tool/hello.py', 'w').write('print(1)')\" && python3 /opt/tool/hello.py",
]
QUICK = {"create_rounds": 15, "fork_rounds": 4, "exec_per_side": 300, "cold_imports": 1}
FULL = {"create_rounds": 300, "fork_rounds": 40, "exec_per_side": 3000, "cold_imports": 3}


def disk_bytes(root: str) -> int:
    """Blocks used under `root`, every inode counted once (a hard link costs its directory entry only)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for d, dirs, files in os.walk(root):
        for name in [None, *dirs, *files]:
            st = os.lstat(d if name is None else os.path.join(d, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def top_layer(name: str) -> bytes:
    """A small layer of the kind a task adds on a shared base: a release file and a module."""
    return (
        Layer()
        .add("etc", tarfile.DIRTYPE, mode=0o755)
        .add("etc/image-release", data=f"{name}\n".encode())
        .add("opt", tarfile.DIRTYPE, mode=0o755)
        .add("opt/task", tarfile.DIRTYPE, mode=0o755)
        .add("opt/task/setup.py", data=f"# {name}\n".encode() * 200)
        .bytes()
    )


def _write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def _import_s(archive: str, store: str) -> float:
    t = time.perf_counter()
    import_image(archive, store)
    return time.perf_counter() - t


def run(quick: bool = False, log=print) -> dict:
    cfg = QUICK if quick else FULL
    work = tempfile.mkdtemp(prefix="codefleet-bench-env-", dir="/var/tmp")
    os.chmod(work, 0o755)  # the sandbox user walks through it to the store and the state directory
    tools = tuple(t for t in BASELINE_TOOLS + EXTRA_TOOLS if os.path.exists(t))
    results: dict = {
        "quick": quick,
        "backend": "namespace",
        **cfg,
        "fork_children": FORK_CHILDREN,
        "image_tools": [os.path.basename(t) for t in tools],
        "build_steps": len(BUILD_STEPS),
    }
    try:
        log("building the image from the host's userland ...")
        base = host_userland_layer(tools=tools).bytes()
        first = _write(os.path.join(work, "first.tar"), oci_tarball([base, top_layer("first")]))
        second = _write(os.path.join(work, "second.tar"), oci_tarball([base, top_layer("second")]))
        results["archive_mb"] = os.path.getsize(first) / 1e6

        log(f"import x{cfg['cold_imports']} cold, x3 cached ...")
        cold = [_import_s(first, os.path.join(work, f"cold-{i}")) for i in range(cfg["cold_imports"])]
        store = os.path.join(work, "store")
        cold.append(_import_s(first, store))
        results["import_s_cold"] = statistics.median(cold)
        results["import_s_cached"] = statistics.median(_import_s(first, store) for _ in range(3))
        for i in range(cfg["cold_imports"]):
            shutil.rmtree(os.path.join(work, f"cold-{i}"))
        env = import_image(first, store)
        before = disk_bytes(store)
        results["image_mb"] = before / 1e6
        import_image(second, store)
        results["disk_mb_per_extra_image_sharing_base"] = (disk_bytes(store) - before) / 1e6

        if os.geteuid() == 0:
            log(f"env build of {len(BUILD_STEPS)} run steps on the image, cold then cached ...")
            spec = BuildSpec(base=first, run=BUILD_STEPS, root=work)
            for when in ("cold", "cached"):
                t = time.perf_counter()
                build(spec, store, log=lambda line: None)
                results[f"build_s_{when}"] = time.perf_counter() - t
        else:
            results["not_measured"] = "codefleet env build (it needs root)"

        state = os.path.join(work, "state")
        configs = {
            "host": SandboxConfig(backend="namespace", state_dir=state),
            "image": SandboxConfig(backend="namespace", state_dir=state, environment=env.rootfs),
        }
        repo = make_repo(work)
        for config in configs.values():  # warm up: owner dir, reaper, the image's /etc
            create_sandbox(repo, config).close()

        log(f"create x{cfg['create_rounds']} rounds of host + image ...")
        created: dict[str, list[float]] = {"host": [], "image": []}
        for i in range(cfg["create_rounds"]):
            for side in ("host", "image") if i % 2 == 0 else ("image", "host"):
                t = time.perf_counter()
                sb = create_sandbox(repo, configs[side])
                created[side].append((time.perf_counter() - t) * 1000)
                sb.close()

        log(f"fork({FORK_CHILDREN}) x{cfg['fork_rounds']} rounds, exec x{cfg['exec_per_side']} per side ...")
        forked: dict[str, list[float]] = {"host": [], "image": []}
        parents = {side: create_sandbox(repo, config) for side, config in configs.items()}
        try:
            for side, sb in parents.items():  # changes in the workspace for fork to carry (bash and the image's tools)
                setup = sb.exec(
                    "mkdir -p build && for i in {1..50}; do echo $i > build/f$i.txt; done && rm pkg0/mod0.py"
                )
                if not setup.ok:
                    raise RuntimeError(f"the {side} sandbox could not make its changes: {setup.output.strip()}")
            for i in range(cfg["fork_rounds"]):
                for side in ("host", "image") if i % 2 == 0 else ("image", "host"):
                    t = time.perf_counter()
                    kids = parents[side].fork(FORK_CHILDREN)
                    forked[side].append((time.perf_counter() - t) * 1000 / FORK_CHILDREN)
                    seen = kids[0].exec("cat build/f7.txt").output.strip()
                    if seen != "7":
                        raise RuntimeError(f"a {side} fork does not see its parent's changes: {seen!r}")
                    for k in kids:
                        k.close()
            for sb in parents.values():
                for _ in range(50):
                    sb.exec("true")
            execs = alternated(
                {side: (lambda sb=sb: sb.exec("true"), cfg["exec_per_side"]) for side, sb in parents.items()}, rounds=20
            )
        finally:
            for sb in parents.values():
                sb.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for what, times in (("create", created), ("fork", forked), ("exec", execs)):
        for side in ("image", "host"):
            results[f"{what}_ms_p50_{side}"] = percentile(times[side], 0.5)
    results = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in results.items()}
    for what in ("create", "fork"):  # from the rounded figures, so the printed delta is their difference
        results[f"{what}_delta_ms"] = round(results[f"{what}_ms_p50_image"] - results[f"{what}_ms_p50_host"], 4)
    results["target_met"] = max(results["create_delta_ms"], results["fork_delta_ms"]) <= TARGET_DELTA_MS
    return results


_ROWS = (  # (what, image key, host key, delta key, target)
    ("create ms p50", "create_ms_p50_image", "create_ms_p50_host", "create_delta_ms", f"delta <= {TARGET_DELTA_MS}"),
    (
        "fork ms p50 (per child)",
        "fork_ms_p50_image",
        "fork_ms_p50_host",
        "fork_delta_ms",
        f"delta <= {TARGET_DELTA_MS}",
    ),
    ("exec ms p50 (true)", "exec_ms_p50_image", "exec_ms_p50_host", None, ""),
)


def table(r: dict) -> str:
    rows = [("figure", "image", "host", "delta", "target")]
    for what, image, host, delta, target in _ROWS:
        d = r[delta] if delta else r[image] - r[host]
        rows.append((what, f"{r[image]:.3f}", f"{r[host]:.3f}", f"{d:+.3f}", target))
    rows += [
        ("import s, cold", f"{r['import_s_cold']:.4f}", "", "", ""),
        ("import s, cached", f"{r['import_s_cached']:.4f}", "", "", ""),
        *[
            (f"env build s, {when} ({r['build_steps']} steps)", f"{r[f'build_s_{when}']:.4f}", "", "", "")
            for when in ("cold", "cached")
            if f"build_s_{when}" in r
        ],
        ("image MB in the store", f"{r['image_mb']:.2f}", "", "", ""),
        ("MB per extra image on the base", f"{r['disk_mb_per_extra_image_sharing_base']:.3f}", "", "", ""),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = [
        f"{a:<{widths[0]}}  {b:>{widths[1]}}  {c:>{widths[2]}}  {d:>{widths[3]}}  {e}".rstrip()
        for a, b, c, d, e in rows
    ]
    met = "met" if r["target_met"] else "NOT met"
    lines.append(f"target (create and fork within {TARGET_DELTA_MS} ms of the host userland, image cached): {met}")
    if r.get("not_measured"):
        lines.append(f"not measured: {r['not_measured']}")
    return "\n".join(lines)


def run_cli(quick: bool = False, as_json: bool = False) -> int:
    title = f"codefleet bench env (namespace backend, image vs host userland{', quick' if quick else ''})"
    return report(lambda log: run(quick=quick, log=log), lambda r: title, table, as_json, name="env")
