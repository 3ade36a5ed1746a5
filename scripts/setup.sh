#!/usr/bin/env bash
# One-time set-up on a fresh Debian/Ubuntu machine (run as root, or with sudo available):
# system packages, a virtual environment in .venv, PyTorch (CPU build unless an NVIDIA
# GPU is present) and codefleet itself. Safe to re-run: it skips what is already done.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
SUDO=""
if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi

need_apt=()
command -v bwrap >/dev/null 2>&1 || need_apt+=(bubblewrap)
command -v fuse-overlayfs >/dev/null 2>&1 || need_apt+=(fuse-overlayfs)
ldconfig -p 2>/dev/null | grep -q libseccomp.so.2 || need_apt+=(libseccomp2)
command -v git >/dev/null 2>&1 || need_apt+=(git)
# Task repositories are tested inside sandboxes with the system Python's pytest.
/usr/bin/python3 -c 'import pytest' >/dev/null 2>&1 || need_apt+=(python3 python3-pytest)
command -v make >/dev/null 2>&1 || need_apt+=(make)
# The native CPU kernels (model/csrc: the engine's decode, the MoE training step) are compiled here,
# against the installed torch.
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
"$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 || need_apt+=(python3-venv)
if [ ${#need_apt[@]} -gt 0 ]; then
    if command -v apt-get >/dev/null 2>&1; then
        echo "setup: installing system packages: ${need_apt[*]}"
        $SUDO apt-get update -qq
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
    else
        echo "setup: please install ${need_apt[*]} with your package manager" >&2
    fi
fi

# Started as root, codefleet runs sandboxed commands as this system user, who owns nothing on the host
# (src/codefleet/sandbox/identity.py); as any other user, sandboxes run as that user.
if ! id -u codefleet-sandbox >/dev/null 2>&1; then
    echo "setup: creating the system user codefleet-sandbox (sandboxed commands run as it)"
    $SUDO useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin \
        codefleet-sandbox
fi

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.codefleet-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
    "$VENV/bin/pip" install -q --upgrade pip
    # PyTorch first, pinned, so nothing later pulls a multi-GB CUDA build by accident.
    # On this project's machines `torch==2.13.0` resolves to a CPU build kept on local disk;
    # TORCH_SPEC overrides it (e.g. a CUDA build on a GPU host).
    "$VENV/bin/pip" install -q "${TORCH_SPEC:-torch==2.13.0}"
    "$VENV/bin/pip" install -q -e ".[test,bench]"
    touch "$stamp"
fi
# Cached per source, torch version and CPU: a no-op when already built. Without them the engine and
# the trainer run their PyTorch paths (same results, slower).
"$VENV/bin/python" -m codefleet.model.kernels >/dev/null \
    || echo "setup: native kernels not built; the engine and the trainer will use their PyTorch paths" >&2
