"""Sampling parameters and batched sampling of the next token.

One call samples every row of a batch at once: greedy rows (`temperature`
below `MIN_TEMPERATURE`, 0 included: dividing float32 logits by less
overflows to NaN) take the argmax, the others draw from `softmax(logits / temperature)`
restricted by top-k and top-p. Randomness comes from one uniform number per
row, drawn from the row's own generator when it has a seed, so a seeded
request samples the same tokens alone or in any batch.

The logprob reported for a sampled token is the model's own: `log_softmax`
of the raw logits (temperature 1, before top-k/top-p). That is what the
trainer computes (`transformer.token_logprobs` over the same tokens), so the
two agree to float precision, and it is the quantity policy-gradient losses
need. Temperature, top-k and top-p shape which token is drawn, not the
logprob recorded for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

MIN_TEMPERATURE = 1e-5  # below it a row samples greedily
TOOL_CHOICES = ("auto", "required", "none")  # OpenAI's tool_choice strings (model.grammar)


@dataclass
class SamplingParams:
    """How one request samples; the OpenAI names where there is one."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no limit
    stop_token_ids: list[int] = field(default_factory=list)  # end the sequence (the token is kept in the result)
    stop: list[str] = field(default_factory=list)  # end when the decoded text contains one (the text is cut before it)
    seed: int | None = None
    # constrained tool calls (model.grammar): every call sampled parses and fits one of these OpenAI tool
    # schemas; tool_choice "required" also needs a call before the turn ends, "none" allows none (with or
    # without tools); calls_only: the turn opens with a call and holds calls alone, at most max_calls (0: any)
    tools: list[dict] | None = None
    tool_choice: str = "auto"
    calls_only: bool = False
    max_calls: int = 0
    top_logprobs: int = 0  # also report this many of the likeliest tokens (and their logprobs) at each step

    def validate(self) -> None:
        """Raise ValueError naming the bad field and its allowed range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer (0: no limit), got {self.top_k!r}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must be a signed 64-bit integer, got {self.seed!r}")
        if self.tool_choice not in TOOL_CHOICES:
            raise ValueError(f"tool_choice must be auto, required or none, got {self.tool_choice!r}")
        if (self.calls_only or self.max_calls) and not self.tools:
            raise ValueError("calls_only and max_calls constrain tool calls; give the tools they may call")
        if not isinstance(self.max_calls, int) or self.max_calls < 0:
            raise ValueError(f"max_calls must be a non-negative integer (0: no limit), got {self.max_calls!r}")
        if not isinstance(self.top_logprobs, int) or self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be a non-negative integer, got {self.top_logprobs!r}")


def sample_next(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its logprob under the model (temperature 1): `(tokens_B, logprobs_B)`."""
    logits_BV = logits_BV.float()
    tokens_B = logits_BV.max(dim=-1).indices  # argmax (the first of ties); max is ~20% faster on CPU
    sampled = [i for i, p in enumerate(params) if p.temperature >= MIN_TEMPERATURE]
    if sampled:
        rows = torch.tensor(sampled, device=logits_BV.device)
        tokens_B[rows] = _draw(
            logits_BV[rows], [params[i] for i in sampled], [generators[i] for i in sampled], default_generator
        )
    # the trainer's token_logprobs; log_softmax is ~2x faster than logsumexp on CPU at [32, 4096]
    return tokens_B, torch.log_softmax(logits_BV, dim=-1).gather(1, tokens_B[:, None])[:, 0]


def _draw(
    logits_SV: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
) -> torch.Tensor:
    """Inverse-CDF sampling with one uniform per row (per-row generators keep seeded rows reproducible)."""
    device = logits_SV.device
    temps_S1 = torch.tensor([p.temperature for p in params], device=device)[:, None]
    probs_SV = torch.softmax(logits_SV / temps_S1, dim=-1)
    index_SV = None
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        probs_SV, index_SV = probs_SV.sort(dim=-1, descending=True)
        V = probs_SV.shape[1]
        top_k_S1 = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=device)[:, None]
        top_p_S1 = torch.tensor([p.top_p for p in params], device=device)[:, None]
        rank_V = torch.arange(V, device=device)[None, :]
        before_SV = probs_SV.cumsum(dim=-1) - probs_SV  # mass of the better tokens
        keep = (rank_V < top_k_S1) & ((before_SV < top_p_S1) | (rank_V == 0))
        probs_SV = probs_SV * keep
    uniforms = [torch.rand(1, generator=g if g is not None else default_generator, device=device) for g in generators]
    u_S1 = torch.cat(uniforms)[:, None]
    cdf_SV = probs_SV.cumsum(dim=-1)
    # right=True: the first index whose cdf exceeds u * total never lands on a token with zero mass
    choice_S = torch.searchsorted(cdf_SV, u_S1 * cdf_SV[:, -1:], right=True)[:, 0].clamp(max=cdf_SV.shape[1] - 1)
    if index_SV is not None:
        choice_S = index_SV.gather(1, choice_S[:, None])[:, 0]
    return choice_S


def per_prompt(params: SamplingParams | list[SamplingParams] | None, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt of `n`, from one (or None: the defaults) or a list of exactly `n`."""
    if not isinstance(params, list):
        params = [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"{n} prompts but {len(params)} sampling params; give one or one per prompt")
    return params
