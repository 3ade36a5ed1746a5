"""`codefleet bench moe`: forward+backward tokens/s of one MoE layer against its peers.

Shapes (the issue's): hidden 256, 4096 tokens, 2 threads, fp32, two cases:

- `64x8`: 64 experts top-8, expert hidden 128 (JSON keys without suffix:
  `moe_tokens_per_s`, `dense_tokens_per_s`, `hf_tokens_per_s`),
- `16x4`: 16 experts top-4, expert hidden 256 (keys with `_16x4`).

Peers, measured in the same run on the same input:

- dense: a SwiGLU with the same *active* parameters (hidden top_k * d_expert),
  the `nn.Linear` way every codebase writes it;
- hf: transformers' `Qwen3MoeSparseMoeBlock` with the *same weights* (copied
  from ours, outputs checked equal) under each of its expert implementations
  ("eager": a Python loop over hit experts; "grouped_mm": sorted tokens and
  `torch._grouped_mm`); the best counts. Its "batched_mm" gathers a [S, D, 2F]
  weight per token-slot (8.6 GB here) and is left out. transformers is an
  optional extra (`pip install codefleet[bench]`); without it hf is null.

`native_kernel` says whether our layer ran the native training kernel
(`kernels.moe_train`, built by set-up); without it the figures are the
PyTorch grouped path's.

Our layer runs with `balance="none"` and no z-loss so it does exactly the
block's work (router, top-k, renormalised weights, experts). One step is
forward, then backward of a fixed random gradient into the input and every
weight, starting (as every training step does after `zero_grad()`) with no
gradients held, so a step stores its gradients rather than adding them to
the previous step's. Implementations are interleaved over rounds; each
round keeps its best step; the figure is the median over rounds (shared
machines are noisy).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from codefleet.bench.report import report
from codefleet.model import kernels
from codefleet.model.config import ModelConfig
from codefleet.model.moe import MoE, SwiGLU

D_MODEL, N_TOKENS, THREADS = 256, 4096, 2
CASES = {"64x8": (64, 8, 128), "16x4": (16, 4, 256)}


def _ours(E: int, k: int, F: int) -> MoE:
    cfg = ModelConfig(
        d_model=D_MODEL,
        n_experts=E,
        top_k=k,
        d_expert=F,
        router_score="softmax",
        router_renorm=True,
        balance="none",
        z_loss_coef=0.0,
    )
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.02)
    return moe


def _hf_blocks(ours: MoE, x_ND: torch.Tensor) -> tuple[dict, str | None]:
    try:
        from transformers import Qwen3MoeConfig  # optional: the `bench` extra (pyproject.toml)
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ImportError as e:
        return {}, f"transformers not importable ({e}); install the bench extra: pip install 'codefleet[bench]'"
    cfg = ours.config
    blocks = {}
    for impl in ("eager", "grouped_mm"):
        hf_cfg = Qwen3MoeConfig(
            hidden_size=cfg.d_model,
            num_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            moe_intermediate_size=cfg.d_expert,
            norm_topk_prob=True,
            experts_implementation=impl,
        )
        block = Qwen3MoeSparseMoeBlock(hf_cfg)
        with torch.no_grad():
            block.gate.weight.copy_(ours.router.weight_ED)
            block.experts.gate_up_proj.copy_(ours.w_gate_up_EDG.transpose(1, 2))
            block.experts.down_proj.copy_(ours.w_down_EFD.transpose(1, 2))
            same = torch.allclose(block(x_ND[None])[0], ours(x_ND).y_ND, atol=1e-5)
        if not same:
            return {}, f"HF block ({impl}) disagrees with ours on the same weights; not measured"
        blocks[f"hf_{impl}"] = (_batched(block), block)
    return blocks, None


def _batched(block):
    return lambda x_ND: block(x_ND[None])[0]


def _stepper(fn, module: torch.nn.Module, x_ND: torch.Tensor, dy_ND: torch.Tensor):
    """One timed training step of `fn` (forward and backward), from no gradients held (`zero_grad()`)."""

    def step() -> float:
        x_ND.grad = None
        module.zero_grad(set_to_none=True)
        t = time.perf_counter()
        fn(x_ND).backward(dy_ND)
        return time.perf_counter() - t

    return step


def run(quick: bool = False, log=print) -> dict:
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(THREADS)
    rounds, reps = (3, 2) if quick else (7, 3)
    results: dict = {
        "quick": quick,
        "threads": THREADS,
        "tokens": N_TOKENS,
        "d_model": D_MODEL,
        "torch": torch.__version__,
        "native_kernel": kernels.moe_train() is not None,
    }
    try:
        for name, (E, k, F) in CASES.items():
            torch.manual_seed(0)
            x_ND = torch.randn(N_TOKENS, D_MODEL, requires_grad=True)
            dy_ND = torch.randn(N_TOKENS, D_MODEL)
            ours = _ours(E, k, F)
            dense = SwiGLU(D_MODEL, k * F)
            impls = {"moe": (lambda x, m=ours: m(x).y_ND, ours), "dense": (dense, dense)}
            hf, note = _hf_blocks(ours, x_ND.detach())
            impls.update(hf)
            if note:
                results["hf_note"] = note
            log(f"{name}: {E} experts top-{k}, expert hidden {F}: {', '.join(impls)} x {rounds} rounds ...")
            steps = {n: _stepper(f, module, x_ND, dy_ND) for n, (f, module) in impls.items()}
            for s in steps.values():
                s()  # warm up
            times: dict[str, list[float]] = {n: [] for n in steps}
            for _ in range(rounds):
                for n, s in steps.items():
                    times[n].append(min(s() for _ in range(reps)))
            tps = {n: N_TOKENS / statistics.median(v) for n, v in times.items()}
            suffix = "" if name == "64x8" else f"_{name}"
            results[f"moe_tokens_per_s{suffix}"] = tps["moe"]
            results[f"dense_tokens_per_s{suffix}"] = tps["dense"]
            hf_best = max((v for n, v in tps.items() if n.startswith("hf_")), default=None)
            results[f"hf_tokens_per_s{suffix}"] = hf_best
            for n in hf:
                results[f"{n}_tokens_per_s{suffix}"] = tps[n]
            results[f"moe_vs_dense{suffix}"] = tps["moe"] / tps["dense"]
            results[f"moe_vs_hf{suffix}"] = tps["moe"] / hf_best if hf_best else None
    finally:
        torch.set_num_threads(prev_threads)
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in results.items()}


_TARGETS = {"moe_vs_dense": ">= 0.9", "moe_vs_hf": ">= 1.2"}


def table(r: dict) -> str:
    rows = [("case", "moe tok/s", "dense tok/s", "hf best tok/s", "moe/dense", "moe/hf")]
    for name in CASES:
        s = "" if name == "64x8" else f"_{name}"

        def fmt(key: str, spec: str, s: str = s) -> str:
            v = r.get(key + s)
            return "n/a" if v is None else format(v, spec)

        rows.append(
            (
                name,
                fmt("moe_tokens_per_s", ".0f"),
                fmt("dense_tokens_per_s", ".0f"),
                fmt("hf_tokens_per_s", ".0f"),
                fmt("moe_vs_dense", ".2f"),
                fmt("moe_vs_hf", ".2f"),
            )
        )
    rows.append(("target", "", "", "", _TARGETS["moe_vs_dense"], _TARGETS["moe_vs_hf"]))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    )


def run_cli(quick: bool = False, as_json: bool = False) -> int:
    return report(
        lambda log: run(quick=quick, log=log),
        lambda r: (
            f"codefleet bench moe (fwd+bwd, {N_TOKENS} tokens, hidden {D_MODEL}, {THREADS} threads, "
            f"fp32{', quick' if quick else ''}"
            f"{'' if r['native_kernel'] else ', without the native kernel'})"
        ),
        table,
        as_json,
        note_key="hf_note",
        name="moe",
    )


if __name__ == "__main__":  # the same as `codefleet bench moe` (its flags, --help and errors)
    from codefleet.cli import main

    sys.exit(main(["bench", "moe", *sys.argv[1:]]))
