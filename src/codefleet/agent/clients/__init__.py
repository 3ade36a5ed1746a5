"""Model backends behind the Policy contract, chosen by name.

- an `http://` or `https://` URL: an OpenAI-compatible endpoint (openai_http.py)
- `local` or `local:CHECKPOINT`: codefleet's own engine (local_engine.py: the in-process engine over a checkpoint)
- the scripted expert (scripted.py) is built from a Task, for demonstrations and tests
"""

from __future__ import annotations

from codefleet.agent.clients.local_engine import LocalEnginePolicy, LocalEngineUnavailableError
from codefleet.agent.clients.openai_http import OpenAIConfig, OpenAIPolicy
from codefleet.contracts import Policy


def build_policy(spec: str, model_name: str = "", **options: object) -> Policy:
    """A policy for `spec`: an OpenAI-compatible base URL, or `local[:CHECKPOINT]`."""
    if spec.startswith(("http://", "https://")):
        return OpenAIPolicy(OpenAIConfig(base_url=spec, model=model_name, **options))  # type: ignore[arg-type]
    if spec == "local" or spec.startswith("local:"):
        return LocalEnginePolicy(spec.partition(":")[2], **options)
    raise ValueError(
        f"unknown model {spec!r}: give an OpenAI-compatible base URL such as "
        "http://localhost:8000/v1, or `local` for codefleet's own engine"
    )


__all__ = ["LocalEnginePolicy", "LocalEngineUnavailableError", "OpenAIConfig", "OpenAIPolicy", "build_policy"]
