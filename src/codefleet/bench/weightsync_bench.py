"""`codefleet bench weightsync`: seconds per weight update, trainer -> engines, per transport, in one run.

Setup, per model size (50 MB, 500 MB, 2 GB of float32; `--quick`: 50 MB): a Qwen3-MoE whose expert count
is chosen to reach the size (random weights, saved once to a temporary Hugging Face directory by a Ray task,
never in the driver); two real engine actors (`fleet.inference.EngineActor`) load it; two "trainer ranks" (Ray actors)
each hold half of the tensors (`split_names`), random, seeded. The driver only ever holds object refs.

Backends:
- `bucketed`: each rank sends its half as flat buckets of `bucket_mb` (`fleet.weight_sync`), one object per
  bucket in the Ray object store; the engines read them as they arrive, assemble them and apply one version.
- `gloo`: the same buckets broadcast over a gloo process group per rank (the rank and both engines,
  `GroupSync`), formed once (`group_setup_s`), the way NCCL carries them between GPUs.
- `whole`: each rank returns its half as one object (the way `TrainerGroup.publish` sends the whole state
  dict), the engines read both and apply them (`EngineActor.update_weights`).
- `vllm`: buckets through the object store into two vLLM engines on the same checkpoint (their update is
  vLLM's `reload_weights`, then the prefix cache reset), when vLLM is installed (`.venv-vllm`); else left out.

Measured: `sync_s` = seconds on the driver from the first send to both engines serving the new version
(median of `repeats`, after one warm-up); `gb_per_s` = model GB / sync_s (each engine receives the whole
model, so bytes delivered are twice that); `pause_ms` = how long in-flight requests were paused: the time an
engine's update kept its steps from running while a long generation was decoding on it (the reference swap,
`EngineActor.info()["pause_s"]`), median over the engines and repeats of the in-flight update; `apply_ms`: the
whole of that update inside the engine (copying into its spare buffers and building the derived forms while
it decodes, the wait for the running step, the swap). Transfers are measured with no request running (2 cores:
a decoding engine takes one); the pause with one.

Memory: while it stages an update, each engine holds its weights, the spare buffers they are copied into, and
the derived forms of both (the packed experts are a copy of the experts); each rank holds its half and the
object store one copy per update in flight, so a size runs only if about 10x it is available (else it is
skipped, with the reason).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass

import ray
import torch

from codefleet.bench.report import Log, report
from codefleet.chat.tokenizer import default_tokenizer
from codefleet.fleet.inference import broadcast_weights, start_engines
from codefleet.fleet.ray_init import init_ray
from codefleet.fleet.trainer_group import _SharedWeights
from codefleet.fleet.weight_sync import (
    BucketSender,
    GroupSender,
    GroupSync,
    TensorSpec,
    publish_buckets,
    specs_of,
    split_names,
)
from codefleet.inference.sampling import SamplingParams
from codefleet.model import hf
from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
from codefleet.model.export_cli import write_codefleet_text_files
from codefleet.model.transformer import Transformer

BASE = dict(
    vocab_size=4096,
    d_model=256,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=64,
    d_expert=2048,
    top_k=2,
    max_seq_len=2048,
    qk_norm=True,
    copy=CopyConfig(prev_tokens=0),
)  # a Qwen3-MoE: vLLM loads it too
EXPERT_BYTES = 2 * (256 * 4096 + 2048 * 256) * 4  # one expert in both layers, float32
HAVE_VLLM = importlib.util.find_spec("vllm") is not None
COPIES = 10  # model-sized copies alive at the peak (see the module docstring)


@dataclass
class BenchConfig:
    sizes_mb: tuple[int, ...] = (50, 500, 2000)
    bucket_mb: float = 64.0
    repeats: int = 3
    # "vllm": buckets through the object store into vLLM engines (reload_weights), where vLLM is installed
    backends: tuple[str, ...] = ("bucketed", "gloo", "whole", "vllm")
    quick: bool = False


QUICK = BenchConfig(sizes_mb=(50,), repeats=3, quick=True)


def model_config(size_mb: float) -> ModelConfig:
    """A codefleet MoE of about `size_mb` MB of float32 (experts make up the difference)."""
    base = sum(t.numel() * 4 for t in Transformer(ModelConfig.tiny(**BASE, n_experts=2)).state_dict().values())
    base -= 2 * EXPERT_BYTES
    n_experts = max(2, round((size_mb * 1e6 - base) / EXPERT_BYTES))
    return ModelConfig.tiny(**BASE, n_experts=n_experts)


@ray.remote(num_cpus=0)
def _make_checkpoint(config: ModelConfig, path: str) -> list[TensorSpec]:
    """A Hugging Face directory (Qwen3-MoE), which both engines load."""
    torch.manual_seed(0)
    model = Transformer(config)
    hf.save(model, path)
    write_codefleet_text_files(path, default_tokenizer())
    return specs_of(model.state_dict())


@ray.remote(num_cpus=0)
class ShardHolder:
    """A trainer rank holding its share of the tensors (random, seeded), sending them either way."""

    def __init__(self, specs: list[TensorSpec], seed: int):
        g = torch.Generator().manual_seed(seed)
        self.state = {s.name: (torch.randn(s.shape, generator=g) * 0.02).to(getattr(torch, s.dtype)) for s in specs}
        self.sender = BucketSender(lambda: self.state)
        self.group = GroupSender(self.sender)

    def plan(self, bucket_mb: float):
        return self.sender.plan(None, bucket_mb)

    def bucket(self, index: int):
        return self.sender.bucket(index)

    def whole(self) -> _SharedWeights:
        return _SharedWeights(self.state)

    def sync_group_address(self, timeout_s: float):
        return self.group.address(timeout_s)

    def join_sync_group(self, world: int, backend: str, timeout_s: float) -> None:
        self.group.join(world, backend, timeout_s)

    def send_sync_group(self) -> int:
        return self.group.send()


def _available_mb() -> float:
    with open("/proc/meminfo") as f:
        info = {line.split(":")[0]: int(line.split()[1]) for line in f}
    return info["MemAvailable"] / 1024


def _send(backend: str, holders: list, plans: list, engines: list, version: int, group: GroupSync | None) -> float:
    start = time.perf_counter()
    if backend == "gloo":
        group.send(plans, version)
    elif backend in ("bucketed", "vllm"):
        weights = publish_buckets(holders, plans, version)
        broadcast_weights(engines, weights, version)
    else:
        refs = [h.whole.remote() for h in holders]
        ray.get([e.update_weights.remote(refs, version) for e in engines])
    elapsed = time.perf_counter() - start
    versions = [info["version"] for info in ray.get([e.info.remote() for e in engines])]
    if versions != [version] * len(engines):
        raise RuntimeError(f"the engines serve versions {versions} after the update to {version}")
    return elapsed


def _one_size(size_mb: int, cfg: BenchConfig, root: str, log: Log) -> dict:
    config = model_config(size_mb)
    path = os.path.join(root, f"model-{size_mb}")
    specs = ray.get(_make_checkpoint.remote(config, path))
    model_bytes = sum(s.nbytes for s in specs)
    codefleet_engines = start_engines(path, 2, num_cpus=0, max_batch=2, max_seq_len=config.max_seq_len)
    # vLLM's engines last, alone: the codefleet engines are gone by then (memory and cores are tight here)
    backends = sorted((b for b in cfg.backends if b != "vllm" or HAVE_VLLM), key=lambda b: b == "vllm")
    vllm_engines: list = []
    by_name = {s.name: s for s in specs}
    holders = [ShardHolder.remote([by_name[n] for n in share], seed=r) for r, share in enumerate(split_names(specs, 2))]
    plans = ray.get([h.plan.remote(cfg.bucket_mb) for h in holders])
    out: dict = {
        "model_mb": round(model_bytes / 1e6, 1),
        "n_experts": config.n_experts,
        "buckets": sum(len(p.buckets) for p in plans),
        "backends": {},
    }
    version, group = 0, None
    try:
        if "gloo" in backends:  # formed once per run, like a training run's groups
            start = time.perf_counter()
            group = GroupSync(holders, codefleet_engines)
            out["group_setup_s"] = round(time.perf_counter() - start, 3)
        for backend in backends:
            version += 1
            if backend == "vllm":
                for actor in codefleet_engines:
                    ray.kill(actor)
                vllm_engines = start_engines(
                    path,
                    2,
                    num_cpus=0,
                    max_batch=2,
                    max_seq_len=config.max_seq_len,
                    backend="vllm",
                    record_routing=False,
                )
            engines = vllm_engines if backend == "vllm" else codefleet_engines
            _send(backend, holders, plans, engines, version, group)  # warm-up
            times = []
            for _ in range(cfg.repeats):
                version += 1
                times.append(_send(backend, holders, plans, engines, version, group))
            # the pause: the same update while a long generation decodes on every engine
            pauses, applies = [], []
            for _ in range(cfg.repeats):
                version += 1
                inflight = [
                    e.generate.remote([1, 2, 3], SamplingParams(max_tokens=config.max_seq_len - 8)) for e in engines
                ]
                deadline = time.monotonic() + 60
                while min(i["running"] for i in ray.get([e.info.remote() for e in engines])) < 1:
                    if time.monotonic() > deadline:
                        raise RuntimeError("the in-flight generation did not start within 60 s")
                    time.sleep(0.02)
                _send(backend, holders, plans, engines, version, group)
                infos = ray.get([e.info.remote() for e in engines])
                pauses += [i["pause_s"] * 1000 for i in infos]
                applies += [i["apply_s"] * 1000 for i in infos]
                for ref in inflight:
                    ray.cancel(ref)
                ray.wait(inflight, num_returns=len(inflight), timeout=60)
            sync_s = statistics.median(times)
            out["backends"][backend] = {
                "sync_s": round(sync_s, 4),
                "sync_s_all": [round(t, 4) for t in times],
                "gb_per_s": round(model_bytes / 1e9 / sync_s, 3),
                "pause_ms_p50": round(statistics.median(pauses), 2),
                "pause_ms_max": round(max(pauses), 2),
                "apply_ms_p50": round(statistics.median(applies), 1),
            }
            log(
                f"{size_mb} MB {backend}: {sync_s:.3f} s per update, {model_bytes / 1e9 / sync_s:.2f} GB/s, "
                f"pause p50 {statistics.median(pauses):.1f} ms"
            )
    finally:
        for actor in codefleet_engines + vllm_engines + holders:
            ray.kill(actor)
        shutil.rmtree(path, ignore_errors=True)
    return out


def run(cfg: BenchConfig, log: Log = print) -> dict:
    started = init_ray(num_cpus=4, object_store_mb=int(min(0.4 * _available_mb(), 8000)))
    root = tempfile.mkdtemp(prefix="codefleet-weightsync-", dir="/var/tmp")
    per_size, skipped = {}, {}
    try:
        for size_mb in cfg.sizes_mb:
            need, have = COPIES * size_mb, _available_mb()
            if have < need:
                skipped[str(size_mb)] = (
                    f"needs about {need:.0f} MB free ({COPIES} copies of the model), {have:.0f} MB available"
                )
                log(f"{size_mb} MB skipped: {skipped[str(size_mb)]}")
                continue
            per_size[str(size_mb)] = _one_size(size_mb, cfg, root, log)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if started:
            ray.shutdown()
    backends = [b for b in cfg.backends if all(b in s["backends"] for s in per_size.values())]
    r = {
        "sync_s_by_mb": {b: {mb: s["backends"][b]["sync_s"] for mb, s in per_size.items()} for b in backends},
        "gb_per_s": {b: {mb: s["backends"][b]["gb_per_s"] for mb, s in per_size.items()} for b in backends},
        "pause_ms_p50": {b: {mb: s["backends"][b]["pause_ms_p50"] for mb, s in per_size.items()} for b in backends},
        "speedup_bucketed_vs_whole": {
            mb: round(s["backends"]["whole"]["sync_s"] / s["backends"]["bucketed"]["sync_s"], 2)
            for mb, s in per_size.items()
        }
        if {"bucketed", "whole"} <= set(backends)
        else {},
        "per_size": per_size,
        "skipped": skipped,
        "config": asdict(cfg),
        "cpus": os.cpu_count(),
        "not_measured": "NCCL (needs GPUs)" + ("" if HAVE_VLLM else "; vLLM's reload (run it in .venv-vllm)"),
    }
    return r


def table(r: dict) -> str:
    lines = [f"{'MB':>6} {'backend':<9} {'sync s':>8} {'GB/s':>7} {'pause p50 ms':>13} {'pause max ms':>13}"]
    for _mb, s in r["per_size"].items():
        for b, m in s["backends"].items():
            lines.append(
                f"{s['model_mb']:>6.0f} {b:<9} {m['sync_s']:>8.3f} {m['gb_per_s']:>7.2f} "
                f"{m['pause_ms_p50']:>13.1f} {m['pause_ms_max']:>13.1f}"
            )
    for mb, why in r["skipped"].items():
        lines.append(f"{mb:>6} skipped: {why}")
    return "\n".join(lines)


def run_cli(quick: bool = False, as_json: bool = False) -> int:
    cfg = QUICK if quick else BenchConfig()
    return report(
        lambda log: run(cfg, log),
        lambda r: (
            f"codefleet bench weightsync (2 trainer ranks -> 2 engines, buckets of "
            f"{cfg.bucket_mb:g} MB{', quick' if quick else ''})"
        ),
        table,
        as_json,
        note_key="not_measured",
        name="weightsync",
    )
