"""`codefleet env build SPEC`: an environment built without Docker, one cached layer per step.

    base: python.tar              # an image: archive, oci-layout directory or imported id; or debian:<suite>
    apt: [git, make]              # apt-get install --no-install-recommends, then the lists are dropped
    python:                       # a virtual environment with pinned requirements
      venv: /opt/venv
      requirements: [pytest==8.3.3]
      find_links: wheels/         # optional: install from this directory only (no index)
    run: ["make -C /opt/tool install"]

Steps run in order: `apt`, then `python`, then each `run` command. Each is a layer keyed by the hash of its
inputs and of every step below it, so a rebuild with nothing changed is a no-op and a changed step rebuilds
itself and what follows. A `debian:<suite>` base is made by `mmdebstrap` (or `debootstrap`), keyed by the suite
and the tool's version.

A step runs as root in a bubblewrap sandbox whose root is an overlay: below, the steps before it merged (hard
links, as an imported image's rootfs); above, an empty directory that collects what the step writes. It has
its own PID, IPC and UTS namespaces and the host's network (packages are downloaded); nothing of the host's
files but `/etc/resolv.conf` and a `find_links` directory, read-only. What it wrote becomes the layer: the
overlay's whiteouts (deleted files) and opaque directories become OCI `.wh.` entries, device nodes are dropped,
and set-ID and write bits are cleared as an import clears them. A failed step leaves its log in
`logs/<key>.log`, raises one error naming the step, and caches nothing; the steps below it stay cached.

Building needs root (overlay mounts, a root-owned userland) and, for downloads, the network; it is a set-up
step, run where the registries are reachable.
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
from codefleet.sandbox.layers import MS_NODEV, MS_NOSUID, mount, umount
from codefleet.sandbox.oci import ImageError

STEP_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_SPEC_KEYS = ("base", "apt", "python", "run")
_PYTHON_KEYS = ("venv", "requirements", "find_links")


@dataclass
class BuildSpec:
    base: str
    apt: list[str] = field(default_factory=list)
    python: dict = field(default_factory=dict)
    run: list[str] = field(default_factory=list)
    root: str = "."  # the spec file's directory: relative paths in it are relative to this

    def steps(self) -> list[tuple[str, str]]:
        """(what, shell command) of every step above the base, in order."""
        out = []
        if self.apt:
            packages = " ".join(self.apt)
            out.append((f"apt {packages}", "export DEBIAN_FRONTEND=noninteractive; apt-get update -q && "
                        f"apt-get install -y -q --no-install-recommends {packages} && apt-get clean && "
                        "rm -rf /var/lib/apt/lists/*"))
        if self.python:
            venv = self.python.get("venv", "/opt/venv")
            reqs = " ".join(f"'{r}'" for r in self.python.get("requirements", []))
            source = "--no-index --find-links /codefleet-wheels" if self.python.get("find_links") else ""
            command = f"python3 -m venv {venv}"
            if reqs:
                command += f" && {venv}/bin/python -m pip install -q --no-cache-dir {source} {reqs}"
            out.append((f"python venv {venv} {reqs}".strip(), command))
        out += [(f"run {command}", command) for command in self.run]
        return out


def load_spec(path: str) -> BuildSpec:
    """A build spec from YAML (or JSON); ImageError naming every problem."""
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise ImageError(f"cannot read the build spec {path}: {e}") from None
    problems = []
    if not isinstance(data, dict):
        raise ImageError(f"the build spec {path} is not a mapping of {', '.join(_SPEC_KEYS)}")
    problems += [f"unknown key {k!r} (allowed: {', '.join(_SPEC_KEYS)})" for k in data if k not in _SPEC_KEYS]
    if not isinstance(data.get("base"), str) or not data.get("base"):
        problems.append("base: required, an image (archive, oci-layout directory, imported id) or debian:<suite>")
    for key in ("apt", "run"):
        if not isinstance(data.get(key, []), list) or not all(isinstance(v, str) and v for v in data.get(key, [])):
            problems.append(f"{key}: a list of non-empty strings")
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


def build(spec: BuildSpec, store_dir: str | None = None, log=print) -> environments.Environment:
    """The environment `spec` describes, building the layers not in the store yet (see the module docstring)."""
    if os.geteuid() != 0:
        raise ImageError("codefleet env build needs root (overlay mounts, a root-owned userland); run it as root")
    store = os.path.abspath(store_dir or environments.default_store_dir())
    for sub in ("", "layers", "images", "logs"):
        os.makedirs(os.path.join(store, sub), mode=0o711, exist_ok=True)
    key, layers = _base(spec, store, log)
    find_links = os.path.join(spec.root, spec.python["find_links"]) if spec.python.get("find_links") else None
    for what, command in spec.steps():
        key = _hash(key, what, command, _dir_digest(find_links) if what.startswith("python") and find_links else "")
        layer = os.path.join(store, "layers", f"sha256-{key}")
        if os.path.isdir(layer):
            log(f"cached  {what}")
        else:
            log(f"build   {what}")
            _run_step(store, layers, layer, key, what, command, find_links)
        layers.append(layer)
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
    return image.id.removeprefix("sha256:"), [os.path.join(store, "layers", layer.replace(":", "-", 1))
                                              for layer in image.layers]


def _debian(suite: str, store: str, log) -> tuple[str, list[str]]:
    tool = shutil.which("mmdebstrap") or shutil.which("debootstrap")
    if tool is None:
        raise ImageError("a debian:<suite> base needs mmdebstrap or debootstrap (apt-get install mmdebstrap)")
    version = subprocess.run([tool, "--version"], capture_output=True, text=True).stdout.strip()
    key = _hash("debian", suite, os.path.basename(tool), version)
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
    _seal(tmp)
    os.rename(tmp, layer)
    return key, [layer]


def _run_step(store: str, below: list[str], layer: str, key: str, what: str, command: str,
              find_links: str | None) -> None:
    work = tempfile.mkdtemp(prefix=".tmp-build-", dir=store)
    lower, upper, overlay_work, merged = (os.path.join(work, n) for n in ("lower", "upper", "work", "merged"))
    for d in (upper, overlay_work, merged):
        os.mkdir(d, 0o755)
    log_path = os.path.join(store, "logs", f"{key}.log")
    mounted = False
    try:
        environments.merge_layers(below, lower)
        mount("overlay", merged, "overlay", f"lowerdir={lower},upperdir={upper},workdir={overlay_work}",
              MS_NOSUID | MS_NODEV)
        mounted = True
        args = ["bwrap", "--bind", merged, "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
                "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--die-with-parent", "--new-session",
                "--clearenv", "--setenv", "PATH", STEP_PATH, "--setenv", "HOME", "/root", "--setenv", "LANG", "C.UTF-8"]
        if os.path.exists("/etc/resolv.conf"):
            args += ["--ro-bind", "/etc/resolv.conf", "/etc/resolv.conf"]
        if find_links:
            args += ["--ro-bind", find_links, "/codefleet-wheels"]
        shell = next((sh for sh in ("/bin/sh", "/bin/bash") if environments.resolve_inside(lower, sh)), None)
        if shell is None:
            raise ImageError(f"the build step `{what}` has no shell to run in: the layers below it have neither "
                             "/bin/sh nor /bin/bash")
        with open(log_path, "w") as out:
            done = subprocess.run(args + [shell, "-c", command], stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            with open(log_path, errors="replace") as f:
                tail = " | ".join(f.read().strip().splitlines()[-3:])[-400:]
            raise ImageError(f"the build step `{what}` failed (exit {done.returncode}): {tail} (log: {log_path}); "
                             "nothing of it was kept")
        umount(merged)
        mounted = False
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.join(store, "layers"))
        try:
            _as_oci_layer(upper, tmp)
            _seal(tmp)
            os.rename(tmp, layer)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    finally:
        if mounted:
            umount(merged)
        environments.remove_store_tree(work)


def _as_oci_layer(upper: str, out: str) -> None:
    """An overlay upper directory as an OCI layer directory: a whiteout (a 0/0 character device) becomes
    `.wh.NAME`, an opaque directory gets `.wh..wh..opq`, other device nodes and FIFOs are dropped."""
    for here, dirs, files in os.walk(upper):
        rel = os.path.relpath(here, upper)
        dst = os.path.normpath(os.path.join(out, rel))
        os.makedirs(dst, exist_ok=True)
        shutil.copystat(here, dst)
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
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), target)
            elif stat.S_ISREG(st.st_mode):
                shutil.copy2(src, target, follow_symlinks=False)


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
