"""The disks a `vm` sandbox boots with (vm_image.py builds the rest), built from what the host has and cached,
content-addressed, under `vm_image.vm_dir()`:

- the environment's disk (`environment_disk()`): an environment's root filesystem, or the host userland
  by allow-list (`HOST_USERLAND`: programs, libraries, shared data) with an /etc made for the guest
  (`guest_etc`: its own passwd and group, the loader's cache; nothing of the host's secrets, which a guest
  kernel exploit would otherwise reach), as an erofs image readable by its owner alone. Built once per
  fingerprint, in seconds per GB;
- per sandbox, its workspace disk (`workspace_disk()`): an ext4 image of the repository, made by
  mkfs.ext4 from the directory without mounting anything (the host never mounts a disk a guest wrote).
"""

from __future__ import annotations

import fcntl
import glob
import hashlib
import os
import shlex
import shutil
import stat
import subprocess
import tempfile

from codefleet.sandbox.base import SandboxUnavailableError
from codefleet.sandbox.vm_agent import GROUP, PASSWD
from codefleet.sandbox.vm_image import vm_dir

# The host userland a guest gets, by allow-list: programs, libraries, headers and shared data (the Python
# installation, git, grep, compilers). Never the host's configuration or state: /etc (the guest gets its own,
# `guest_etc`), /usr/etc and /usr/local/etc, /usr/src, /var, /home, /root. On a merged-/usr host /bin, /sbin
# and /lib* are symlinks into /usr, and stay symlinks.
HOST_USERLAND = (
    "bin",
    "sbin",
    "lib",
    "lib32",
    "lib64",
    "libx32",
    "usr/bin",
    "usr/sbin",
    "usr/lib",
    "usr/lib32",
    "usr/lib64",
    "usr/libx32",
    "usr/libexec",
    "usr/include",
    "usr/share",
    "usr/local/bin",
    "usr/local/sbin",
    "usr/local/lib",
    "usr/local/lib64",
    "usr/local/libexec",
    "usr/local/include",
    "usr/local/share",
)
# An environment's root filesystem (an image: its own /etc) is taken by these top directories.
IMAGE_TOPS = ("usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc", "opt")
# Of the host's /etc, only what is the same on every host with these packages: the loader's cache and its
# configuration, netbase's tables of services and protocols, and the alternatives' symlinks (awk, cc, vi...).
# No passwd or shadow, no keys, no machine-id, no resolv.conf (the guest has no network, so no CA bundle).
ETC_COPIED = ("ld.so.cache", "ld.so.conf", "services", "protocols")
ETC_DIRS_COPIED = {"ld.so.conf.d": "files", "alternatives": "symlinks"}
DISK_FORMAT = "2"  # what a disk holds beyond its fingerprint's inputs; bumped when that changes
DISK_MODE = 0o600  # QEMU gets a disk as a descriptor its owner opened, never by path


def guest_etc(root: str = "/") -> list[tuple[str, str, str | bytes]]:
    """The /etc of the host userland's disk, as (path under etc, "dir" | "file" | "symlink", content or target):
    the guest's own passwd, group, hosts and nsswitch.conf, and ETC_COPIED and ETC_DIRS_COPIED from `root`."""
    entries: list[tuple[str, str, str | bytes]] = [
        ("passwd", "file", PASSWD.encode()),
        ("group", "file", GROUP.encode()),
        ("hosts", "file", b"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"),
        (
            "nsswitch.conf",
            "file",
            b"".join(
                b"%s: files\n" % db
                for db in (b"passwd", b"group", b"shadow", b"hosts", b"networks", b"protocols", b"services")
            ),
        ),
        ("mtab", "symlink", "../proc/self/mounts"),
    ]
    if os.path.isfile(os.path.join(root, "usr/lib/os-release")):
        entries.append(("os-release", "symlink", "../usr/lib/os-release"))
    for name in ETC_COPIED:
        data = _regular_file(os.path.join(root, "etc", name))
        if data is not None:
            entries.append((name, "file", data))
    for directory, kind in ETC_DIRS_COPIED.items():
        try:
            names = sorted(os.listdir(os.path.join(root, "etc", directory)))
        except OSError:
            continue
        entries.append((directory, "dir", b""))
        for name in names:
            path = os.path.join(root, "etc", directory, name)
            if kind == "symlinks" and os.path.islink(path):
                entries.append((f"{directory}/{name}", "symlink", os.readlink(path)))
            elif kind == "files" and (data := _regular_file(path)) is not None:
                entries.append((f"{directory}/{name}", "file", data))
    return entries


def _regular_file(path: str) -> bytes | None:
    """The content of `path` if it is a regular file (not through a symlink), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with open(fd, "rb") as f:
        return f.read() if stat.S_ISREG(os.fstat(f.fileno()).st_mode) else None


def environment_disk(rootfs: str | None = None, userland: tuple[str, ...] = HOST_USERLAND) -> str:
    """The erofs image of `rootfs` (an environment's root filesystem, its IMAGE_TOPS), or when None of the host's
    `userland` with the guest's own /etc (`guest_etc`). Built once per fingerprint: the allow-list, every byte of
    the generated /etc, and the userland's package state (its top directories', dpkg's status and Python
    packages' times and sizes), never reread whole. The file is its owner's alone (DISK_MODE)."""
    if shutil.which("mkfs.erofs") is None:
        raise SandboxUnavailableError("the vm backend needs mkfs.erofs; install Debian's erofs-utils")
    source = rootfs or "/"
    if not any(os.path.lexists(os.path.join(source, p)) for p in ("usr/bin/python3", "usr/local/bin/python3")):
        raise SandboxUnavailableError(
            f"the environment {source} has no python3 in /usr/bin or /usr/local/bin; the "
            "vm backend's guest agent runs on it (use an image with Python 3.7 or later)"
        )
    stamp = hashlib.sha256(f"{DISK_FORMAT}\0{os.path.abspath(source)}\0".encode())
    if rootfs is None:
        etc = guest_etc()
        present = [p for p in userland if os.path.lexists(os.path.join("/", p))]
        stamp.update(repr((userland, etc)).encode())
    else:
        present = [t for t in IMAGE_TOPS if os.path.lexists(os.path.join(source, t))]
    # Stamped by time: the top directories, dpkg's status, /usr/local/bin and Python's packages, what a command
    # needs fresh; not every directory (a file made and removed in /usr/local/share would cost a minute per 5 GB).
    tops = sorted({p.split("/")[0] for p in present} - {"etc"})
    for t in tops + ["var/lib/dpkg/status", "usr/local/bin", "usr/lib/python3/dist-packages"]:
        try:
            st = os.lstat(os.path.join(source, t))
        except OSError:
            continue
        stamp.update(f"{t}:{st.st_mtime_ns}:{st.st_size}:{st.st_ino}\n".encode())
    path = os.path.join(vm_dir(), "disks", stamp.hexdigest()[:20] + ".erofs")
    if os.path.isfile(path):
        return path
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(path), 0o700)  # DISK_FORMAT 1 made it 0755
    with open(os.path.join(os.path.dirname(path), ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build per disk; whoever waited finds it done
        if not os.path.isfile(path):
            if rootfs is None:
                _build_host_erofs(path, present, etc)
            else:
                _build_erofs(path, source, present)
            _drop_older_disks(path, source)
    return path


def _drop_older_disks(path: str, source: str) -> None:
    """Remove the disks built earlier from the same source (the host userland before a package changed): a
    disk is gigabytes. A VM still running on one keeps its open descriptor."""
    with open(path + ".source", "w") as f:
        f.write(os.path.abspath(source))
    for other in glob.glob(os.path.join(os.path.dirname(path), "*.erofs.source")):
        disk = other[: -len(".source")]
        if disk == path:
            continue
        with open(other) as f:
            same = f.read() == os.path.abspath(source)
        if same:
            for name in (disk, other):
                try:
                    os.unlink(name)
                except FileNotFoundError:
                    pass


def _build_host_erofs(path: str, present: list[str], etc: list[tuple[str, str, str | bytes]]) -> None:
    """The host userland's disk, from a staging root that holds only what it should: the guest's /etc written
    there, the allow-listed directories bind-mounted into it in a mount namespace of mkfs.erofs's own (which
    the mounts end with), their symlinks as symlinks. Not a root: the same in a user namespace of its own,
    every file then recorded as root's (the host's root is nobody there)."""
    with tempfile.TemporaryDirectory(prefix="codefleet-disk-") as stage:
        os.chmod(stage, 0o755)
        binds = []
        for rel in present:
            host, there = os.path.join("/", rel), os.path.join(stage, rel)
            os.makedirs(os.path.dirname(there), mode=0o755, exist_ok=True)
            if os.path.islink(host):
                os.symlink(os.readlink(host), there)
            elif os.path.isdir(host):
                os.mkdir(there, 0o755)
                binds.append(f"mount --bind {shlex.quote(host)} {shlex.quote(there)}\n")
        for rel, kind, content in etc:
            there = os.path.join(stage, "etc", rel)
            os.makedirs(os.path.dirname(there), mode=0o755, exist_ok=True)
            if kind == "dir":
                os.makedirs(there, mode=0o755, exist_ok=True)
            elif kind == "symlink":
                os.symlink(content, there)
            else:
                with open(there, "wb") as f:
                    f.write(content)
                os.chmod(there, 0o644)
        if os.geteuid() == 0:
            _mkfs(path, stage, [], unshare=("unshare", "--mount", "--propagation", "private"), setup="".join(binds))
        else:
            _mkfs(
                path,
                stage,
                ["--all-root"],
                setup="".join(binds),
                unshare=("unshare", "--user", "--map-root-user", "--mount", "--propagation", "private"),
            )


def _build_erofs(path: str, source: str, present: list[str]) -> None:
    # Everything but the userland's top directories is left out: the guest sees no state of the image's build.
    left_out = sorted(set(os.listdir(source)) - set(present))
    _mkfs(path, source, [f"--exclude-path={name}" for name in left_out])


def _mkfs(path: str, source: str, options: list[str], unshare: tuple[str, ...] = (), setup: str = "") -> None:
    """mkfs.erofs of `source` at `path`, by a shell that runs `setup` first (under `unshare`), its file DISK_MODE
    from its first byte to its last (umask 077, then chmod)."""
    tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.part"
    script = f'set -e\numask 077\n{setup}exec "$@"\n'
    proc = subprocess.run(
        [*unshare, "sh", "-c", script, "sh", "mkfs.erofs", "--quiet", "-x-1", *options, tmp, source],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise SandboxUnavailableError(
            f"could not build the environment disk from {source}: {(proc.stderr or proc.stdout).strip()[-400:]}"
        )
    os.chmod(tmp, DISK_MODE)
    os.replace(tmp, path)


def workspace_disk(path: str, repo: str | None, size_mb: int) -> None:
    """An ext4 image at `path` of `size_mb` (sparse) holding `repo`'s files (empty if None)."""
    if shutil.which("mkfs.ext4") is None:
        raise SandboxUnavailableError("the vm backend needs mkfs.ext4; install Debian's e2fsprogs")
    with open(path, "wb") as f:
        f.truncate(size_mb << 20)
    args = [
        "mkfs.ext4",
        "-q",
        "-F",
        "-O",
        "^has_journal",
        "-E",
        "lazy_itable_init=1,nodiscard",
        "-m",
        "0",
        "-L",
        "workspace",
    ]
    if repo is not None:
        args += ["-d", repo]
    proc = subprocess.run(args + [path], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SandboxUnavailableError(f"could not build the workspace disk from {repo}: {proc.stderr.strip()[-300:]}")
