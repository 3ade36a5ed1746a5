"""One request as the engine runs it (`Request`), what it returns (`Result`), and the parts an engine
backend shares: settling a request's future (`settle`) and pausing the background loop (`BackgroundSleep`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import torch

from codefleet.inference.prefix_cache import Parked
from codefleet.inference.sampling import SamplingParams
from codefleet.inference.turn_matcher import TurnMatcher


@dataclass
class Result:
    """One finished request."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # sampled, stop token included
    logprobs: list[float]  # model logprob (temperature 1) of each sampled token
    versions: list[int]  # policy version that sampled each token
    routed_experts: list[list[list[int]]]  # [token][moe layer][top_k] for each generated token
    prompt_routed_experts: list[list[list[int]]]  # the same for each prompt token
    finish_reason: str  # "stop" (stop token or string) | "length"
    text: str = ""  # decoded completion, without the stop token and cut before a stop string
    stop: int | str | None = None  # the stop token id or string that ended it
    prefill_s: float = 0.0
    total_s: float = 0.0
    cached_tokens: int = 0  # prompt tokens whose keys/values the prefix cache supplied
    refused: int = 0  # tokens whose first draw the tool-call grammar refused (SamplingParams.tools)
    # per generated token, the SamplingParams.top_logprobs likeliest tokens as (id, logprob), likeliest first
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class Request:
    """One request as the engine runs it: its prompt, what it sampled so far, where it stands."""

    id: int
    prompt: list[int]
    params: SamplingParams
    max_tokens: int
    future: Future
    on_token: Callable[[int, float, list[tuple[int, float]]], None] | None
    generator: torch.Generator | None
    submitted: float
    slot: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    routing: list[list[list[int]]] = field(default_factory=list)
    prompt_routing: list[list[list[int]]] = field(default_factory=list)
    finish_reason: str = ""
    stop: int | str | None = None
    text_cut: int | None = None
    prefilled: float = 0.0
    reused: int = 0  # prompt tokens whose keys/values came from the prefix cache
    reuse_from: Parked | None = None
    weight_loads: int = -1  # the engine's `weight_loads` at admission: the weights its keys/values come from
    matcher: TurnMatcher | None = None  # where it stands in the tool-call grammar (SamplingParams.tools)
    refused: int = 0
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.tokens)

    def before(self, index: int, k: int, none: int) -> list[int]:
        """The k token ids before position `index` of the sequence (prompt, then sampled), `none` before its start."""
        n = len(self.prompt)
        return [none if i < 0 else self.prompt[i] if i < n else self.tokens[i - n] for i in range(index - k, index)]

    def check_finished(self, tokenizer) -> None:
        """Set `finish_reason` if the last token ended it: a stop token, a stop string (decoded with
        `tokenizer`, None: no stop strings), `max_tokens`."""
        tok = self.tokens[-1]
        if tok in self.params.stop_token_ids:
            self.finish_reason, self.stop = "stop", tok
        elif self.params.stop and tokenizer is not None and self._hit_stop_string(tokenizer):
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"

    def _hit_stop_string(self, tokenizer) -> bool:
        # Only the tail can complete a stop string: a token is at least one byte, a character at most four.
        window = 4 * max(len(x) for x in self.params.stop) + 4
        tail_start = max(len(self.tokens) - window, 0)
        tail = tokenizer.decode(self.tokens[tail_start:])
        for stop in self.params.stop:
            if stop and stop in tail:
                text = tokenizer.decode(self.tokens)
                self.stop, self.text_cut = stop, text.find(stop)
                return True
        return False

    def resolve(self, tokenizer) -> None:
        """Settle the future with its Result (the text decoded with `tokenizer`, None: no text)."""
        if self.future.done():  # cancelled by its client (it may still be cancelled while this runs: see settle)
            return
        ids = self.tokens[:-1] if self.stop is not None and not isinstance(self.stop, str) else self.tokens
        text = tokenizer.decode(ids) if tokenizer is not None else ""
        if self.text_cut is not None and self.text_cut >= 0:
            text = text[: self.text_cut]
        now = time.perf_counter()
        result = Result(
            self.prompt,
            self.tokens,
            self.logprobs,
            self.versions,
            self.routing,
            self.prompt_routing,
            self.finish_reason,
            text,
            self.stop,
            prefill_s=self.prefilled - self.submitted,
            total_s=now - self.submitted,
            cached_tokens=self.reused,
            refused=self.refused,
            top_logprobs=self.top_logprobs,
        )
        settle(self.future, result=result)


def top_logprobs(seqs: list[Request], logits_BV: torch.Tensor) -> list[list[tuple[int, float]]]:
    """Each row's `params.top_logprobs` likeliest tokens as (id, logprob) under the model (temperature 1,
    before any grammar, like the sampled token's logprob); [] for rows that asked for none."""
    rows = [i for i, s in enumerate(seqs) if s.params.top_logprobs]
    tops: list[list[tuple[int, float]]] = [[] for _ in seqs]
    if not rows:
        return tops
    k = min(max(seqs[i].params.top_logprobs for i in rows), logits_BV.shape[-1])
    picked_RV = logits_BV[torch.tensor(rows, device=logits_BV.device)].float()
    values_RK, ids_RK = torch.log_softmax(picked_RV, dim=-1).topk(k, dim=-1)
    for r, i in enumerate(rows):
        n = seqs[i].params.top_logprobs
        tops[i] = list(zip(ids_RK[r, :n].tolist(), values_RK[r, :n].tolist()))
    return tops


def settle(future: Future, result: Result | None = None, error: BaseException | None = None) -> None:
    """Resolve `future` unless it is already done: a client may cancel it from another thread at any moment."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:  # cancelled (or resolved) since the caller looked
        pass


class BackgroundSleep:
    """`sleep` / `wake` of an engine's background step loop, colocated with a trainer (fleet.placement): the
    loop holds `_gate` through each iteration and steps only while not `_asleep`; `_wake` is the Event it
    waits on when idle. Requests stay queued or running, weight updates still land, memory stays allocated."""

    _asleep: bool
    _gate: threading.Lock
    _wake: threading.Event

    def sleep(self) -> None:
        """Stop stepping; returns once the step running now has ended."""
        self._asleep = True
        with self._gate:  # a loop iteration that began awake ends here
            pass

    def wake(self) -> None:
        self._asleep = False
        self._wake.set()
