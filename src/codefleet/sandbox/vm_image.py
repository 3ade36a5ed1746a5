"""What a `vm` sandbox boots: a guest kernel, an initramfs and the environment as a read-only disk.

Set-up (`codefleet sandbox vm-setup`, run by scripts/setup.sh where /dev/kvm exists) downloads Debian's
kernel package with apt (install time: the only network this needs) and extracts, without installing
anything on the host, its kernel and the dozen modules a guest needs (virtio over MMIO, block, console,
ext4, erofs, overlay). At run time nothing is downloaded: every other piece is built from what the
host has and cached, content-addressed, under `vm_dir()`:

- the initramfs (`initramfs()`, here): busybox, those modules, `/init` (below) and the guest agent's code
  (`vm_agent`, with the stdlib-only sandbox modules it runs: shell, files, shellbox). Uncompressed cpio;
- the environment's disk and, per sandbox, its workspace disk (vm_disks.py).

The guest's `/init` loads the modules, mounts the environment read-only under a tmpfs overlay (what
a command writes outside the workspace lives in guest memory, 12% of the VM's at most), brings up
loopback (the only network device) and hands PID 1 to the agent. The workspace disk is mounted later,
by the agent, when the host asks: a VM snapshotted before that point serves every repository.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import io
import os
import re
import shutil
import subprocess
import tempfile
import zipfile

from codefleet.sandbox.base import SandboxUnavailableError

# Modules, in load order (each after what it depends on). crc32c: ext4's metadata checksums, which the
# kernel would otherwise ask modprobe for, which the initramfs does not have.
MODULES = (
    "virtio_ring",
    "virtio",
    "virtio_mmio",
    "virtio_blk",
    "virtio_console",
    "crc16",
    "crc32c_generic",
    "libcrc32c",
    "mbcache",
    "jbd2",
    "ext4",
    "erofs",
    "overlay",
)
# The agent's code: these modules import only the standard library and each other.
AGENT_MODULES = (
    "types.py",
    "sandbox/base.py",
    "sandbox/files.py",
    "sandbox/shell.py",
    "sandbox/shellbox.py",
    "sandbox/vm_agent.py",
)
SETUP_HINT = "run `codefleet sandbox vm-setup` (scripts/setup.sh does on a host with /dev/kvm)"

INIT = r"""#!/bin/busybox sh
# codefleet guest init: modules, the environment read-only under a tmpfs overlay (nosuid: no setuid program
# makes a command root), then the agent as PID 1.
B=/bin/busybox
$B mount -t proc proc /proc
$B mount -t devtmpfs dev /dev
for m in $(cat /modules.order); do
    $B insmod /modules/$m.ko || { echo "codefleet-init: insmod $m failed"; $B poweroff -f; }
done
i=0; while [ ! -b /dev/vda ] && [ $i -lt 2000 ]; do $B usleep 1000; i=$((i+1)); done
$B mkdir -p /lower /rw /newroot
$B mount -t erofs -o ro /dev/vda /lower || { echo "codefleet-init: cannot mount the environment"; $B poweroff -f; }
$B mount -t tmpfs -o mode=0755,size=12% rw /rw
$B mkdir -p /rw/upper /rw/work
$B mount -t overlay root -o nosuid,nodev,lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work /newroot
for d in proc sys dev tmp run workspace var var/tmp root; do $B mkdir -p /newroot/$d; done
$B chmod 1777 /newroot/tmp /newroot/var/tmp
$B mkdir -p /newroot/run/codefleet
$B cp /agent.zip /newroot/run/codefleet/agent.zip
$B ip link set lo up
$B umount /proc
$B mount --move /dev /newroot/dev
for py in /usr/bin/python3 /usr/local/bin/python3; do
    if [ -e /newroot$py ] || [ -L /newroot$py ]; then
        exec $B switch_root /newroot $py -I -S /run/codefleet/agent.zip
    fi
done
echo "codefleet-init: the environment has no python3 (/usr/bin or /usr/local/bin) to run the agent"; $B poweroff -f
"""


def vm_dir() -> str:
    """Where kernels, initramfs and environment disks are cached: `CODEFLEET_VM_DIR`, else
    /var/cache/codefleet/vm for root and ~/.cache/codefleet/vm otherwise."""
    if os.environ.get("CODEFLEET_VM_DIR"):
        return os.environ["CODEFLEET_VM_DIR"]
    if os.geteuid() == 0:
        return "/var/cache/codefleet/vm"
    return os.path.join(os.path.expanduser("~"), ".cache", "codefleet", "vm")


def kernel_dir() -> str:
    return os.path.join(vm_dir(), "kernel")


def guest_kernel() -> str:
    """The guest kernel's path; SandboxUnavailableError (with what to run) if set-up has not run."""
    path = os.path.join(kernel_dir(), "vmlinux")
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(kernel_dir(), "modules.order")):
        raise SandboxUnavailableError(f"no guest kernel in {kernel_dir()}; {SETUP_HINT}")
    return path


def setup_kernel(deb: str | None = None) -> str:
    """Extract the guest kernel and its modules from Debian's kernel package `deb` (downloaded with
    `apt-get download` when None). Returns the kernel directory. Idempotent."""
    out = kernel_dir()
    if os.path.isfile(os.path.join(out, "modules.order")):
        return out
    with tempfile.TemporaryDirectory(prefix="codefleet-kernel-") as tmp:
        if deb is None:
            deb = _download_kernel_package(tmp)
        subprocess.run(["dpkg-deb", "-x", deb, os.path.join(tmp, "x")], check=True)
        [vmlinuz] = glob.glob(os.path.join(tmp, "x", "boot", "vmlinuz-*"))
        index = {
            re.sub(r"\.ko(\.\w+)?$", "", os.path.basename(p)).replace("-", "_"): p
            for p in glob.glob(os.path.join(tmp, "x", "lib", "modules", "*", "**", "*.ko*"), recursive=True)
        }
        missing = [m for m in MODULES if m not in index]
        if missing:
            raise SandboxUnavailableError(
                f"the kernel package {os.path.basename(deb)} lacks the modules "
                f"{', '.join(missing)}; use Debian's linux-image-amd64"
            )
        staging = out + ".part"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(os.path.join(staging, "modules"))
        with open(vmlinuz, "rb") as f, open(os.path.join(staging, "vmlinux"), "wb") as out_f:
            out_f.write(_vmlinux_of(f.read()))
        for name in MODULES:
            if not index[name].endswith(".ko"):
                raise SandboxUnavailableError(
                    f"module {index[name]} is compressed; this kernel package is not "
                    "one codefleet can use (Debian 12's linux-image-amd64 is)"
                )
            shutil.copy(index[name], os.path.join(staging, "modules", name + ".ko"))
        with open(os.path.join(staging, "modules.order"), "w") as f:
            f.write("\n".join(MODULES) + "\n")
        with open(os.path.join(staging, "version"), "w") as f:
            f.write(os.path.basename(deb) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    return out


def _vmlinux_of(bzimage: bytes) -> bytes:
    """The uncompressed kernel (an ELF with a PVH entry point, which QEMU's microvm boots directly) inside a
    bzImage: its payload is the one compressed stream in it."""
    import gzip
    import lzma

    for magic, decompress in (
        (b"\xfd7zXZ\x00", lambda d: lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(d)),
        (b"\x1f\x8b\x08\x00", lambda d: gzip.GzipFile(fileobj=io.BytesIO(d)).read1(1 << 30)),
        (b"\x28\xb5\x2f\xfd", _unzstd),
    ):
        at = bzimage.find(magic)
        if at >= 0:
            elf = decompress(bzimage[at:])
            if elf[:4] == b"\x7fELF":
                return elf
    raise SandboxUnavailableError("cannot find the kernel inside this vmlinuz (xz, gzip and zstd tried)")


def _unzstd(data: bytes) -> bytes:
    if shutil.which("zstd") is None:
        raise SandboxUnavailableError("this kernel is zstd-compressed; install Debian's zstd")
    return subprocess.run(["zstd", "-dc"], input=data, capture_output=True).stdout


def _download_kernel_package(into: str) -> str:
    depends = subprocess.run(
        ["apt-cache", "depends", "linux-image-amd64"], capture_output=True, text=True, check=True
    ).stdout
    names = re.findall(r"Depends: (linux-image-\S+)", depends)
    if not names:
        raise SandboxUnavailableError("apt knows no linux-image-amd64 package; run `apt-get update` first")
    subprocess.run(["apt-get", "download", "-q", names[0]], cwd=into, check=True, capture_output=True)
    [deb] = glob.glob(os.path.join(into, "*.deb"))
    return deb


# -- initramfs --------------------------------------------------------------------------------------


def agent_zip() -> bytes:
    """The guest agent's code as a zip that `python3 agent.zip` runs (its __main__ starts vm_agent)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # src/codefleet
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for name in ("codefleet/__init__.py", "codefleet/sandbox/__init__.py"):
            z.writestr(zipfile.ZipInfo(name, (2020, 1, 1, 0, 0, 0)), "")  # not the real ones: no imports
        for rel in AGENT_MODULES:
            with open(os.path.join(root, rel), "rb") as f:
                z.writestr(zipfile.ZipInfo("codefleet/" + rel, (2020, 1, 1, 0, 0, 0)), f.read())
        z.writestr(
            zipfile.ZipInfo("__main__.py", (2020, 1, 1, 0, 0, 0)),
            "from codefleet.sandbox.vm_agent import main\nmain()\n",
        )
    return buf.getvalue()


@functools.lru_cache(maxsize=1)
def initramfs() -> str:
    """The initramfs for this kernel and this codefleet (built once, cached by content; once per process)."""
    kdir = os.path.dirname(guest_kernel())
    busybox = shutil.which("busybox") or "/bin/busybox"
    if not os.path.isfile(busybox) or _dynamic(busybox):
        raise SandboxUnavailableError("the vm backend needs a static busybox; install Debian's busybox-static")
    with open(busybox, "rb") as f:
        busybox_bytes = f.read()
    entries: list[tuple[str, int, bytes]] = [
        ("bin", 0o40755, b""),
        ("proc", 0o40755, b""),
        ("dev", 0o40755, b""),
        ("modules", 0o40755, b""),
    ]
    entries.append(("bin/busybox", 0o100755, busybox_bytes))
    entries.append(("init", 0o100755, INIT.encode()))
    with open(os.path.join(kdir, "modules.order"), "rb") as f:
        order = f.read()
    entries.append(("modules.order", 0o100644, order))
    for name in order.decode().split():
        with open(os.path.join(kdir, "modules", name + ".ko"), "rb") as f:
            entries.append((f"modules/{name}.ko", 0o100644, f.read()))
    entries.append(("agent.zip", 0o100644, agent_zip()))
    digest = hashlib.sha256()
    for name, mode, data in entries:
        digest.update(f"{name}\0{mode}\0{len(data)}\0".encode())
        digest.update(data)
    path = os.path.join(vm_dir(), "initramfs", digest.hexdigest()[:20] + ".cpio")
    if not os.path.isfile(path):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{os.urandom(4).hex()}.part"
        with open(tmp, "wb") as f:
            f.write(_cpio(entries))
        os.replace(tmp, path)
    return path


def _dynamic(path: str) -> bool:
    with open(path, "rb") as f:
        return b"/lib64/ld-linux" in f.read(1 << 16)


def _cpio(entries: list[tuple[str, int, bytes]]) -> bytes:
    """A cpio archive in the "newc" format the kernel unpacks."""
    out = bytearray()

    def put(name: str, mode: int, data: bytes, ino: int) -> None:
        name_b = name.encode() + b"\0"
        fields = (ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name_b), 0)
        out.extend(b"070701" + b"".join(b"%08X" % v for v in fields) + name_b)
        out.extend(b"\0" * (-len(out) % 4))
        out.extend(data)
        out.extend(b"\0" * (-len(out) % 4))

    for ino, (name, mode, data) in enumerate(entries, start=1):
        put(name, mode, data, ino)
    put("TRAILER!!!", 0, b"", 0)
    return bytes(out)
