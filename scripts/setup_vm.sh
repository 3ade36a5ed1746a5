#!/usr/bin/env bash
# What the `vm` sandbox backend needs (src/codefleet/sandbox/vm.py), on top of scripts/setup.sh:
# QEMU, a static busybox and erofs-utils from Debian, then `codefleet sandbox vm-setup`, which downloads
# Debian's kernel package with apt (extracted into /var/cache/codefleet/vm, not installed on the host)
# and builds the host userland's read-only disk (about a minute for 5 GB). Run as root (or with sudo)
# on a fresh Debian/Ubuntu machine; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
need_apt=()
command -v qemu-system-x86_64 >/dev/null 2>&1 || need_apt+=(qemu-system-x86)
[ -x /bin/busybox ] && ! ldd /bin/busybox >/dev/null 2>&1 || need_apt+=(busybox-static)
command -v mkfs.erofs >/dev/null 2>&1 || need_apt+=(erofs-utils)
command -v mkfs.ext4 >/dev/null 2>&1 || need_apt+=(e2fsprogs)
if [ ${#need_apt[@]} -gt 0 ]; then
    echo "setup_vm: installing system packages: ${need_apt[*]}"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi
.venv/bin/codefleet sandbox vm-setup
