"""The exact token sequence of one episode, built turn by turn (token-in, token-out).

RL trains on the tokens the engine sampled, never on a re-tokenization of
their text: a model can sample a token sequence that is not the canonical
encoding of its own text, and re-encoding would then train on tokens it
never produced (and with logprobs that belong to other tokens). So the
sequence grows like this:

    turn 0 prompt   = encode_chat(messages_0)                 (mask 0)
    turn 0 output   = the sampled ids, the end token included   (mask 1, logprobs, versions)
    turn 1 prompt   = everything above + continuation           (tool results, corrections, the
                                                                 next generation prompt; mask 0)
    ...

The continuation is what the checkpoint's chat format (`formats.of(tokenizer)`) renders for the
messages appended since the last assistant message (`ChatFormat.continuation`: codefleet's template
pieces, or a Hugging Face template's text after the turn's end token); the assistant message itself
is *not* re-rendered, its sampled ids stand for it. The engine is given exactly this sequence as each
turn's prompt, so the trajectory's tokens are the tokens the model saw, also where the template would
render an earlier turn differently (e.g. without its reasoning; `formats`'s docstring).

Routing for replay (R3): a generated token keeps the experts it was routed
to when the engine processed it; a prompt token keeps the routing of the
prefill that first processed it (later turns re-prefill the whole prefix,
possibly under newer weights; the first record is the one under which the
following sampled tokens were conditioned in that turn).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from codefleet.chat import formats
from codefleet.types import TokenSequence


class SequenceBroken(RuntimeError):
    """The conversation was edited, not appended to; the exact sequence cannot continue."""


@dataclass
class EpisodeTokens:
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)  # 1 on the tokens the policy sampled
    logprobs: list[float] = field(default_factory=list)  # engine logprob on sampled tokens, 0 elsewhere
    versions: list[int] = field(default_factory=list)  # policy version per sampled token, -1 elsewhere
    routing: list[list[int]] = field(default_factory=list)  # per token: experts, layer-major (may be empty)
    n_messages: int = 0  # messages covered by `ids` (through the last assistant turn)
    turn_ends: list[int] = field(default_factory=list)  # len(ids) after each turn

    def prompt(self, tokenizer, messages: list[dict], tools: list[dict]) -> list[int]:
        """The ids to send for the next turn: the exact sequence so far plus the new messages' pieces."""

        fmt = formats.of(tokenizer)
        if not self.ids:
            return fmt.encode_chat(tokenizer, messages, tools)
        if len(messages) <= self.n_messages or messages[self.n_messages - 1].get("role") != "assistant":
            raise SequenceBroken(
                f"the conversation has {len(messages)} messages, expected more than "
                f"{self.n_messages} ending the last turn with the assistant's message"
            )
        return self.ids + fmt.continuation(tokenizer, messages, self.n_messages, tools)

    def add_turn(self, prompt: list[int], result, n_messages: int, end_id: int) -> None:
        """Record a finished turn: `prompt` as sent, the engine's Result, the conversation length after
        the assistant's message is appended. A turn cut by max_tokens gets the template's end token
        (`end_id`) appended (mask 0: the policy did not sample it)."""
        n_old = len(self.ids)
        if prompt[:n_old] != self.ids:
            raise SequenceBroken("the prompt does not extend the episode's token sequence")
        fresh = prompt[n_old:]
        prompt_routing = [flat(r) for r in (result.prompt_routed_experts or [])]
        if len(prompt_routing) != len(prompt):
            prompt_routing = []
        for i in range(n_old if prompt_routing else 0):  # e.g. an `<|end|>` we appended: first seen now
            if not self.routing[i]:
                self.routing[i] = prompt_routing[i]
        self._extend(fresh, [0] * len(fresh), [0.0] * len(fresh), [-1] * len(fresh), prompt_routing[n_old:])
        routing = [flat(r) for r in (result.routed_experts or [])]
        n = len(result.token_ids)
        self._extend(
            list(result.token_ids),
            [1] * n,
            list(result.logprobs),
            list(result.versions),
            routing if len(routing) == n else [],
        )
        if not result.token_ids or result.token_ids[-1] != end_id:
            self._extend([end_id], [0], [0.0], [-1], [])
        self.n_messages = n_messages
        self.turn_ends.append(len(self.ids))

    def _extend(self, ids, mask, logprobs, versions, routing) -> None:
        self.ids += ids
        self.mask += mask
        self.logprobs += logprobs
        self.versions += versions
        self.routing += routing if routing else [[] for _ in ids]

    def routed_experts(self) -> list[list[int]] | None:
        """Per-token routing for replay, or None when some token has no record. A final `<|end|>` that no
        pass has processed yet takes the previous token's routing: no prediction depends on it."""
        routing = list(self.routing)
        if len(routing) > 1 and not routing[-1]:
            routing[-1] = routing[-2]
        return routing if routing and all(routing) else None

    def sequence(self) -> TokenSequence:
        """The episode's tokens as the value a Trajectory carries (`Trajectory.sequence`)."""
        return TokenSequence(
            list(self.ids), list(self.mask), list(self.logprobs), list(self.versions), self.routed_experts()
        )


def flat(per_layer: list[list[int]]) -> list[int]:
    return [e for layer in per_layer for e in layer]
