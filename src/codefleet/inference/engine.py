"""The inference engine: continuous batching over a slot KV cache.

Agent turns differ wildly in length, so requests join and leave the running batch independently. One `step()`:

1. applies a pending weight update (`update_weights`), so updates land *between* steps and in-flight sequences
   simply continue under the new weights;
2. admits waiting requests into free cache slots and prefills them (prompts of different lengths right-padded into
   one forward pass, bounded by `prefill_tokens` per step), sampling each one's first token;
3. runs one decode forward pass for every running sequence (`T = 1`, each row at its own length) and samples the
   next token of each;
4. finishes the sequences that sampled a stop token, completed a stop string or reached `max_tokens`, frees their
   slots, and keeps the running ones packed in the lowest slots (the cache then reads a view, no gather).

Prefix cache: a finished sequence's keys and values are *parked* in one of `prefix_slots` extra cache slots (least
recently used evicted), with its tokens and their routing. A new request whose prompt starts with parked tokens (the
next turn of an agent episode extends the previous prompt and completion; the attempts of a group share the system
and task prompt) copies the longest common prefix into its running slot and prefills only the rest. Reuse is exact:
the copied keys/values are what the same weights computed for the same tokens at the same positions, so tokens and
logprobs do not change. A weight update drops every parked prefix (a prefix is reused only under the weights that
computed it), and a sequence admitted before an update is not parked when it finishes (its keys/values span both
weights). `prefix_hits`, `prefix_tokens_reused` and `prefill_tokens` count what it saved.

A finished sequence stays for one more pass ("drain"): its last token goes through the model once, so the routed
experts of *every* generated token are known (a token's routing is decided when it is the model's input). Its logits
are dropped.

What a result carries, per generated token: the id, its logprob under the model at temperature 1 (`log_softmax` of
the raw logits — exactly what the trainer's `token_logprobs` computes on a full forward over prompt + completion;
temperature/top-k/top-p only choose the token), the policy version of the weights that sampled it, and the experts
each MoE layer routed it to; with `SamplingParams.top_logprobs`, the likeliest tokens at that step and their
logprobs (the same distribution).

Constrained tool calls: a request whose `SamplingParams.tools` is set samples only turns whose tool calls parse and
fit those schemas (`grammar.py`: a token the grammar refuses is masked and the row sampled again); `Result.refused`
counts the tokens where the model's first choice was refused. The prompt's routing (from prefill) is kept too, for
rollout routing replay over the whole sequence.

Two ways in: `generate(prompts, params)` runs steps in the caller's thread until its requests finish;
`submit(prompt, params)` returns a `concurrent.futures.Future` and a background thread steps while there is work
(the server uses this; concurrent requests share decode steps). Both are thread-safe; one lock serialises steps and
weight updates."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

import torch

from codefleet.chat import formats
from codefleet.inference import fast
from codefleet.inference.cache import SlotKVCache
from codefleet.inference.grammar import GrammarCache
from codefleet.inference.next_token import sample_next_tokens
from codefleet.inference.prefix_cache import Parked, PrefixCache
from codefleet.inference.request import BackgroundSleep, Request, Result, settle
from codefleet.inference.sampling import SamplingParams, per_prompt
from codefleet.inference.validation import check_prompt, check_sizes
from codefleet.inference.weight_swap import Update, WeightSwap
from codefleet.model import checkpoint

log = logging.getLogger(__name__)


class Engine(BackgroundSleep):
    """Continuous-batching generation for a codefleet Transformer. `sleep` pauses the background loop only:
    `generate()` steps in its caller's thread regardless."""

    # Capabilities (codefleet.contracts.ENGINES)
    tool_grammar = True  # constrained tool calls (SamplingParams.tools)
    gpu = False  # an engine actor runs it on CPU
    serve_options: dict = {}  # served as RL loads it
    omp_threads_from_env = False  # torch.set_num_threads is enough

    @classmethod
    def load(cls, checkpoint_dir: str, max_batch: int = 32, max_seq_len: int | None = None, **engine_options) -> Engine:
        """An engine over a saved checkpoint (the ENGINES loader); the tokenizer and chat format are the
        checkpoint's own (`formats.for_checkpoint`: a Hugging Face directory's tokenizer.json and chat
        template, a codefleet checkpoint's tokenizer.json, else the default tokenizer)."""
        model = checkpoint.load(checkpoint_dir)
        tokenizer, _ = formats.for_checkpoint(checkpoint_dir)
        formats.check_vocab(tokenizer, model.config.vocab_size)
        return cls(model, tokenizer, max_batch=max_batch, max_seq_len=max_seq_len, **engine_options)

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer=None,
        max_batch: int = 32,
        max_seq_len: int | None = None,
        prefill_tokens: int = 8192,
        version: int = 0,
        record_routing: bool = True,
        prefix_slots: int | None = None,
        min_prefix: int = 16,
    ):
        """`prefix_slots`: parked prefixes kept for reuse (default `max_batch`; 0 turns the prefix cache off);
        `min_prefix`: the fewest common tokens worth copying instead of recomputing."""
        check_sizes(max_batch, max_seq_len)
        self.model = model.eval()
        self.tokenizer = tokenizer
        config = model.config
        self.max_seq_len = int(max_seq_len or config.max_seq_len)
        self.max_batch = max_batch
        self.prefill_tokens = prefill_tokens
        prefix_slots = max_batch if prefix_slots is None else int(prefix_slots)
        self.record_routing = record_routing and model.config.n_moe_layers > 0  # a dense model routes nothing
        self.version = version
        param = next(model.parameters())
        self.device = param.device
        # slots 0..max_batch-1 hold the running sequences (packed low), the rest hold parked prefixes
        self.cache = SlotKVCache(
            config.n_layers,
            max_batch + prefix_slots,
            config.n_kv_heads,
            config.head_dim,
            self.max_seq_len,
            dtype=param.dtype,
            device=self.device,
            copy_dim=config.head_dim if config.copy.head else 0,
        )
        model.rotary_table(self.max_seq_len, self.device)  # every position the cache holds: no per-step growth
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # index i holds slot i
        self._ids = itertools.count()
        self._queue_lock = threading.Lock()  # guards _waiting and _pending
        self._step_lock = threading.Lock()  # one step or weight update at a time
        self._pending: Update | None = None
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._default_generator = torch.Generator(device=self.device)
        self._default_generator.seed()
        self.prefix = PrefixCache(self.cache, max_batch, prefix_slots, min_prefix)
        self.steps = 0  # forward passes that decoded
        self.peak_batch = 0  # most sequences decoded together
        self.prefill_tokens_computed = 0  # prompt tokens run through the model
        self.weight_loads = 0  # weight updates applied (a policy version may repeat; this never does)
        self.pause_s = 0.0  # how long the last weight update kept steps from running
        self._asleep = False  # `sleep`: the background loop does not step
        self._gate = threading.Lock()  # held by each iteration of the background loop
        self._swap = WeightSwap(model)
        self._grammars = GrammarCache()  # the compiled tool-call grammars, by tools and tool choice

    # -- requests ------------------------------------------------------------------------

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams | None = None,
        on_token: Callable[[int, float, list[tuple[int, float]]], None] | None = None,
    ) -> Future:
        """Queue one request; the background thread generates it. `on_token(id, logprob, top)` streams tokens
        (called from the engine's thread; `top`: the token's Result.top_logprobs entry, [] unless asked for)."""
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
        seq = self._make_sequence(prompt, params or SamplingParams(), on_token)
        self._enqueue([seq])
        return seq.future

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Result]:
        """Generate for every prompt (batched together with whatever else is running) and wait for all."""
        params = per_prompt(params, len(prompts))
        seqs = [self._make_sequence(p, sp, None) for p, sp in zip(prompts, params)]
        self._enqueue(seqs)
        if self._thread is not None and self._thread.is_alive():
            return [s.future.result() for s in seqs]
        while not all(s.future.done() for s in seqs):
            self.step()
        return [s.future.result() for s in seqs]

    def _make_sequence(self, prompt: list[int], params: SamplingParams, on_token) -> Request:
        if self._closed:
            raise RuntimeError("the engine is closed; create a new Engine")
        params.validate()
        prompt = [int(t) for t in prompt]
        check_prompt(prompt, self.model.config.vocab_size, self.max_seq_len)
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        # the last token needs a cache position for its drain pass, hence max_seq_len - len(prompt)
        max_tokens = min(params.max_tokens, self.max_seq_len - len(prompt))
        seq = Request(next(self._ids), prompt, params, max_tokens, Future(), on_token, generator, time.perf_counter())
        if params.tools or params.tool_choice == "none":  # "none" needs no tools: it forbids every call
            seq.matcher = self._grammars.get(self.tokenizer, params).start()
        return seq

    def _enqueue(self, seqs: list[Request]) -> None:
        with self._queue_lock:
            self._waiting.extend(seqs)
        self._wake.set()

    @property
    def n_running(self) -> int:
        return len(self._running)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    # -- weights ---------------------------------------------------------------------------

    def update_weights(self, state_dict: dict, version: int) -> None:
        """Load new weights between two steps; tokens sampled afterwards carry `version`. Blocks until applied.

        The copy into the engine's spare buffers (and the derived forms of the weights) happens here, in the
        caller's thread, while steps go on (`model.weight_swap`); between two steps the engine only swaps
        references. `pause_s`: how long the last swap kept steps from running."""
        update = Update(self._swap.stage(state_dict), int(version))
        with self._queue_lock:
            if self._pending is not None:  # superseded before it landed
                self._pending.done.set()
            self._pending = update
        self._wake.set()
        while not update.done.is_set():  # apply it ourselves unless a stepping thread does first
            if self._step_lock.acquire(timeout=0.05):
                try:
                    self._apply_pending()
                finally:
                    self._step_lock.release()
        if update.error is not None:
            raise update.error

    def _apply_pending(self) -> None:
        with self._queue_lock:
            update, self._pending = self._pending, None
        if update is None:
            return
        try:
            start = time.perf_counter()
            self._swap.apply(update.staged)
            self.version = update.version
            self.weight_loads += 1
            self.prefix.clear()  # their keys/values came from the old weights
            self.pause_s = time.perf_counter() - start
        except Exception as e:  # reported to the caller; the engine keeps serving
            update.error = e
        finally:
            update.done.set()

    # -- the step loop -------------------------------------------------------------------

    def step(self) -> int:
        """Admit, prefill, decode once, finish; the number of sequences that finished."""
        with self._step_lock, torch.inference_mode():
            self._apply_pending()
            try:
                self._drop_cancelled()
                admitted = self._admit()
                if admitted:
                    self._prefill(admitted)
                finished = self._decode() if self._running else 0
            except Exception as e:  # fail the requests in flight, free everything, keep serving
                log.exception("engine step failed")
                finished = self._fail_all(e)
            self._apply_pending()
            self.steps += 1
            return finished

    def _drop_cancelled(self) -> None:
        with self._queue_lock:
            self._waiting = deque(s for s in self._waiting if not s.future.cancelled())
        gone = [i for i, s in enumerate(self._running) if s.future.cancelled()]
        self._release(gone)

    def _admit(self) -> list[Request]:
        admitted: list[Request] = []
        with self._queue_lock:
            longest = 0
            while self._waiting and len(self._running) + len(admitted) < self.max_batch:
                nxt = self._waiting[0]
                nxt.reuse_from, nxt.reused = self.prefix.match(nxt.prompt)
                longest_next = max(longest, len(nxt.prompt) - nxt.reused)
                if admitted and longest_next * (len(admitted) + 1) > self.prefill_tokens:
                    break
                admitted.append(self._waiting.popleft())
                longest = longest_next
        for seq in admitted:
            seq.slot = len(self._running)
            seq.weight_loads = self.weight_loads
            self._running.append(seq)
            if seq.reuse_from is not None:
                self.prefix.take(seq.reuse_from, seq.slot, seq.reused)
        self.prefix.drop_superseded()  # after every copy: several may have matched the same entry
        return admitted

    # -- the prefix cache ------------------------------------------------------------------

    @property
    def min_prefix(self) -> int:
        return self.prefix.min_prefix

    @property
    def prefix_hits(self) -> int:
        return self.prefix.hits

    @property
    def prefix_tokens_reused(self) -> int:
        return self.prefix.tokens_reused

    @property
    def _parked(self) -> list[Parked]:
        return self.prefix.entries

    def _park(self, seq: Request) -> None:
        """Keep a finished sequence's keys/values (every token that went through the model) for reuse, unless
        a weight update landed while it ran (a prefix is reused only under the weights that computed it)."""
        if seq.future.cancelled() or seq.weight_loads != self.weight_loads:
            return
        n = self.cache.lengths[seq.slot]
        routing = (seq.prompt_routing + seq.routing)[:n] if self.record_routing else None
        if routing is None or len(routing) == n:  # routing replay needs every reused token's experts
            self.prefix.park(seq.slot, (seq.prompt + seq.tokens)[:n], routing)

    def _forward(
        self,
        seqs: list[Request],
        starts: list[int],
        tokens_BT: torch.Tensor,
        positions_BT: torch.Tensor,
        logits_at_B: torch.Tensor | None = None,
    ):
        """The model over each sequence's tokens from `starts[b]` on (the model's previous-token inputs included)."""
        cfg = self.model.config
        prev_BK = None
        if cfg.copy.prev_tokens:
            prev_BK = torch.tensor(
                [s.before(i, cfg.copy.prev_tokens, cfg.vocab_size) for s, i in zip(seqs, starts)], device=self.device
            )
        return self.model(
            tokens_BT,
            positions_BT=positions_BT,
            cache=self.cache,
            return_routing=self.record_routing,
            logits_at_B=logits_at_B,
            prev_BK=prev_BK,
            fast=fast,
        )

    def _copy_ends(self, seqs: list[Request]) -> list[int] | None:
        """With copy scope "prompt" the copy head points only into each request's prompt."""
        return [len(s.prompt) for s in seqs] if self.model.config.copy.scope == "prompt" else None

    def _prefill(self, seqs: list[Request]) -> None:
        """One forward pass over each prompt's tokens after its reused prefix (right-padded to the longest)."""
        suffixes = [s.prompt[s.reused :] for s in seqs]
        T = max(len(x) for x in suffixes)
        tokens = torch.zeros(len(seqs), T, dtype=torch.long)
        for b, x in enumerate(suffixes):
            tokens[b, : len(x)] = torch.tensor(x)
        tokens_BT = tokens.to(self.device)
        starts = [s.reused for s in seqs]
        positions_BT = torch.tensor(starts, device=self.device)[:, None] + torch.arange(T, device=self.device)
        positions_BT = positions_BT.clamp_(max=self.max_seq_len - 1)  # padding past the cache (see cache.py)
        self.cache.begin([s.slot for s in seqs], starts, [len(x) for x in suffixes], T, self._copy_ends(seqs))
        last_B = torch.tensor([len(x) - 1 for x in suffixes], device=self.device)
        out = self._forward(seqs, starts, tokens_BT, positions_BT, logits_at_B=last_B)  # each prompt's last logits
        self.cache.end()
        self.prefill_tokens_computed += sum(len(x) for x in suffixes)
        logits_BV = out.logits_BTV[:, 0]
        now = time.perf_counter()
        if self.record_routing:
            routing_BTLK = torch.stack(list(out.routed_experts), dim=2).tolist()
            for b, s in enumerate(seqs):
                prefix = s.reuse_from.routing[: s.reused] if s.reuse_from is not None else []
                s.prompt_routing = prefix + routing_BTLK[b][: len(suffixes[b])]
        for s in seqs:
            s.reuse_from = None  # the entry may be evicted from now on
        for s in seqs:
            s.prefilled = now
        sample_next_tokens(seqs, logits_BV, self.version, self.tokenizer, self._default_generator)

    def _decode(self) -> int:
        running = self._running
        self.peak_batch = max(self.peak_batch, len(running))
        tokens_B1 = torch.tensor([[s.tokens[-1]] for s in running], device=self.device)
        starts = [s.length - 1 for s in running]
        positions_B1 = torch.tensor(starts, device=self.device)[:, None]
        self.cache.begin([s.slot for s in running], starts, [1] * len(running), 1, self._copy_ends(running))
        out = self._forward(running, starts, tokens_B1, positions_B1)
        self.cache.end()
        if self.record_routing:
            routing_BLK = torch.stack([r[:, 0] for r in out.routed_experts], dim=1).tolist()
            for s, r in zip(running, routing_BLK):
                s.routing.append(r)
        active = [i for i, s in enumerate(running) if not s.finish_reason]
        drained = [i for i, s in enumerate(running) if s.finish_reason]
        if active:
            logits_BV = out.logits_BTV[:, 0]
            if len(active) < len(running):
                logits_BV = logits_BV[torch.tensor(active, device=self.device)]
            sampled = [running[i] for i in active]
            sample_next_tokens(sampled, logits_BV, self.version, self.tokenizer, self._default_generator)
        for i in drained:
            running[i].resolve(self.tokenizer)
        self._release(drained, park=True)
        if not self.record_routing:  # no drain pass: finish now
            done = [i for i, s in enumerate(self._running) if s.finish_reason]
            for i in done:
                self._running[i].resolve(self.tokenizer)
            self._release(done, park=True)
            return len(drained) + len(done)
        return len(drained)

    def _release(self, indices: list[int], park: bool = False) -> None:
        """Free the slots of running[indices] and move the last sequences into the holes (keeps slots packed);
        `park`: keep their keys/values in the prefix cache first."""
        for i in sorted(indices, reverse=True):
            if park:
                self._park(self._running[i])
            self.cache.free(self._running[i].slot)
            last = len(self._running) - 1
            if i != last:
                moved = self._running[last]
                self.cache.move(last, i)
                moved.slot = i
                self._running[i] = moved
            self._running.pop()

    def _fail_all(self, error: Exception) -> int:
        failed = list(self._running)
        for s in failed:
            settle(s.future, error=error)
        self._release(list(range(len(self._running))))
        self.cache._step = None
        return len(failed)

    # -- background stepping -------------------------------------------------------------

    def _ensure_thread(self) -> None:
        with self._queue_lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._loop, name="codefleet-engine", daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while not self._closed:
            with self._gate:
                busy = not self._asleep and (self._running or self._waiting)
                if busy:
                    self.step()
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                if self._pending is not None:
                    with self._step_lock:
                        self._apply_pending()

    def close(self) -> None:
        """Stop the background thread; requests still in flight fail."""
        self._closed = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with self._step_lock:
            error = RuntimeError("the engine was closed before the request finished")
            for s in list(self._waiting) + self._running:
                settle(s.future, error=error)
            self._waiting.clear()
            self._release(list(range(len(self._running))))

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
