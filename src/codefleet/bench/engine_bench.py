"""`codefleet bench engine [--checkpoint DIR | --shape tiny|qwen3-0.6b|moe-1b]`: generated tokens/s of
codefleet's engine, next to HF `generate()` and vLLM, on the same Hugging Face checkpoint in the same run, and
what loading it costs.

Both sides run one checkpoint: codefleet loads it with `checkpoint.load(DIR)` into its own transformer, HF
with `AutoModelForCausalLM.from_pretrained(DIR)` (in the checkpoint's dtype). Without `--checkpoint` the bench
first builds a tiny random Qwen3-MoE with transformers into a temporary directory (`build_tiny_qwen3_moe`: the
shapes of `ModelConfig.tiny()` (layers, hidden size, heads, kv heads, head dim, experts, top-k, expert hidden
size, vocabulary) with Qwen3-MoE's q/k norm, fp32, codefleet's tokenizer) and runs exactly the `--checkpoint`
path on it. `--shape` builds a model a user would run instead, random fp32 weights (`SHAPES`): `qwen3-0.6b`
(Qwen3-0.6B's dense shape, 0.6B parameters) or `moe-1b` (a Qwen3-MoE of 1.06B total, 0.36B active). On a
few CPU cores those run prompt 32 + 16 new tokens (`LARGE_TOKENS`; `prompt_tokens`/`new_tokens` say so), the
engine against vLLM only (no HF probes, no multi-turn episodes).

Greedy decoding, no stop tokens (every request generates exactly `new_tokens`), prompts of random token ids
below the vocabulary size, of a fixed length, `threads` torch threads. Figures count generated tokens over
the whole call, prefill included:

- `engine_tokens_per_s_b1`: one request at a time.
- `engine_tokens_per_s_b32`: 32 requests submitted together (continuous
  batching, routed experts recorded as RL needs them).
- `native_kernel`: whether the engine ran the native MoE decode kernel
  (model/kernels.py; false without a C++ compiler: the PyTorch path, slower).
- `hf_tokens_per_s_b1|b32`: HF transformers' `generate()` on the same checkpoint and prompts, at its best
  setting: every expert implementation (`grouped_mm`, `eager`, `batched_mm`) with its dynamic and its static
  KV cache is probed twice on a short batch-32 run, and the two fastest are timed in full
  (`hf_setting_b1|b32` names the one that won, `hf_probe_tokens_per_s` has the probes).
- `vllm_tokens_per_s_b1|b32`, `engine_over_vllm_b1|b32`, `vllm_version`: vLLM's engine
  (inference/vllm_engine.py, `record_routing=False`, EOS ignored: exactly `new_tokens` each) on the same
  checkpoint, prompts and threads, where vLLM is importable (.venv-vllm, scripts/setup_vllm.sh); null
  otherwise, and `note` says why.
- `load_s`, `load_peak_rss_mb`: wall time of `checkpoint.load(DIR)` and the peak RSS it adds above the
  process's own, both measured in a fresh Python process (its peak RSS reset after the imports, read after the
  load), so this process's history (transformers, the HF model) hides nothing. It is a process's first load, as
  a `codefleet` command pays it: one-time costs the load triggers (lazy imports) are in it. `checkpoint_mb` is
  the size of the safetensors files on disk, `load_rss_over_size` the ratio of the two (1.0: every byte read
  once, in place).

Agent episodes are multi-turn: each turn's prompt is the last prompt + the
sampled tokens + a tool output. `multiturn_*` runs 8 such episodes at once
(two groups of four attempts; each group shares a 384-token system + task
prompt, then each attempt has its own 64 tokens; per turn 48 new tokens and a
160-token tool output) with the prefix cache and with it turned off
(`prefix_slots=0`) on the same model and prompts: `prefix_cache_speedup` is
the ratio of the episodes' generated tokens/s, `prefix_reused_fraction` the
share of prompt tokens the cache supplied.

All run in this process with the same threads, interleaved (each repeat times
the engine, then HF, then vLLM on the same prompts, so a burst of load on a shared
machine hits both), and each figure is the median of `repeats`. Every repeat
(and the warm-up) gets prompts never seen before: the engine's prefix cache
parks every finished sequence, so a prompt timed twice would skip its prefill
on the engine's side only. `engine_prefix_tokens_reused` counts the prompt
tokens the cache supplied in the timed b1/b32 calls (0: every prompt was
prefilled, as HF prefills it). Read the ratio (`engine_over_hf_b32`) more than
the absolute numbers on a shared machine.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from codefleet.bench.engine_checkpoints import SHAPES, build_shape, build_tiny_qwen3_moe
from codefleet.bench.report import report
from codefleet.chat.tokenizer import is_hf_dir
from codefleet.inference import vllm_engine
from codefleet.inference.engine import Engine
from codefleet.inference.sampling import SamplingParams
from codefleet.model import checkpoint, hf, kernels
from codefleet.model.config import ModelConfig

BUILT = "tiny-qwen3-moe (built)"
LARGE_TOKENS = (32, 16)  # (prompt, new) per request at the SHAPES: a b32 call is ~1k prefill tokens on 2 cores


def hf_peer(path: str, dtype: torch.dtype):
    """The checkpoint in `path` as transformers loads it, in `dtype` (the one codefleet loaded it in), or None
    when transformers is missing."""
    try:
        import transformers  # optional: the `bench` extra (pyproject.toml)
    except ImportError:
        return None
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"  # renamed in 5
    return transformers.AutoModelForCausalLM.from_pretrained(path, **{key: dtype}).eval()


def vllm_peer(path: str, max_batch: int, max_seq_len: int):
    """vLLM's engine (inference/vllm_engine.py) on the checkpoint in `path` and vLLM's version, or (None, why) when
    vLLM is not importable in this Python."""
    if importlib.util.find_spec("vllm") is None:
        return None, f"no vLLM peer: {vllm_engine.INSTALL_HINT}"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm  # optional: scripts/setup_vllm.sh (.venv-vllm)

    engine = vllm_engine.VLLMEngine.load(path, max_batch=max_batch, max_seq_len=max_seq_len, record_routing=False)
    return engine, vllm.__version__


# Linux carries a parent's peak RSS across exec into the child's `ru_maxrss`, so a process started by this one
# would start from this one's peak: the probe reads its own memory's peak (VmHWM), reset to its RSS once its
# imports are done (clear_refs 5); `ru_maxrss` (KB on Linux) only where /proc is missing.
_LOAD_PROBE = """
import json, resource, sys, time
import torch
torch.set_num_threads(int(sys.argv[2]))
from codefleet.model import checkpoint

def peak_kb():
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

try:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
except OSError:
    pass
before_kb = peak_kb()
started = time.perf_counter()
model = checkpoint.load(sys.argv[1])
load_s = time.perf_counter() - started
after_kb = peak_kb()
print(json.dumps({"load_s": load_s, "load_peak_rss_mb": (after_kb - before_kb) / 1024}))
"""


def load_cost(path: str, threads: int) -> dict:
    """`load_s`, `load_peak_rss_mb` of `checkpoint.load(path)` in a fresh Python process, and the checkpoint's
    size on disk (`checkpoint_mb`, its safetensors files) with `load_rss_over_size`."""
    proc = subprocess.run([sys.executable, "-c", _LOAD_PROBE, path, str(threads)], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["no output"]
        raise RuntimeError(f"loading {path} in a fresh process failed: {lines[-1]}")
    probe = json.loads(proc.stdout.strip().splitlines()[-1])
    size_mb = sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "*.safetensors"))) / 2**20
    return {
        "load_s": round(probe["load_s"], 3),
        "load_peak_rss_mb": round(probe["load_peak_rss_mb"], 1),
        "checkpoint_mb": round(size_mb, 1),
        "load_rss_over_size": round(probe["load_peak_rss_mb"] / size_mb, 2) if size_mb else None,
    }


def _prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(16, vocab, (n, length), generator=g).tolist()  # below 16: codefleet tokenizers' specials


def _engine_rate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """Tokens/s of one `generate()` call, and the prompt tokens the prefix cache supplied in it."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    started = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - started
    assert all(len(r.token_ids) == new_tokens for r in results)
    return len(prompts) * new_tokens / elapsed, sum(r.cached_tokens for r in results)


def _episodes(vocab: int, turns: int, seed: int = 1) -> tuple[list[list[int]], list[list[list[int]]]]:
    """First prompts of 8 attempts (2 groups x 4 sharing a prefix) and each attempt's tool outputs per turn."""
    shared = _prompts(2, 384, vocab, seed)
    own = _prompts(8, 64, vocab, seed + 1)
    firsts = [shared[i // 4] + own[i] for i in range(8)]
    outputs = [_prompts(turns, 160, vocab, seed + 2 + i) for i in range(8)]
    return firsts, outputs


def _multiturn_rate(engine: Engine, firsts, outputs, turns: int, new_tokens: int = 48) -> tuple[float, float]:
    """Generated tokens/s over whole episodes (every attempt's turn t submitted together), and the share of
    prompt tokens the prefix cache supplied."""
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    prompts, generated, prompt_tokens, cached = list(firsts), 0, 0, 0
    started = time.perf_counter()
    for turn in range(turns):
        results = engine.generate(prompts, params)
        generated += sum(len(r.token_ids) for r in results)
        prompt_tokens += sum(len(p) for p in prompts)
        cached += sum(r.cached_tokens for r in results)
        if turn + 1 < turns:
            prompts = [p + r.token_ids + out[turn] for p, r, out in zip(prompts, results, outputs)]
    return generated / (time.perf_counter() - started), cached / prompt_tokens


def _multiturn(model, config: ModelConfig, quick: bool, repeats: int, log) -> dict:
    turns = 3 if quick else 6
    firsts, outputs = _episodes(config.vocab_size, turns)
    max_len = 448 + turns * (48 + 160) + 1
    rates: dict[str, list[float]] = {"on": [], "off": []}
    reused = 0.0
    for r in range(repeats):  # fresh engines each repeat: every episode starts cold
        for mode, slots in (("on", None), ("off", 0)):
            log(f"multi-turn episodes, repeat {r + 1}/{repeats}: prefix cache {mode} ...")
            engine = Engine(model, None, max_batch=8, max_seq_len=max_len, prefix_slots=slots)
            rate, fraction = _multiturn_rate(engine, firsts, outputs, turns)
            rates[mode].append(rate)
            if mode == "on":
                reused = fraction
    on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
    return {
        "multiturn_turns": turns,
        "multiturn_tokens_per_s": round(on, 1),
        "multiturn_tokens_per_s_no_prefix_cache": round(off, 1),
        "prefix_cache_speedup": round(on / off, 2),
        "prefix_reused_fraction": round(reused, 3),
    }


def _hf_settings(model) -> list[tuple[str, str]]:
    """(expert implementation, KV cache) pairs to probe; transformers < 5 has one expert implementation."""
    impls = ("grouped_mm", "eager", "batched_mm") if hasattr(model, "set_experts_implementation") else ("default",)
    return [(impl, cache) for impl in impls for cache in ("dynamic", "static")]


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, setting: tuple[str, str]) -> float:
    """Tokens/s of one `generate()` call with the given (expert implementation, KV cache)."""
    impl, cache = setting
    if impl != "default":
        model.set_experts_implementation(impl)
    input_ids = torch.tensor(prompts)
    extra = {"cache_implementation": "static"} if cache == "static" else {}
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            **extra,
        )
    elapsed = time.perf_counter() - started
    assert out.shape[1] == input_ids.shape[1] + new_tokens
    return len(prompts) * new_tokens / elapsed


def _hf_best_settings(model, prompts: list[list[int]], probe_tokens: int, log) -> dict[str, float]:
    """Probe every HF setting twice on a short run (after a warm-up each, the two rounds interleaved so a
    burst of load does not sink one setting); the best rate of each, fastest first."""
    settings = _hf_settings(model)
    for setting in settings:
        _hf_generate(model, prompts[:2], 2, setting)  # warm-up
    probes = {"/".join(s): 0.0 for s in settings}
    for _ in range(2):
        for setting in settings:
            name = "/".join(setting)
            probes[name] = max(probes[name], round(_hf_generate(model, prompts, probe_tokens, setting), 1))
    log("  HF probes (tok/s): " + ", ".join(f"{k} {v}" for k, v in probes.items()))
    return dict(sorted(probes.items(), key=lambda kv: -kv[1]))


def run(
    quick: bool = False,
    threads: int = 2,
    log=print,
    repeats: int | None = None,
    checkpoint_dir: str | None = None,
    shape: str = "tiny",
) -> dict:
    """The figures of the module docstring on the Hugging Face checkpoint in `checkpoint_dir` (default: a random
    model of `shape`, "tiny" or a key of SHAPES, built into a temporary directory)."""
    if shape != "tiny" and shape not in SHAPES:
        raise ValueError(f"shape must be tiny or one of {', '.join(SHAPES)}, got {shape!r}")
    if checkpoint_dir is not None:
        if shape != "tiny":
            raise ValueError("give --checkpoint DIR or --shape, not both: the shape is the one of DIR")
        return _run(checkpoint_dir, checkpoint_dir, quick, threads, log, repeats, large=False)
    try:
        import transformers  # noqa: F401  # optional: the `bench` extra (pyproject.toml)
    except ImportError:
        raise RuntimeError(
            "building the bench's model needs transformers: pip install 'codefleet[bench]', or pass --checkpoint DIR"
        ) from None
    with tempfile.TemporaryDirectory(prefix="codefleet-bench-") as path:
        if shape == "tiny":
            log("building a tiny random Qwen3-MoE with transformers ...")
            return _run(build_tiny_qwen3_moe(path), BUILT, quick, threads, log, repeats, large=False)
        log(f"building a random {shape} with transformers ...")
        return _run(build_shape(shape, path), f"{shape} (built, random)", quick, threads, log, repeats, large=True)


def _run(path: str, label: str, quick: bool, threads: int, log, repeats: int | None, large: bool) -> dict:
    if not is_hf_dir(path):
        raise ValueError(
            f"{path} is not a Hugging Face model directory (a config.json naming `architectures` "
            "or `model_type`): bench engine runs transformers on the same checkpoint"
        )
    hf.check(path)  # one clear sentence for a bad directory before anything is timed
    torch.set_num_threads(threads)
    prompt_len, new_tokens, batch = (32, 32, 32) if quick else (64, 128, 32)
    if large:
        prompt_len, new_tokens = LARGE_TOKENS
    repeats = repeats or (1 if quick else 3 if not large else 2)
    log(f"loading {label} in a fresh process ...")
    load = load_cost(path, threads)
    model = checkpoint.load(path).eval()
    config = model.config
    max_seq_len = prompt_len + new_tokens + 1
    engine = Engine(model, None, max_batch=batch, max_seq_len=max_seq_len)
    prompts = _prompts(batch, prompt_len, config.vocab_size)
    results: dict = {
        "checkpoint": label,
        "architecture": config.architecture,
        "quick": quick,
        "threads": threads,
        "prompt_tokens": prompt_len,
        "new_tokens": new_tokens,
        "batch": batch,
        "repeats": repeats,
        "n_layers": config.n_layers,
        "d_model": config.d_model,
        "n_experts": config.n_experts,
        "top_k": config.top_k,
        "vocab_size": config.vocab_size,
        "qk_norm": config.qk_norm,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "dtype": str(config.torch_dtype).removeprefix("torch."),
        "native_kernel": kernels.moe_experts() is not None,
        **load,
    }
    notes = []
    if large:
        notes.append(
            f"prompt {prompt_len} + {new_tokens} new tokens at this shape (2 CPU cores); HF generate() "
            "and the multi-turn episodes run at the tiny shape and on --checkpoint only"
        )
    # warm-up on prompts of its own (a timed prompt already parked in the prefix cache would skip its prefill)
    warm = _prompts(2, prompt_len, config.vocab_size, seed=999)
    engine.generate(warm, SamplingParams(max_tokens=4, temperature=0))
    peer = None if large else hf_peer(path, config.torch_dtype)
    settings: list[tuple[str, str]] = []
    if peer is None and not large:
        notes.append("transformers is not installed (pip install 'codefleet[bench]'): no HF peer")
    elif peer is not None:
        results["hf_model"] = type(peer).__name__
        log("HF generate(): probing expert implementations and KV caches ...")
        probes = _hf_best_settings(peer, prompts, 8 if quick else 16, log)
        results["hf_probe_tokens_per_s"] = probes
        # the two fastest are timed in full (probes of two settings within noise of each other both run)
        settings = [tuple(name.split("/")) for name in list(probes)[: 1 if quick else 2]]
    log("vLLM: building its engine on the same checkpoint ...")
    try:
        vllm, version = vllm_peer(path, batch, max_seq_len)
    except Exception as e:  # a checkpoint vLLM cannot serve (no tokenizer, head_dim < 32 on CPU) leaves a note
        vllm, version = None, f"no vLLM peer: vLLM could not load {label}: {str(e).strip().splitlines()[0]}"
    if torch.get_num_threads() != threads:  # vLLM's CPU worker binds its threads: both engines must run on `threads`
        raise RuntimeError(
            f"vLLM left torch with {torch.get_num_threads()} threads, not {threads}; set "
            f"VLLM_CPU_OMP_THREADS_BIND to {threads} cores so both engines run on the same threads"
        )
    results["vllm_version"] = version if vllm is not None else None
    if vllm is None:
        notes.append(version)
    else:
        vllm.generate(warm, SamplingParams(max_tokens=4, temperature=0))
    reused = vllm_reused = 0
    for i, (name, size) in enumerate((("b1", 1), ("b32", batch))):
        rates: dict[str, list[float]] = {"engine": [], "vllm": [], **{"/".join(s): [] for s in settings}}
        for r in range(repeats):  # interleaved: the engine, each HF setting, vLLM, per repeat, on the same prompts
            rows = _prompts(size, prompt_len, config.vocab_size, seed=100 * (i + 1) + r)  # new to every engine
            log(f"batch {size}, repeat {r + 1}/{repeats}: engine ...")
            rate, cached = _engine_rate(engine, rows, new_tokens)
            rates["engine"].append(rate)
            reused += cached
            for s in settings:
                log(f"batch {size}, repeat {r + 1}/{repeats}: HF generate() {'/'.join(s)} ...")
                rates["/".join(s)].append(_hf_generate(peer, rows, new_tokens, s))
            if vllm is not None:
                log(f"batch {size}, repeat {r + 1}/{repeats}: vLLM ...")
                rate, cached = _engine_rate(vllm, rows, new_tokens)
                rates["vllm"].append(rate)
                vllm_reused += cached
        medians = {k: statistics.median(v) for k, v in rates.items() if v}
        results[f"engine_tokens_per_s_{name}"] = round(medians.pop("engine"), 1)
        vllm_rate = medians.pop("vllm", None)
        results[f"vllm_tokens_per_s_{name}"] = None if vllm_rate is None else round(vllm_rate, 1)
        if settings:
            setting, rate = max(medians.items(), key=lambda kv: kv[1])
            results[f"hf_tokens_per_s_{name}"] = round(rate, 1)
            results[f"hf_setting_{name}"] = setting
    results["engine_prefix_tokens_reused"] = reused
    results["vllm_prefix_tokens_reused"] = vllm_reused if vllm is not None else None
    if vllm is not None:
        vllm.close()
    del peer, vllm  # the multi-turn episodes are the engine's alone
    for name in ("b1", "b32"):
        other = results[f"vllm_tokens_per_s_{name}"]
        results[f"engine_over_vllm_{name}"] = (
            round(results[f"engine_tokens_per_s_{name}"] / other, 2) if other else None
        )
    if not large:
        results.update(_multiturn(model, config, quick, repeats, log))
    results["note"] = "; ".join(notes) or None
    if not settings:
        results["hf_tokens_per_s_b1"] = results["hf_tokens_per_s_b32"] = None
        results["engine_over_hf_b1"] = results["engine_over_hf_b32"] = None
        return results
    results["engine_over_hf_b1"] = round(results["engine_tokens_per_s_b1"] / results["hf_tokens_per_s_b1"], 2)
    results["engine_over_hf_b32"] = round(results["engine_tokens_per_s_b32"] / results["hf_tokens_per_s_b32"], 2)
    return results


def table(r: dict) -> str:
    rows = [
        ("", "batch 1", "batch 32"),
        ("engine tok/s", r["engine_tokens_per_s_b1"], r["engine_tokens_per_s_b32"]),
        ("HF generate() tok/s", r.get("hf_tokens_per_s_b1"), r.get("hf_tokens_per_s_b32")),
        ("engine / HF", r.get("engine_over_hf_b1"), r.get("engine_over_hf_b32")),
        ("vLLM tok/s", r.get("vllm_tokens_per_s_b1"), r.get("vllm_tokens_per_s_b32")),
        ("engine / vLLM", r.get("engine_over_vllm_b1"), r.get("engine_over_vllm_b32")),
    ]
    lines = [f"{a:<22}{'-' if b is None else b:>12}{'-' if c is None else c:>12}" for a, b, c in rows]
    lines.append(
        f"load: {r['load_s']} s, peak RSS +{r['load_peak_rss_mb']} MB for {r['checkpoint_mb']} MB of "
        f"safetensors ({r['load_rss_over_size']}x)"
    )
    if "multiturn_turns" in r:
        lines.append(
            f"multi-turn episodes ({r['multiturn_turns']} turns, 8 attempts): "
            f"{r['multiturn_tokens_per_s']} tok/s with the prefix cache, "
            f"{r['multiturn_tokens_per_s_no_prefix_cache']} without ({r['prefix_cache_speedup']}x; "
            f"{r['prefix_reused_fraction']:.0%} of prompt tokens reused)"
        )
    return "\n".join(lines)


def run_cli(quick: bool = False, as_json: bool = False, checkpoint_dir: str | None = None, shape: str = "tiny") -> int:
    return report(
        lambda log: run(quick=quick, log=log, checkpoint_dir=checkpoint_dir, shape=shape),
        lambda r: (
            f"codefleet bench engine ({r['checkpoint']}, {r['architecture']}, {r['dtype']}, "
            f"{r['threads']} threads, prompt {r['prompt_tokens']} + {r['new_tokens']} new "
            f"tokens, greedy{'' if r['native_kernel'] else ', without the native kernel'}"
            f"{', quick' if quick else ''})"
        ),
        table,
        as_json,
        note_key="note",
        name="engine",
    )


if __name__ == "__main__":  # the same as `codefleet bench engine` (its flags, --help and errors)
    from codefleet.cli import main

    sys.exit(main(["bench", "engine", *sys.argv[1:]]))
