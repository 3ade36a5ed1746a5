"""Native CPU kernels, compiled on the machine that runs them (`csrc/*.cpp`, registered as `torch.ops.codefleet`).

    python -m codefleet.model.kernels          # build now (scripts/setup.sh does); prints where

`moe_experts()` returns `torch.ops.codefleet.moe_experts` (fused SwiGLU experts
for decode-sized slot counts, see csrc/moe_experts.cpp), `decode_layer()` the
decode step's attention half and router (csrc/decode_layer.cpp) and `moe_train()`
the training path's forward and backward (one expert per core, csrc/moe_train.cpp),
or None when they cannot be had: no C++ compiler, a failed build, not
x86-64/Linux, a torch without an exported BLAS GEMM (moe_train), or
`CODEFLEET_KERNELS=0`. Callers then take their PyTorch path, which computes
the same thing (tests/test_model_kernels.py and tests/test_model_moe.py hold
them equal), so the kernels change speed, never results beyond float rounding.

The library is built once per source, torch version and CPU (it is compiled
with `-march=native`) into `$CODEFLEET_KERNEL_DIR` (default
`~/.cache/codefleet/kernels`), under a file lock so that concurrent processes
(engine actors starting together) build it once; a build takes ~10 s. It links
against torch's own libraries, so `at::parallel_for` runs on torch's thread pool.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_SOURCES = Path(__file__).parent / "csrc"
_FLAGS = [
    "-O3",
    "-march=native",
    "-mprefer-vector-width=512",
    "-fno-math-errno",
    "-std=c++20",
    "-shared",
    "-fPIC",
    "-fopenmp",
]


class KernelBuildError(RuntimeError):
    """A native kernel could not be compiled or loaded."""


def _cpu_key() -> str:
    """What `-march=native` compiles for: the CPU's model name and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    keep = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _library_path(name: str) -> Path:
    source = (_SOURCES / f"{name}.cpp").read_bytes()
    digest = hashlib.sha256(
        b"\0".join([source, torch.__version__.encode(), " ".join(_FLAGS).encode(), _cpu_key().encode()])
    ).hexdigest()[:16]
    root = Path(os.environ.get("CODEFLEET_KERNEL_DIR") or Path.home() / ".cache" / "codefleet" / "kernels")
    return root / f"{name}-{digest}.so"


def build(name: str) -> Path:
    """Compile `csrc/<name>.cpp` if its library is not built yet; the library's path. Raises KernelBuildError."""
    path = _library_path(name)
    if path.exists():
        return path
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise KernelBuildError("no C++ compiler found (install g++, e.g. `apt-get install g++`, or set CXX)")
    path.parent.mkdir(parents=True, exist_ok=True)
    torch_dir = Path(torch.__file__).parent
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building it: wait, then find it built
        if path.exists():
            return path
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        cmd = [
            compiler,
            *_FLAGS,
            f"-I{torch_dir / 'include'}",
            f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            str(_SOURCES / f"{name}.cpp"),
            f"-L{torch_dir / 'lib'}",
            "-lc10",
            "-ltorch_cpu",
            f"-Wl,-rpath,{torch_dir / 'lib'}",
            "-o",
            str(tmp),
        ]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:  # CXX names something that cannot be run
            raise KernelBuildError(f"cannot run the C++ compiler {compiler!r}: {e}") from e
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            errors = [ln for ln in done.stderr.splitlines() if "error" in ln][:3]
            raise KernelBuildError(
                f"compiling {name}.cpp failed ({compiler} exit {done.returncode}): "
                + ("; ".join(errors) or done.stderr[-500:])
            )
        os.replace(tmp, path)  # atomic: a reader never loads half a library
    return path


@functools.cache
def _load(name: str) -> bool:
    if os.environ.get("CODEFLEET_KERNELS", "1") == "0":
        return False
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        torch.ops.load_library(str(build(name)))
    except (KernelBuildError, OSError, RuntimeError) as e:
        log.warning("native kernel %s unavailable, using the PyTorch path (slower): %s", name, e)
        return False
    return True


def pack_experts(w_gate_up_EDG: torch.Tensor, w_down_EFD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert weights in `moe_experts`' tiles, so that each of its tasks streams one contiguous block:
    gate_up [E, ceil(F/32), D, 64] (per 32 hidden units, row d: their 32 gate then 32 up columns) and down
    [E, ceil(D/64), F, 64] (per 64 output columns), zero-padded."""
    E, D, G = w_gate_up_EDG.shape
    F_ = G // 2
    tiles_f, tiles_d = -(-F_ // 32), -(-D // 64)
    gate = torch.nn.functional.pad(w_gate_up_EDG[:, :, :F_], (0, tiles_f * 32 - F_)).view(E, D, tiles_f, 32)
    up = torch.nn.functional.pad(w_gate_up_EDG[:, :, F_:], (0, tiles_f * 32 - F_)).view(E, D, tiles_f, 32)
    gate_up = torch.cat([gate, up], dim=-1).permute(0, 2, 1, 3).contiguous()
    down = torch.nn.functional.pad(w_down_EFD, (0, tiles_d * 64 - D)).view(E, F_, tiles_d, 64)
    return gate_up, down.permute(0, 2, 1, 3).contiguous()


def moe_experts():
    """`torch.ops.codefleet.moe_experts(x_ND, experts_NK, weights_NK, *pack_experts(w_gate_up, w_down), e0) -> y_ND`,
    or None."""
    return torch.ops.codefleet.moe_experts if _load("moe_experts") else None


def decode_layer():
    """`(decode_attention, moe_route)` (csrc/decode_layer.cpp), or None:
    `decode_attention(x_BD, attn_norm, w_qkv, wo, ffn_norm, rope_table, k_cache, v_cache, layer, slots_B,
    positions_B, n_heads, eps, q_norm=None, k_norm=None) -> (x_BD, h_BD)`, a block's attention half for one new
    token per row (with Qwen3's q/k norm when given), and
    `moe_route(h_ND, w_ED, bias_E, sigmoid, renorm, top_k) -> (experts_NK, weights_NK)`, the router without
    losses."""
    if not _load("decode_layer"):
        return None
    return torch.ops.codefleet.decode_attention, torch.ops.codefleet.moe_route


def moe_train():
    """The training path's experts, forward and backward (csrc/moe_train.cpp), or None:
    `forward(x_ND, experts_NK, weights_NK, w_gate_up_EDG, w_down_EFD, e0, chunk_slots) -> (y_ND, saved)` and
    `backward(dy_ND, x_ND, experts_NK, weights_NK, w_gate_up_EDG, w_down_EFD, e0, saved, chunk_slots)
    -> (dx_ND, dweights_NK, dw_gate_up, dw_down)`."""
    if not _load("moe_train"):
        return None
    return torch.ops.codefleet.moe_train_forward, torch.ops.codefleet.moe_train_backward


if __name__ == "__main__":
    try:
        for source in sorted(_SOURCES.glob("*.cpp")):
            print(build(source.stem))
    except KernelBuildError as e:
        print(f"codefleet kernels not built: {e}", file=sys.stderr)
        sys.exit(1)
