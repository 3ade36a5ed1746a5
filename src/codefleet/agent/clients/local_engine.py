"""A Policy backed by codefleet's own inference engine, in process.

    policy = LocalEnginePolicy("runs/ckpt")            # or build_policy("local:runs/ckpt")
    policy = LocalEnginePolicy(engine=engine)           # share a running engine (RL workers)

Token-in, token-out: the messages are rendered with the checkpoint's chat
format (`formats.of(tokenizer)`: codefleet's template, or a Hugging Face
checkpoint's own), the engine generates, and the turn comes back with the
exact sampled token ids (the turn's end token included), the model's logprob
of each, the policy version that sampled each and the routed experts of each
(`routed_experts[i]` is token i's experts, layer-major: the `top_k` experts of
MoE layer 0, then layer 1, ...). The text is parsed with
the format's tool-call parser (`tool_parser`); a malformed tool-call block becomes a ToolCall with
its `error` set, so the loop tells the model what was wrong instead of ending
the episode.

With `tool_grammar=True` the engine samples only tool calls that parse and fit
their tools' schemas (`codefleet.inference.grammar`): the turn's tools, or the
harness's own (`agent.tools.tool_schemas`) when the prompt shows none (a policy
trained on the bare prompt). `tool_choice="required"` also makes every turn
call a tool.

For RL, `for_episode()` gives a per-episode policy whose `.tokens` (episode_tokens.EpisodeTokens)
is the episode's exact token sequence: each turn's prompt extends the ids sampled before, never a
re-tokenization of their text.

Thread-safe: parallel attempts call `generate` at once and the engine's
background thread batches their turns into the same decode steps.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from codefleet.agent.clients.episode_tokens import EpisodeTokens, SequenceBroken, flat
from codefleet.agent.policy import PolicyError, parse_tool_call
from codefleet.agent.tools import tool_schemas
from codefleet.chat import formats
from codefleet.inference.engine import Engine
from codefleet.inference.sampling import SamplingParams
from codefleet.types import PolicyOutput, ToolCall


class LocalEngineUnavailableError(NotImplementedError):
    """No local engine can be built from what was given (kept for callers that catch it)."""


class LocalEnginePolicy:
    """A Policy over an in-process `codefleet.inference.engine.Engine`."""

    def __init__(
        self,
        checkpoint: str = "",
        engine=None,
        tokenizer=None,
        max_tokens: int = 1024,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        max_batch: int = 16,
        max_seq_len: int | None = None,
        name: str = "",
        tool_grammar: bool = False,
        tool_choice: str = "auto",
    ):
        if engine is None:
            if not checkpoint:
                raise LocalEngineUnavailableError(
                    "the local engine needs a checkpoint: use `local:DIR` (a directory written by "
                    "codefleet.model.checkpoint.save), or pass engine= to share a running engine"
                )

            engine = Engine.load(checkpoint, max_batch=max_batch, max_seq_len=max_seq_len)
        self.engine = engine
        self.tokenizer = tokenizer or engine.tokenizer
        if self.tokenizer is None:
            raise ValueError("the engine has no tokenizer; pass tokenizer= (codefleet.chat.tokenizer)")
        self.name = name or (f"local:{checkpoint}" if checkpoint else "local")
        self._chat = formats.of(self.tokenizer)
        self.params = SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop_token_ids=self._chat.stop_ids(self.tokenizer),
            tool_choice=tool_choice,
        )
        self.tool_grammar = tool_grammar
        self.params.validate()
        self._seeds = itertools.count(seed) if seed is not None else None
        self._turns = itertools.count()

    def for_episode(self) -> EpisodePolicy:
        """A policy for one episode that keeps its exact token sequence (`.tokens`), for RL."""
        return EpisodePolicy(self)

    def generate(self, messages: list[dict], tools: list[dict]) -> PolicyOutput:
        try:
            prompt = self._chat.encode_chat(self.tokenizer, messages, tools)
        except (ValueError, KeyError) as e:
            raise PolicyError(f"the messages could not be rendered with the chat template: {e}") from e
        return self.turn(prompt, tools)[1]

    def turn(self, prompt: list[int], tools: list[dict] | None = None):
        """Generate one assistant turn for the token ids `prompt` (`tools`: what its calls may call, for the
        tool grammar): the engine's Result and the PolicyOutput."""
        room = self.engine.max_seq_len - len(prompt)
        if room < 1:
            raise PolicyError(
                f"the conversation has {len(prompt)} tokens, over the local model's context of "
                f"{self.engine.max_seq_len}; shorten tool outputs or raise max_seq_len"
            )
        params = replace(
            self.params,
            max_tokens=min(self.params.max_tokens, room),
            seed=next(self._seeds) if self._seeds is not None else None,
            tools=(tools or _harness_tools()) if self.tool_grammar else None,
        )
        try:
            result = self.engine.submit(prompt, params).result()
        except Exception as e:
            raise PolicyError(f"the local engine failed to generate: {type(e).__name__}: {e}") from e
        turn = next(self._turns)
        parsed = self._chat.parse_tool_calls(result.text, id_prefix=f"call_{turn}_")
        calls = [parse_tool_call(c["id"], c["name"], c["arguments_json"]) for c in parsed.tool_calls]
        calls += [ToolCall(f"call_{turn}_bad{i}", "", "", error=msg) for i, msg in enumerate(parsed.errors)]
        finish = result.finish_reason
        if calls and finish == "stop":
            finish = "tool_calls"
        return result, PolicyOutput(
            text=parsed.content,
            tool_calls=calls,
            prompt_tokens=len(prompt),
            completion_tokens=len(result.token_ids),
            model=self.name,
            finish_reason=finish,
            token_ids=list(result.token_ids),
            logprobs=list(result.logprobs),
            policy_versions=list(result.versions),
            routed_experts=[flat(token) for token in result.routed_experts],
        )


class EpisodePolicy:
    """One episode's view of a LocalEnginePolicy: each turn's prompt extends the exact token sequence
    of the turns before (episode_tokens.py), so `tokens` is what the trainer trains on. One per episode;
    not shared between threads."""

    def __init__(self, base: LocalEnginePolicy):
        self.base, self.name = base, base.name
        self.tokens = EpisodeTokens()
        self._end_id = base._chat.stop_ids(base.tokenizer)[0]

    def generate(self, messages: list[dict], tools: list[dict]) -> PolicyOutput:
        try:
            prompt = self.tokens.prompt(self.base.tokenizer, messages, tools)
        except (ValueError, KeyError, SequenceBroken) as e:
            raise PolicyError(f"the messages could not be rendered with the chat template: {e}") from e
        result, output = self.base.turn(prompt, tools)
        self.tokens.add_turn(prompt, result, len(messages) + 1, self._end_id)
        return output


TOOL_GRAMMARS = ("off", "auto", "required")  # model.tool_grammar, --tool-grammar


def grammar_options(tool_grammar: str) -> dict:
    """LocalEnginePolicy's options for a config's `tool_grammar`: "off", "auto" or "required"."""
    if tool_grammar not in TOOL_GRAMMARS:
        raise ValueError(f"tool_grammar must be off, auto or required, got {tool_grammar!r}")
    return {"tool_grammar": tool_grammar != "off", "tool_choice": "required" if tool_grammar == "required" else "auto"}


def _harness_tools() -> list[dict]:
    return tool_schemas()
