"""What bubblewrap is given: whether it can work here at all, the arguments every
namespace sandbox shares, and the files each owner makes once for its sandboxes.

Backend 'auto' falls back to 'local' only where namespace sandboxes can never
work on this host (`never_works_here`: no bubblewrap, user namespaces off in
the kernel), never after a failure that a sandbox could cause.

Each owner (state.py) makes, once, in its directory's `files/`: a passwd and
group naming the sandbox user `agent`, the execute-only copy of bash the
persistent shell runs from (identity.py; for a sandbox with an environment, a
copy of the environment's own bash, whose /usr, /lib* and /etc replace the
host's: environments.py), and, as root, its own copies of the device nodes
bwrap's --dev would bind from the host, so that not even their times are the
host's. bwrap, running as the sandbox user, reaches them through the state
directory's group: a state directory it cannot walk to is refused once, with
the `chmod` that fixes it.

Nothing of the host's paths or environment is given to what runs inside. bwrap's
own environment and command line stay those of the sandbox's PID 1, which every
command reads (/proc/1/environ, /proc/1/cmdline): its environment is the
sandbox's fixed PATH, its name (argv[0]) its owner's process name
(state.process_name, by which the reaper finds it), and its options, the
workspace's bind included, come through a memfd (--args) that bwrap reads and
closes. A bind mount shows its source's path within its filesystem in
/proc/self/mountinfo, so as root the owner's files (and an environment's
userland) are bound through a read-only overlay of their directory mounted per
sandbox (`mount_view`), whose options name file descriptors (/proc/self/fd/N),
not paths, as the workspace's own overlay does (layers.py).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import stat
import subprocess
import threading
from dataclasses import dataclass

from codefleet.sandbox.base import SandboxConfig, SandboxUnavailableError
from codefleet.sandbox.environments import resolve_inside, rootfs_of
from codefleet.sandbox.identity import Identity, host_identity, write_exec_only_shell
from codefleet.sandbox.layers import MS_NOSUID, mount_overlay
from codefleet.sandbox.state import Owner

SANDBOX_UID = 1000
SHELL_PATH = "/run/codefleet/shell"  # the execute-only bash, inside the sandbox
_DEVICES = ("null", "zero", "full", "random", "urandom", "tty")  # what bwrap's --dev binds from the host
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def never_works_here() -> str | None:
    """Why namespace sandboxes cannot work on this host at all, and what to do, else None: bubblewrap is
    not installed, or the kernel has user namespaces switched off. Only these send backend 'auto' to
    'local'; nothing a sandbox does can cause them."""
    if not shutil.which("bwrap"):
        return (
            "bubblewrap is not installed: run `apt-get install bubblewrap` (or `make test`, which does), "
            "or choose backend='local' (no isolation)"
        )
    for sysctl in ("/proc/sys/user/max_user_namespaces", "/proc/sys/kernel/unprivileged_userns_clone"):
        try:
            with open(sysctl) as f:
                if f.read().strip() == "0":
                    return (
                        f"the kernel has user namespaces switched off ({sysctl} is 0): enable them (sysctl "
                        "user.max_user_namespaces=15000) or choose backend='local' (no isolation)"
                    )
        except OSError:
            pass
    return None


@functools.cache
def unavailable_reason() -> str | None:
    """None if bwrap can build a sandbox here, else a sentence saying what to do."""
    why = never_works_here()
    if why:
        return why
    try:
        ident = host_identity()
    except SandboxUnavailableError as e:
        return str(e)
    probe = subprocess.run(
        ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-net", "--ro-bind", "/", "/", "true"],
        capture_output=True,
        text=True,
        timeout=20,
        cwd="/",
        **ident.popen_kwargs(),
    )
    if probe.returncode != 0:
        return (
            f"bubblewrap cannot create namespaces as {ident.name} here ({probe.stderr.strip()[:200]}); allow "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1, or on Ubuntu an AppArmor "
            "profile for bwrap)"
        )
    return None


@functools.cache
def _can_disable_userns() -> bool:
    help_text = subprocess.run(["bwrap", "--help"], capture_output=True, text=True, timeout=20).stdout
    return "--disable-userns" in help_text


@dataclass(frozen=True)
class OwnerFiles:
    """What an owner's sandboxes bind from its directory's `files/` (`directory`)."""

    directory: str
    passwd: str
    group: str
    shell: str
    devices: str | None  # the owner's own device nodes; None: bwrap binds the host's


_made: dict[str, OwnerFiles] = {}
_made_lock = threading.Lock()


def owner_files(owner: Owner, ident: Identity) -> OwnerFiles:
    """The owner's files, made on its first sandbox (sandboxes start in parallel threads)."""
    with _made_lock:
        if owner.dir not in _made:
            check_reachable(os.path.join(owner.dir, "sb"), ident, "the sandbox state directory holds")
            _made[owner.dir] = _make_owner_files(owner.dir)
        return _made[owner.dir]


def _make_owner_files(owner_dir: str) -> OwnerFiles:
    directory = os.path.join(owner_dir, "files")
    os.mkdir(directory, 0o755)
    passwd, group = os.path.join(directory, "passwd"), os.path.join(directory, "group")
    with open(passwd, "w") as f:
        f.write(
            f"root:x:0:0:root:/root:/bin/sh\nagent:x:{SANDBOX_UID}:{SANDBOX_UID}:agent:/tmp:/bin/bash\n"
            "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"
        )
    with open(group, "w") as f:
        f.write(f"root:x:0:\nagent:x:{SANDBOX_UID}:\nnogroup:x:65534:\n")
    devices = None
    if os.geteuid() == 0 and not os.statvfs(directory).f_flag & os.ST_NODEV:
        devices = os.path.join(directory, "dev")
        os.makedirs(devices)
        for name in _DEVICES:
            os.mknod(os.path.join(devices, name), 0o666 | stat.S_IFCHR, os.stat(f"/dev/{name}").st_rdev)
            os.chmod(os.path.join(devices, name), 0o666)
    return OwnerFiles(directory, passwd, group, write_exec_only_shell(os.path.join(directory, "shell")), devices)


def mount_view(directory: str, empty: str, at: str) -> None:
    """Mount at `at` (an empty directory) a read-only view of `directory` for a sandbox to bind from, so that its
    mountinfo names no host path: an overlay of `directory` (and `empty`: an overlay without an upper layer needs
    two) given as /proc/self/fd/N, which the kernel shows as given. Root only; the caller unmounts it. Not
    MS_RDONLY per mount (the overlay is read-only as a whole): bwrap's --dev-bind keeps its binds writable."""
    mount_overlay(at, [directory, empty], flags=MS_NOSUID)


def host_args(
    config: SandboxConfig,
    files: OwnerFiles,
    ro_sources: dict[str, str] | None = None,
    view: str | None = None,
    userland: str | None = None,
) -> list[str]:
    """The bwrap options of a sandbox with this config, but for its workspace. `ro_sources`: where bwrap binds an
    `ro_binds` path from, when not from itself (a staged bind mount the sandbox user can reach); `view` and
    `userland`: where the owner's files and the environment's root filesystem are bound from, when not from
    their own directories (`mount_view`)."""

    def seen(path: str) -> str:
        return os.path.join(view, os.path.relpath(path, files.directory)) if view else path

    args = _namespace_args()
    if config.environment is None:
        args += userland_args("/", HOST_USERLAND)
        shell = files.shell
    else:
        rootfs = rootfs_of(config.environment)  # an archive is imported once per node
        shell = environment_shell(rootfs, files)
        args += userland_args(userland or rootfs, _IMAGE_USERLAND)
    args += [
        "--ro-bind",
        seen(files.passwd),
        "/etc/passwd",
        "--ro-bind",
        seen(files.group),
        "/etc/group",
        "--ro-bind",
        seen(shell),
        SHELL_PATH,
    ]
    args += _proc_args()
    # /dev is bwrap's own tmpfs, made read-only last (by the caller); /dev/shm, the one place there a program
    # may write, is a tmpfs of its own, sized like /tmp.
    args += ["--dev", "/dev"]
    if files.devices:
        for name in _DEVICES:
            args += ["--dev-bind", seen(os.path.join(files.devices, name)), f"/dev/{name}"]
    args += _tmpfs_args(config.tmp_mb) + _env_args()
    for path in map(os.path.abspath, config.ro_binds):  # after the private /tmp and /var/tmp: binds go on top
        args += ["--ro-bind", (ro_sources or {}).get(path, path), path]
    return args


def _namespace_args() -> list[str]:
    """The namespaces a sandbox gets (all of them, the network's loopback only), its ids inside, and no
    capability; no user namespace of its own where this bwrap can forbid one."""
    args = [
        "--unshare-user",
        "--uid",
        str(SANDBOX_UID),
        "--gid",
        str(SANDBOX_UID),
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-net",
        "--unshare-cgroup-try",
        "--hostname",
        "sandbox",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
    ]
    if _can_disable_userns():
        args.append("--disable-userns")
    return args


# Host-wide kernel state that is world-readable but none of a sandbox's business (as container runtimes mask
# it); what only root may read the sandbox user cannot read anyway.
_MASKED_PROC = (
    "/proc/keys",
    "/proc/key-users",
    "/proc/kcore",
    "/proc/timer_list",
    "/proc/sched_debug",
    "/proc/latency_stats",
)


def _proc_args() -> list[str]:
    """The sandbox's own /proc, with /proc/sys read-only and `_MASKED_PROC` hidden."""
    # /proc/sys read-only even to a sandbox user that some sysctl would let write (bwrap itself covers
    # it only when it finds it writable as a directory, which it never is).
    args = [
        "--proc",
        "/proc",
        "--ro-bind",
        "/proc/sys",
        "/proc/sys",
        "--ro-bind-try",
        "/proc/sysrq-trigger",
        "/proc/sysrq-trigger",
    ]
    for path in _MASKED_PROC:
        if os.path.exists(path):
            args += ["--ro-bind", "/dev/null", path]
    return args


def _tmpfs_args(tmp_mb: int) -> list[str]:
    """/dev/shm, /tmp and /var/tmp: private tmpfs of `tmp_mb` each."""
    return [
        "--size",
        str(tmp_mb << 20),
        "--tmpfs",
        "/dev/shm",
        "--size",
        str(tmp_mb << 20),
        "--tmpfs",
        "/tmp",
        "--size",
        str(tmp_mb << 20),
        "--tmpfs",
        "/var/tmp",
    ]


def _env_args() -> list[str]:
    """The environment of every command: none of the host's, the sandbox's fixed PATH and a user `agent`."""
    return [
        "--clearenv",
        "--setenv",
        "PATH",
        PATH,
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "USER",
        "agent",
        "--setenv",
        "LOGNAME",
        "agent",
        "--setenv",
        "TERM",
        "dumb",
        "--setenv",
        "LANG",
        "C.UTF-8",
        "--setenv",
        "PAGER",
        "cat",
        "--setenv",
        "GIT_PAGER",
        "cat",
    ]


HOST_USERLAND = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_IMAGE_USERLAND = HOST_USERLAND + ("/opt",)


def userland_args(rootfs: str, tops: tuple[str, ...]) -> list[str]:
    """Binds of the top-level directories `tops` of `rootfs` (read-only; a symlink stays a symlink)."""
    args = []
    for top in tops:
        path = os.path.join(rootfs, top.lstrip("/"))
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), top]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, top]
    return args


_environment_shells: dict[tuple[str, str], str] = {}


def environment_shell(rootfs: str, files: OwnerFiles) -> str:
    """The execute-only copy of the environment's own bash (the host's may need libraries it lacks),
    made once per owner and environment; SandboxUnavailableError where the environment cannot host
    codefleet's shell."""
    where = f"SandboxConfig.environment names {rootfs!r}"
    if not _is(rootfs, stat.S_ISDIR):
        raise SandboxUnavailableError(
            f"{where}, which is not a directory; import an image first "
            "(codefleet.sandbox.environments.import_image returns its rootfs)"
        )
    check_reachable(os.path.join(rootfs, "etc"), host_identity(), "the environment holds")
    # The sandbox's own passwd and group are bound over the image's (never through a symlink of the image).
    if not (
        _is(os.path.join(rootfs, "etc"), stat.S_ISDIR)
        and _is(os.path.join(rootfs, "etc/passwd"), stat.S_ISREG)
        and _is(os.path.join(rootfs, "etc/group"), stat.S_ISREG)
    ):
        raise SandboxUnavailableError(
            f"{where}, which lacks a directory /etc with regular files /etc/passwd and "
            "/etc/group; the image must have them"
        )
    with _made_lock:
        key = (files.shell, rootfs)
        if key not in _environment_shells:
            bash = resolve_inside(rootfs, "/bin/bash")  # never a symlink, never outside rootfs
            missing = SandboxUnavailableError(
                f"{where}, which has no /bin/bash; codefleet's shell runs the image's own bash: install it in the image"
            )
            if bash is None:
                raise missing
            with open(os.open(bash, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as src:
                if not stat.S_ISREG(os.fstat(src.fileno()).st_mode):
                    raise missing
                data = src.read()
            path = f"{files.shell}-{hashlib.sha256(rootfs.encode()).hexdigest()[:16]}"
            _environment_shells[key] = write_exec_only_copy(data, path)
        return _environment_shells[key]


def _is(path: str, kind) -> bool:
    """Whether `path` itself (not what a symlink there points to) is of `kind` (stat.S_ISDIR, ...)."""
    try:
        return kind(os.lstat(path).st_mode)
    except OSError:
        return False


def write_exec_only_copy(data: bytes, path: str) -> str:
    """Write `data` at `path`, mode 0111 (see identity.write_exec_only_shell); `path`."""
    with open(path + ".tmp", "wb") as dst:
        dst.write(data)
    os.chmod(path + ".tmp", 0o111)
    os.replace(path + ".tmp", path)
    return path


def check_reachable(path: str, ident: Identity, what: str) -> None:
    """Raise SandboxUnavailableError if `ident` may not walk down to `path` (bwrap opens it as that user)."""
    ancestor = closed_ancestor(path, ident)
    if ancestor is not None:
        raise SandboxUnavailableError(
            f"{what} {path!r}, inside {ancestor!r}, which the sandbox user {ident.name} may not enter "
            f"(mode {stat.S_IMODE(os.stat(ancestor).st_mode):04o}); choose a path under a directory that others "
            f"may enter, or `chmod o+x {ancestor}`"
        )


def closed_ancestor(path: str, ident: Identity) -> str | None:
    """The first directory above `path` that the sandbox user `ident` may not enter; None if it may walk to it
    (always, when the sandbox runs as the caller)."""
    if not ident.switches:
        return None
    parts = os.path.dirname(path).strip("/").split("/")
    for i in range(len(parts) + 1):
        ancestor = "/" + "/".join(parts[:i])
        st = os.stat(ancestor)
        can = (
            st.st_mode & 0o001
            or (st.st_gid == ident.gid and st.st_mode & 0o010)
            or (st.st_uid == ident.uid and st.st_mode & 0o100)
        )
        if not can:
            return ancestor
    return None


@functools.cache
def bwrap_binary() -> str:
    """Where bubblewrap is, found once on the host's PATH (bwrap itself runs with the sandbox's)."""
    return shutil.which("bwrap") or "bwrap"


def bwrap_env() -> dict[str, str]:
    """The environment bwrap itself runs with, which stays its PID 1's: the sandbox's own PATH, nothing of the
    host's (the host's PATH names its home directories)."""
    return {"PATH": PATH}


def options_fd(options: list[str]) -> int:
    """A descriptor for bwrap's `--args`: `options`, NUL-separated, in a memfd that bwrap reads and closes (its
    command line, /proc/1/cmdline inside, then shows none of them). The caller closes its own copy."""
    fd = os.memfd_create("bwrap-options", os.MFD_CLOEXEC)
    data = b"".join(os.fsencode(option) + b"\0" for option in options)
    while data:
        data = data[os.write(fd, data) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
