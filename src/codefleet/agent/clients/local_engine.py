"""The seam for codefleet's own inference engine (the MoE policy).

The local engine arrives with the model issue (package `codefleet.model`):
batched generation that returns the exact sampled token ids, their logprobs,
the policy version per token and the routed experts — everything
PolicyOutput has room for. Until then this class exists so that callers can
be written against it, and it refuses to pretend: constructing it raises.
"""

from __future__ import annotations

from codefleet.agent.policy import PolicyOutput


class LocalEngineUnavailableError(NotImplementedError):
    """The local inference engine is not part of this build yet."""


class LocalEnginePolicy:
    """A Policy backed by an in-process codefleet inference engine (not yet available)."""

    name = "local"

    def __init__(self, checkpoint: str = "", **engine_options: object):
        raise LocalEngineUnavailableError(
            "the local inference engine arrives with the model issue (codefleet.model) and is not available yet; "
            "serve a model behind an OpenAI-compatible endpoint (vLLM, SGLang, Ollama) and pass its URL, e.g. "
            "--model http://localhost:8000/v1")

    def generate(self, messages: list[dict], tools: list[dict]) -> PolicyOutput:  # pragma: no cover - seam
        raise LocalEngineUnavailableError("the local inference engine is not available yet")
