"""A seccomp filter for namespace sandboxes: deny the system calls that reach
past the namespaces.

Inside a sandbox uid 1000 maps to the host user that started it (root on a
training node), with every capability dropped. Capabilities already stop
mount, module loading and the like; what they do not stop are kernel
interfaces keyed to the *uid*: the kernel keyrings (keyctl, add_key,
request_key) are shared with the host user. Those, and a few interfaces
that are large attack surface and never needed to build and test code
(bpf, perf_event_open, userfaultfd, io_uring, kexec, the new mount API),
fail with EPERM. ptrace stays allowed: the PID namespace confines it, and
debuggers are part of fixing code.

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
    "keyctl", "add_key", "request_key",
    "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "mount", "umount2", "pivot_root", "move_mount", "open_tree", "fsopen", "fsmount", "fsconfig", "fspick",
    "mount_setattr", "setns", "unshare",
    "open_by_handle_at", "name_to_handle_at",
    "swapon", "swapoff", "reboot", "acct", "quotactl", "syslog", "lookup_dcookie", "fanotify_init",
)


@functools.cache
def filter_bytes() -> bytes | None:
    """The compiled BPF program, or None where libseccomp is not available."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as e:
        log.warning("codefleet: seccomp filter off (%s); install libseccomp2 and pyseccomp", e)
        return None
    flt = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_SYSCALLS:
        try:
            flt.add_rule(sc.ERRNO(errno.EPERM), name)
        except (RuntimeError, ValueError, OSError):
            pass  # a syscall this architecture or kernel does not have
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
