"""`codefleet bench engine`: generated tokens/s of the engine, next to HF `generate()`.

The tiny config (`ModelConfig.tiny()`) with random weights, greedy decoding,
no stop tokens (every request generates exactly `new_tokens`), prompts of a
fixed length, `threads` torch threads. Figures count generated tokens over
the whole call, prefill included:

- `engine_tokens_per_s_b1`: one request at a time.
- `engine_tokens_per_s_b32`: 32 requests submitted together (continuous
  batching, routed experts recorded as RL needs them).
- `hf_tokens_per_s_b1|b32`: HF transformers' `generate()` (static KV cache off,
  its default dynamic cache) on a `Qwen3MoeForCausalLM` with the same shapes:
  layers, hidden size, heads, kv heads, head dim, experts, top-k, expert
  hidden size, vocabulary. Random weights; the same prompts.

Both run in this process with the same threads; read the ratio
(`engine_over_hf_b32`) more than the absolute numbers on a shared machine.
"""

from __future__ import annotations

import sys
import time

import torch

from codefleet.bench.report import report
from codefleet.model.config import ModelConfig
from codefleet.model.engine import Engine
from codefleet.model.sampling import SamplingParams
from codefleet.model.transformer import Transformer


def hf_peer(config: ModelConfig):
    """A random-weight Qwen3MoeForCausalLM with the tiny config's shapes (None when transformers is missing)."""
    try:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    except ImportError:
        return None
    head_dim = getattr(config, "head_dim", None) or config.d_model // config.n_heads
    hf_config = Qwen3MoeConfig(
        vocab_size=config.vocab_size, hidden_size=config.d_model, num_hidden_layers=config.n_layers,
        num_attention_heads=config.n_heads, num_key_value_heads=config.n_kv_heads, head_dim=head_dim,
        num_experts=config.n_experts, num_experts_per_tok=config.top_k, moe_intermediate_size=config.d_expert,
        intermediate_size=config.d_expert, decoder_sparse_step=1, norm_topk_prob=True,
        max_position_embeddings=config.max_seq_len, tie_word_embeddings=False, pad_token_id=0)
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(hf_config).eval()


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (n, length), generator=g).tolist()  # ids 0..15 are special tokens


def _engine_rate(engine: Engine, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        results = engine.generate(prompts, params)
        elapsed = time.perf_counter() - started
        assert all(len(r.token_ids) == new_tokens for r in results)
        best = max(best, len(prompts) * new_tokens / elapsed)
    return best


def _hf_rate(model, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    input_ids = torch.tensor(prompts)
    best = 0.0
    for _ in range(repeats):
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        elapsed = time.perf_counter() - started
        assert out.shape[1] == input_ids.shape[1] + new_tokens
        best = max(best, len(prompts) * new_tokens / elapsed)
    return best


def run(quick: bool = False, threads: int = 2, log=print) -> dict:
    torch.set_num_threads(threads)
    config = ModelConfig.tiny()
    prompt_len, new_tokens, batch = (32, 32, 32) if quick else (64, 128, 32)
    repeats = 1 if quick else 3
    torch.manual_seed(0)
    model = Transformer(config).eval()
    engine = Engine(model, None, max_batch=batch, max_seq_len=prompt_len + new_tokens + 1)
    prompts = _prompts(batch, prompt_len, config.vocab_size)
    results: dict = {"quick": quick, "threads": threads, "prompt_tokens": prompt_len, "new_tokens": new_tokens,
                     "batch": batch, "n_layers": config.n_layers, "d_model": config.d_model,
                     "n_experts": config.n_experts, "top_k": config.top_k, "vocab_size": config.vocab_size}
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    log("engine, batch 1 ...")
    results["engine_tokens_per_s_b1"] = round(_engine_rate(engine, prompts[:1], new_tokens, repeats), 1)
    log("engine, batch 32 ...")
    results["engine_tokens_per_s_b32"] = round(_engine_rate(engine, prompts, new_tokens, repeats), 1)
    hf = hf_peer(config)
    if hf is None:
        log("transformers is not installed (pip install 'codefleet[bench]'): no HF peer")
        results["hf_tokens_per_s_b1"] = results["hf_tokens_per_s_b32"] = None
        results["engine_over_hf_b32"] = None
        return results
    results["hf_model"] = type(hf).__name__
    _hf_rate(hf, prompts[:2], 4, 1)  # warm-up
    log("HF generate(), batch 1 ...")
    results["hf_tokens_per_s_b1"] = round(_hf_rate(hf, prompts[:1], new_tokens, repeats), 1)
    log("HF generate(), batch 32 ...")
    results["hf_tokens_per_s_b32"] = round(_hf_rate(hf, prompts, new_tokens, repeats), 1)
    results["engine_over_hf_b1"] = round(results["engine_tokens_per_s_b1"] / results["hf_tokens_per_s_b1"], 2)
    results["engine_over_hf_b32"] = round(results["engine_tokens_per_s_b32"] / results["hf_tokens_per_s_b32"], 2)
    return results


def table(r: dict) -> str:
    rows = [("", "batch 1", "batch 32"),
            ("engine tok/s", r["engine_tokens_per_s_b1"], r["engine_tokens_per_s_b32"]),
            ("HF generate() tok/s", r.get("hf_tokens_per_s_b1"), r.get("hf_tokens_per_s_b32")),
            ("engine / HF", r.get("engine_over_hf_b1"), r.get("engine_over_hf_b32"))]
    return "\n".join(f"{a:<22}{'-' if b is None else b:>12}{'-' if c is None else c:>12}" for a, b, c in rows)


def run_cli(quick: bool = False, as_json: bool = False) -> int:
    return report(lambda log: run(quick=quick, log=log),
                  lambda r: (f"codefleet bench engine (tiny config, {r['threads']} threads, prompt "
                             f"{r['prompt_tokens']} + {r['new_tokens']} new tokens, greedy"
                             f"{', quick' if quick else ''})"),
                  table, as_json)


if __name__ == "__main__":
    sys.exit(run_cli(quick="--quick" in sys.argv, as_json="--json" in sys.argv))
