"""`CopyConfig`, how the model copies tokens from its context (`ModelConfig.copy`; the parts it shapes are in
`copying.py`). It lives apart from them so that a run's configuration loads without torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

_SCOPES = ("all", "prompt")


@dataclass
class CopyConfig:
    """How the model copies from its context (`ModelConfig.copy`).

    `prev_tokens`: K, the previous tokens whose embeddings join each token's
    input (0-8; 0 = the plain Llama/Qwen input). `CopyConfig(prev_tokens=0)`
    is the plain Llama/Qwen model.

    `head`: the pointer-generator output (`CopyHead`). Off by default (the
    plain output); `codefleet train` turns it on (`model.copy.head`). The
    fields below shape it and do nothing without it:

    - `scope`: which positions it may point at. "all": every earlier position,
      the model's own output included. "prompt": only the tokens before the
      current assistant turn (the prompt the engine was given), so the pointer
      cannot follow its own output around a loop (`to X to X to X ...`); names
      are copied from the task and tool results, where they come from.
      Training then needs the turns' mask (`Transformer.forward(turn_mask_BT=...)`),
      the engine passes each request's prompt length.
    - `match`: the score of context position s also adds
      `w1 [x_{s-1} = x_t] + w2 [x_{s-1} = x_t and x_{s-2} = x_{t-1}]` (two
      learned scalars): a position whose preceding tokens are the ones just
      written is where a copy continues, a lookup as in prompt-lookup decoding
      (a tiny model that learns it by attention alone continues `fee_for` with
      the wrong piece).
    - `blocked`: token ids it never points at (a query whose context holds
      nothing else sees them all), so they come from the LM head alone: e.g.
      the tokens that hold quotes, backticks, brackets, commas or colons
      (`Tokenizer.ids_containing`), so that a copy that runs on past a name's
      end (`app.py"}}`) stops where the name does.
    """

    prev_tokens: int = 2  # previous tokens whose embeddings join each token's input (0-8; 0 = plain input)
    head: bool = False  # the pointer-generator output: the model may copy a token from its context
    scope: str = "all"  # where the copy head may point: "all" earlier positions, or "prompt" (before this turn)
    match: bool = False  # the copy head also scores positions whose preceding tokens match the last ones written
    blocked: list[int] = dataclasses.field(default_factory=list)  # token ids the copy head never points at

    def __post_init__(self) -> None:
        if not (isinstance(self.prev_tokens, int) and 0 <= self.prev_tokens <= 8):
            raise ValueError(f"CopyConfig: prev_tokens must be an integer in [0, 8], got {self.prev_tokens!r}")
        if self.scope not in _SCOPES:
            raise ValueError(f"CopyConfig: scope must be 'all' or 'prompt', got {self.scope!r}")
