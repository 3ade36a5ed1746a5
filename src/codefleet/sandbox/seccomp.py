"""A seccomp filter for namespace sandboxes: deny the system calls that reach
past the namespaces.

Inside a sandbox uid 1000 maps to an unprivileged host user (identity.py),
with every capability dropped. Capabilities already stop mount, module
loading and the like; what they do not stop are kernel interfaces keyed to
the *uid*: the kernel keyrings (keyctl, add_key, request_key) are shared
with the host user. Those, and a few interfaces that are large attack
surface and never needed to build and test code (bpf, perf_event_open,
userfaultfd, io_uring, kexec, the new mount API), fail with EPERM. ptrace
stays allowed: the PID namespace confines it, and debuggers are part of
fixing code.

Sockets: a sandbox may make Unix, IPv4, IPv6 and netlink sockets (its own
loopback, `ip`, `ss`); every other address family fails with
EAFNOSUPPORT, as on a kernel built without it. The network namespace does
not cover them all: AF_VSOCK reaches the hypervisor on a VM host, and
packet, Bluetooth, CAN, RDS, TIPC... are kernel code a test suite never
needs.

The filter is compiled once per process with libseccomp (through the
`pyseccomp` ctypes binding) and handed to bwrap with `--seccomp FD`, which
installs it just before running the shell. Where libseccomp is missing the
sandbox still starts and `SandboxInfo.limits["seccomp"]` says "off".
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import tempfile

log = logging.getLogger(__name__)

DENIED_SYSCALLS = (
    "keyctl",
    "add_key",
    "request_key",
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "kexec_load",
    "kexec_file_load",
    "init_module",
    "finit_module",
    "delete_module",
    "mount",
    "umount2",
    "pivot_root",
    "move_mount",
    "open_tree",
    "fsopen",
    "fsmount",
    "fsconfig",
    "fspick",
    "mount_setattr",
    "setns",
    "unshare",
    "open_by_handle_at",
    "name_to_handle_at",
    "swapon",
    "swapoff",
    "reboot",
    "acct",
    "quotactl",
    "syslog",
    "lookup_dcookie",
    "fanotify_init",
)


# socket(2) families a sandbox keeps: AF_UNIX, AF_INET, AF_INET6, AF_NETLINK
ALLOWED_SOCKET_FAMILIES = (1, 2, 10, 16)
_MAX_SOCKET_FAMILY = 64  # above every family Linux has (46 in 6.x); larger numbers are refused too


@functools.cache
def filter_bytes() -> bytes | None:
    """The compiled BPF program, or None where libseccomp is not available."""
    try:
        import pyseccomp as sc  # needs the system's libseccomp, which a host may lack (then: no filter, said)
    except (ImportError, OSError) as e:
        log.warning("codefleet: seccomp filter off (%s); install libseccomp2 and pyseccomp", e)
        return None
    flt = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            flt.add_rule(sc.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError, OSError):
            pass  # a syscall this architecture or kernel does not have
    for call in ("socket", "socketpair"):
        for family in range(_MAX_SOCKET_FAMILY):
            if family not in ALLOWED_SOCKET_FAMILIES:
                flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.EQ, family))
        flt.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), call, sc.Arg(0, sc.GE, _MAX_SOCKET_FAMILY))
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        return f.read()


def filter_fd() -> int | None:
    """A readable pipe holding the filter, for bwrap's --seccomp (caller passes and closes it)."""
    program = filter_bytes()
    if program is None:
        return None
    r, w = os.pipe2(os.O_CLOEXEC)
    try:
        os.write(w, program)  # a few hundred bytes: fits in the pipe buffer
    finally:
        os.close(w)
    return r
