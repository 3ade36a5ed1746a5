"""`codefleet env build SPEC`: an environment built without Docker, one cached layer per step.

    base: python.tar              # an image: archive, oci-layout directory or imported id; or debian:<suite>
    apt: [git, make]              # apt-get install --no-install-recommends, then the lists are dropped
    python:                       # a virtual environment with pinned requirements
      venv: /opt/venv
      requirements: [pytest==8.3.3]
      find_links: wheels/         # optional: install from this directory only (no index)
    run:
      - make -C /opt/tool install
      - {command: "curl -fsSLO https://example.org/x.tgz", network: true}   # a step that downloads

Steps run in order: `apt`, then `python`, then each `run` command. Each is a layer keyed by the hash of its
inputs and of every step below it, so a rebuild with nothing changed is a no-op and a changed step rebuilds
itself and what follows. A `debian:<suite>` base is made by `mmdebstrap` (or `debootstrap`), keyed by the suite
and the tool's version.

A step is hostile (its base image's /bin/sh runs it). It runs as root of a user namespace whose ids are a
block of host ids no user has (buildns.py): it may chown and set set-ID bits in its image, and has no
capability on the host. bwrap gives it its own mount, PID, IPC, UTS and cgroup namespaces, and a network
namespace of its own with only `lo`, unless it needs the network: the `apt` step, the `python` step when it
installs from an index, and a `run` step that says `network: true` (then it also gets a copy of the host's
/etc/resolv.conf). Of the host's files it sees nothing else but a `find_links` directory, read-only. Its root
is an overlay: below, the steps before it merged (hard links, as an imported image's rootfs, seen through an
idmapped mount); above, an empty directory that collects what the step writes. What it wrote becomes the
layer, with the owners the step gave its files (root as the host's root, inside id k > 0 as host id base+k):
the overlay's whiteouts (deleted files) and opaque directories become OCI `.wh.` entries, device nodes are
dropped, and set-ID and write bits are cleared as an import clears them. A failed step leaves its log in
`logs/<key>.log`, raises one error naming the step, and caches nothing; the steps below it stay cached.

Building needs root (overlay mounts, the namespace's id maps) and user namespaces; it never runs a step as
the host's root. For downloads it needs the network; it is a set-up step, run where the registries are
reachable.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass, field

import yaml

from codefleet.sandbox import environments
from codefleet.sandbox.buildns import StepNamespace, shift_tree, store_ids
from codefleet.sandbox.layers import MS_BIND, MS_NODEV, MS_NOSUID, MS_RDONLY, MS_REMOUNT, mount, umount
from codefleet.sandbox.oci import ImageError

STEP_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SPEC_KEYS = ("base", "apt", "python", "run")
_PYTHON_KEYS = ("venv", "requirements", "find_links")
_RUN_KEYS = ("command", "network")
_MAX_SPEC_CHARS = 1 << 20


@dataclass(frozen=True)
class Step:
    what: str  # what the log says, and part of the layer's key
    command: str  # a shell command
    network: bool  # whether it runs with the host's network (else an empty network namespace of its own)


@dataclass
class BuildSpec:
    base: str
    apt: list[str] = field(default_factory=list)
    python: dict = field(default_factory=dict)
    run: list[str | dict] = field(default_factory=list)  # a command, or {command: ..., network: true}
    root: str = "."  # the spec file's directory: relative paths in it are relative to this

    def steps(self) -> list[Step]:
        """Every step above the base, in order."""
        out = []
        if self.apt:
            packages = " ".join(self.apt)
            out.append(
                Step(
                    f"apt {packages}",
                    "export DEBIAN_FRONTEND=noninteractive; apt-get update -q && "
                    f"apt-get install -y -q --no-install-recommends {packages} && apt-get clean && "
                    "rm -rf /var/lib/apt/lists/*",
                    network=True,
                )
            )
        if self.python:
            venv = self.python.get("venv", "/opt/venv")
            reqs = " ".join(f"'{r}'" for r in self.python.get("requirements", []))
            offline = bool(self.python.get("find_links"))
            source = "--no-index --find-links /codefleet-wheels" if offline else ""
            command = f"python3 -m venv {venv}"
            if reqs:
                command += f" && {venv}/bin/python -m pip install -q --no-cache-dir {source} {reqs}"
            out.append(Step(f"python venv {venv} {reqs}".strip(), command, network=bool(reqs) and not offline))
        for entry in self.run:
            command, network = (
                (entry, False) if isinstance(entry, str) else (entry["command"], bool(entry.get("network")))
            )
            out.append(Step(f"run {command}" + (" (network)" if network else ""), command, network))
        return out


def load_spec(path: str) -> BuildSpec:
    """A build spec from YAML (or JSON); ImageError naming every problem."""
    try:
        with open(path) as f:
            text = f.read(_MAX_SPEC_CHARS + 1)
        if len(text) > _MAX_SPEC_CHARS:
            raise ImageError(
                f"the build spec {path} is longer than {_MAX_SPEC_CHARS} characters; a spec is a few lines"
            )
        data = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ImageError(f"cannot read the build spec {path}: {e}") from None
    except RecursionError:
        raise ImageError(f"the build spec {path} nests too deep to read; a spec is a few lines") from None
    problems = []
    if not isinstance(data, dict):
        raise ImageError(f"the build spec {path} is not a mapping of {', '.join(_SPEC_KEYS)}")
    problems += [f"unknown key {k!r} (allowed: {', '.join(_SPEC_KEYS)})" for k in data if k not in _SPEC_KEYS]
    if not isinstance(data.get("base"), str) or not data.get("base"):
        problems.append("base: required, an image (archive, oci-layout directory, imported id) or debian:<suite>")
    if not isinstance(data.get("apt", []), list) or not all(isinstance(v, str) and v for v in data.get("apt", [])):
        problems.append("apt: a list of non-empty strings")
    if not isinstance(data.get("run", []), list) or not all(_is_run_step(v) for v in data.get("run", [])):
        problems.append(
            "run: a list of commands, each a non-empty string or a mapping {command: a non-empty "
            "string, network: true or false}"
        )
    python = data.get("python", {})
    if not isinstance(python, dict) or set(python) - set(_PYTHON_KEYS):
        problems.append(f"python: a mapping of {', '.join(_PYTHON_KEYS)}")
    if problems:
        raise ImageError(f"the build spec {path} is invalid: " + "; ".join(problems))
    root = os.path.dirname(os.path.abspath(path))
    base = data["base"]
    if not base.startswith(("debian:", "sha256:")) and not os.path.isabs(base):
        base = os.path.join(root, base)
    return BuildSpec(base, list(data.get("apt", [])), dict(python), list(data.get("run", [])), root)


def _is_run_step(entry: object) -> bool:
    if isinstance(entry, dict):
        return (
            not set(entry) - set(_RUN_KEYS)
            and isinstance(entry.get("command"), str)
            and bool(entry["command"])
            and isinstance(entry.get("network", False), bool)
        )
    return isinstance(entry, str) and bool(entry)


def build(spec: BuildSpec, store_dir: str | None = None, log=print) -> environments.Environment:
    """The environment `spec` describes, building the layers not in the store yet (see the module docstring)."""
    if os.geteuid() != 0:
        raise ImageError("codefleet env build needs root (overlay mounts, a root-owned userland); run it as root")
    store = os.path.abspath(store_dir or environments.default_store_dir())
    for sub in ("", "layers", "images", "logs"):
        os.makedirs(os.path.join(store, sub), mode=0o711, exist_ok=True)
    key, layers = _base(spec, store, log)
    find_links = os.path.join(spec.root, spec.python["find_links"]) if spec.python.get("find_links") else None
    namespace = None  # made for the first step that runs (a build with every step cached needs none)
    try:
        for step in spec.steps():
            python = step.what.startswith("python")
            key = _hash(key, step.what, step.command, _dir_digest(find_links) if python and find_links else "")
            layer = os.path.join(store, "layers", f"sha256-{key}")
            if os.path.isdir(layer):
                log(f"cached  {step.what}")
            else:
                namespace = namespace or StepNamespace(store_ids(store))
                log(f"build   {step.what}")
                _run_step(store, layers, layer, key, step, namespace, find_links if python else None)
            layers.append(layer)
    finally:
        if namespace is not None:
            namespace.close()
    image_dir = os.path.join(store, "images", f"sha256-{key}")
    if not os.path.isdir(image_dir):
        environments.store_image(image_dir, key, layers, f"build of {spec.base} ({len(layers)} layers)")
    return environments.Environment(f"sha256:{key}", os.path.join(image_dir, "rootfs"))


def _hash(*parts: str) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def _dir_digest(path: str) -> str:
    """What a directory of wheels holds: names, sizes and times (a changed wheel rebuilds its step)."""
    entries = sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(path) if e.is_file())
    return _hash(*map(str, entries))


def _base(spec: BuildSpec, store: str, log) -> tuple[str, list[str]]:
    """(key, layer directories) of the base."""
    if spec.base.startswith("debian:"):
        return _debian(spec.base.removeprefix("debian:"), store, log)
    name = spec.base if spec.base.startswith("sha256:") else environments.import_image(spec.base, store).name
    image = environments.find_image(name, store)
    return image.id.removeprefix("sha256:"), [
        os.path.join(store, "layers", layer.replace(":", "-", 1)) for layer in image.layers
    ]


def _debian(suite: str, store: str, log) -> tuple[str, list[str]]:
    tool = shutil.which("mmdebstrap") or shutil.which("debootstrap")
    if tool is None:
        raise ImageError("a debian:<suite> base needs mmdebstrap or debootstrap (apt-get install mmdebstrap)")
    version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip()
    key = _hash("debian", suite, os.path.basename(tool), version, "owners above root shifted (buildns.py)")
    layer = os.path.join(store, "layers", f"sha256-{key}")
    if os.path.isdir(layer):
        log(f"cached  debian {suite}")
        return key, [layer]
    log(f"build   debian {suite} ({os.path.basename(tool)})")
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.join(store, "layers"))
    done = subprocess.run([tool, "--variant=minbase", suite, tmp], capture_output=True, text=True)  # both take it
    if done.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ImageError(f"{os.path.basename(tool)} could not make debian {suite}: {done.stderr.strip()[-500:]}")
    shift_tree(tmp, store_ids(store))
    _seal(tmp)
    os.rename(tmp, layer)
    return key, [layer]


def _run_step(
    store: str, below: list[str], layer: str, key: str, step: Step, namespace: StepNamespace, find_links: str | None
) -> None:
    """Run one step over the layers below it and store what it wrote as `layer`. The step's bwrap, nobody on
    the host, reaches what it binds through `work`, which only the host's root and the step's group may walk."""
    work = tempfile.mkdtemp(prefix=".tmp-build-", dir=store)
    os.chown(work, 0, namespace.ids.gid)
    os.chmod(work, 0o710)
    lower, view, upper, overlay_work, merged, wheels = (
        os.path.join(work, n) for n in ("lower", "view", "upper", "work", "merged", "wheels")
    )
    for d in (view, upper, overlay_work, merged, wheels):
        os.mkdir(d, 0o755)
    log_path = os.path.join(store, "logs", f"{key}.log")
    mounted: list[str] = []
    try:
        environments.merge_layers(below, lower)
        shell = _step_shell(lower, step)
        namespace.idmapped_view(lower, view)
        mounted.append(view)
        root = os.stat(lower)
        os.chown(upper, *namespace.running_ids(root.st_uid, root.st_gid))  # the merged root, as the view's
        mount(
            "overlay",
            merged,
            "overlay",
            f"lowerdir={view},upperdir={upper},workdir={overlay_work}",
            MS_NOSUID | MS_NODEV,
        )
        mounted.append(merged)
        args = namespace.enter() + _step_bwrap_args(merged)
        if not step.network:
            args.append("--unshare-net")
        elif os.path.exists("/etc/resolv.conf"):
            shutil.copyfile("/etc/resolv.conf", os.path.join(work, "resolv.conf"))
            args += ["--ro-bind", os.path.join(work, "resolv.conf"), "/etc/resolv.conf"]
        if find_links:
            mount(find_links, wheels, "", "", MS_BIND)
            mounted.append(wheels)
            mount("", wheels, "", "", MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
            args += ["--ro-bind", wheels, "/codefleet-wheels"]
        _run_logged(args + [shell, "-c", step.command], step, log_path, namespace.fd)
        while mounted:
            umount(mounted.pop())
        _store_layer(upper, store, layer, namespace.stored_ids)
    finally:
        while mounted:
            umount(mounted.pop())
        environments.remove_store_tree(work)


def _step_shell(lower: str, step: Step) -> str:
    """The shell that runs `step`: the layers' own /bin/sh, else their /bin/bash; ImageError if neither."""
    shell = next((sh for sh in ("/bin/sh", "/bin/bash") if environments.resolve_inside(lower, sh)), None)
    if shell is None:
        raise ImageError(
            f"the build step `{step.what}` has no shell to run in: the layers below it have "
            "neither /bin/sh nor /bin/bash"
        )
    return shell


def _step_bwrap_args(merged: str) -> list[str]:
    """bwrap and its options for a step whose root is `merged`, but for the network: its own /dev, /proc and
    /tmp, PID, IPC, UTS and cgroup namespaces (its user namespace is the steps', which nsenter enters), and an
    environment of its own."""
    return [
        "bwrap",
        "--bind",
        merged,
        "/",
        "--dev",
        "/dev",
        "--proc",
        "/proc",
        "--perms",
        "1777",
        "--tmpfs",
        "/tmp",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--clearenv",
        "--setenv",
        "PATH",
        STEP_PATH,
        "--setenv",
        "HOME",
        "/root",
        "--setenv",
        "LANG",
        "C.UTF-8",
    ]


def _run_logged(argv: list[str], step: Step, log_path: str, namespace_fd: int) -> None:
    """Run `step` (`argv`, which enters the namespace `namespace_fd`), its output to `log_path`; ImageError with
    the log's last lines if it fails."""
    with open(log_path, "w") as out:
        done = subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, pass_fds=(namespace_fd,)
        )
    if done.returncode != 0:
        with open(log_path, errors="replace") as f:
            tail = " | ".join(f.read().strip().splitlines()[-3:])[-400:]
        raise ImageError(
            f"the build step `{step.what}` failed (exit {done.returncode}): {tail} (log: "
            f"{log_path}); nothing of it was kept"
        )


def _store_layer(upper: str, store: str, layer: str, stored_ids) -> None:
    """What a step wrote (the overlay's `upper`) as the sealed layer directory `layer`: whole, or nothing."""
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.join(store, "layers"))
    try:
        _as_oci_layer(upper, tmp, stored_ids)
        _seal(tmp)
        os.rename(tmp, layer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _as_oci_layer(upper: str, out: str, stored_ids) -> None:
    """An overlay upper directory as an OCI layer directory: a whiteout (a 0/0 character device) becomes
    `.wh.NAME`, an opaque directory gets `.wh..wh..opq`, other device nodes and FIFOs are dropped. Each entry
    keeps the owner the step gave it, as `stored_ids(host uid, host gid)` stores it (buildns.py)."""
    for here, dirs, files in os.walk(upper):
        rel = os.path.relpath(here, upper)
        dst = os.path.normpath(os.path.join(out, rel))
        os.makedirs(dst, exist_ok=True)
        shutil.copystat(here, dst)
        st = os.lstat(here)
        os.chown(dst, *stored_ids(st.st_uid, st.st_gid))
        try:
            if os.getxattr(here, "trusted.overlay.opaque") == b"y":
                open(os.path.join(dst, ".wh..wh..opq"), "w").close()
        except OSError:
            pass
        for name in files + [d for d in dirs if os.path.islink(os.path.join(here, d))]:
            src, target = os.path.join(here, name), os.path.join(dst, name)
            st = os.lstat(src)
            if stat.S_ISCHR(st.st_mode) and st.st_rdev == 0:
                open(os.path.join(dst, ".wh." + name), "w").close()
                continue
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), target)
            elif stat.S_ISREG(st.st_mode):
                shutil.copy2(src, target, follow_symlinks=False)
            else:
                continue
            os.chown(target, *stored_ids(st.st_uid, st.st_gid), follow_symlinks=False)


def _seal(path: str) -> None:
    """No set-ID or write bits, as an imported layer (directories keep u+rx for the store to walk them)."""
    for here, dirs, files in os.walk(path, topdown=False):
        for name in files:
            p = os.path.join(here, name)
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode):
                os.chmod(p, st.st_mode & 0o555)
            elif not stat.S_ISLNK(st.st_mode):
                os.unlink(p)  # device nodes, FIFOs, sockets
        for name in dirs:
            p = os.path.join(here, name)
            if not os.path.islink(p):
                os.chmod(p, (os.lstat(p).st_mode & 0o1555) | 0o500)
    os.chmod(path, 0o555)
