"""Each running request's next token, from the logits of one forward pass of codefleet's engine.

The batch is drawn at once (`sampling.sample_next`: the model's own logprob of each token, temperature and
top-k/top-p choosing it); a request with a tool-call grammar (`SamplingParams.tools`) then has a token the
grammar refuses drawn again from what it allows (`grammar.constrained_sample`), its logprob still the model's
own. Each token is recorded with the policy version that sampled it and the top logprobs asked for, streamed
to the request's `on_token`, and the request's stop conditions checked. Rows are drawn in batch order, so a
request's random draws are the same alone or in any batch."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from codefleet.inference.grammar import constrained_sample
from codefleet.inference.request import Request, top_logprobs
from codefleet.inference.sampling import sample_next

log = logging.getLogger(__name__)


def sample_next_tokens(
    seqs: list[Request], logits_BV: torch.Tensor, version: int, tokenizer, default_generator: torch.Generator
) -> None:
    """Sample and record the next token of each of `seqs` (row b of `logits_BV` is seqs[b]'s) at policy
    `version`; `tokenizer` decodes stop strings, `default_generator` draws for requests without a seed."""
    tokens_B, logprobs_B = sample_next(
        logits_BV, [s.params for s in seqs], [s.generator for s in seqs], default_generator
    )
    tokens, logprobs = tokens_B.tolist(), logprobs_B.tolist()
    tops = top_logprobs(seqs, logits_BV)
    for i, s in enumerate(seqs):
        if s.matcher is None:
            continue
        tok, refused = constrained_sample(s.matcher, logits_BV[i], tokens[i], _resampler(s, default_generator))
        if refused:
            s.refused += 1
            tokens[i] = tok
            logprobs[i] = torch.log_softmax(logits_BV[i].float(), dim=-1)[tok].item()  # the model's own
        s.matcher.advance(tok)
    for s, tok, lp, top in zip(seqs, tokens, logprobs, tops):
        s.tokens.append(tok)
        s.logprobs.append(lp)
        s.versions.append(version)
        if s.params.top_logprobs:
            s.top_logprobs.append(top)
        if s.on_token is not None:
            try:
                s.on_token(tok, lp, top)
            except Exception:  # a broken stream must not stop the batch
                log.exception("on_token callback failed")
        s.check_finished(tokenizer)


def _resampler(s: Request, default_generator: torch.Generator) -> Callable[[torch.Tensor], int]:
    """How the grammar draws `s`'s token again: the same sampling, from `s`'s own generator."""

    def draw(logits_V: torch.Tensor) -> int:
        return int(sample_next(logits_V[None], [s.params], [s.generator], default_generator)[0][0])

    return draw
