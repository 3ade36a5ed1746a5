"""A Policy over any OpenAI-compatible chat-completions endpoint.

vLLM, SGLang, Ollama, llama.cpp's server, OpenAI itself: anything that
serves `POST {base_url}/chat/completions` with `tools` and answers with
(parallel) `tool_calls`. The `openai` package does the HTTP work: a timeout
per request and retries with exponential backoff on connection errors, 408,
409, 429 and 5xx (honouring Retry-After). What still fails after the retries
becomes a PolicyError whose message names the URL and what to check.

The model name is optional: without one, the first model the endpoint lists
(`GET {base_url}/models`) is used, which is what a single-model vLLM or
SGLang server wants.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

import openai

from codefleet.agent.policy import OutOfTime, PolicyError, parse_tool_call
from codefleet.types import PolicyOutput


@dataclass
class OpenAIConfig:
    base_url: str  # e.g. http://localhost:8000/v1
    model: str = ""  # empty: the first model the endpoint lists
    api_key: str = ""  # empty: $OPENAI_API_KEY, else a placeholder local servers accept
    timeout_s: float = 300.0  # per request
    max_retries: int = 3
    temperature: float | None = None
    max_tokens: int | None = None  # per turn
    parallel_tool_calls: bool = True  # False asks the server for at most one call per turn
    logprobs: bool = False  # ask for sampled-token logprobs (for RL analysis)
    deadline: float | None = None  # time.monotonic() by which requests must end: caps each one's timeout


_TOOLS_HINT = (
    "if it is about tools, enable tool calling on the server (vLLM: --enable-auto-tool-choice "
    "--tool-call-parser NAME; SGLang: --tool-call-parser NAME; Ollama: use a model with tool support)"
)


class OpenAIPolicy:
    """Thread-safe: one client serves many concurrent episodes."""

    def __init__(self, config: OpenAIConfig | str):
        self.config = OpenAIConfig(config) if isinstance(config, str) else config
        self.url = self.config.base_url.rstrip("/")
        api_key = self.config.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client = openai.OpenAI(
            base_url=self.url, api_key=api_key, timeout=self.config.timeout_s, max_retries=self.config.max_retries
        )
        self._model = self.config.model
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self._model or f"(first model of {self.url})"

    def model_name(self) -> str:
        """The model to ask for, discovered from GET /models when not configured."""
        with self._lock:
            if not self._model:
                try:
                    models = list(self.client.models.list())
                except openai.OpenAIError as e:
                    raise self._explain(e, "GET /models") from e
                if not models:
                    raise PolicyError(
                        f"the model endpoint {self.url} lists no models; start the server with a "
                        "model or pass the model name (--model-name)"
                    )
                self._model = models[0].id
            return self._model

    def generate(self, messages: list[dict], tools: list[dict]) -> PolicyOutput:
        kwargs: dict = {"model": self.model_name(), "messages": messages}
        if tools:
            kwargs["tools"] = tools
            if not self.config.parallel_tool_calls:
                kwargs["parallel_tool_calls"] = False
        if self.config.temperature is not None:
            kwargs["temperature"] = self.config.temperature
        if self.config.max_tokens is not None:
            kwargs["max_tokens"] = self.config.max_tokens
        if self.config.logprobs:
            kwargs["logprobs"] = True
        if self.config.deadline is not None:
            left_s = self.config.deadline - time.monotonic()
            if left_s <= 0:
                raise OutOfTime(
                    f"the wall-clock budget ran out before the request to {self.url}; raise the "
                    "budget (--max-wall-s) to give the model more time"
                )
            kwargs["timeout"] = min(self.config.timeout_s, left_s)
        try:
            response = self.client.chat.completions.create(**kwargs)
        except openai.APITimeoutError as e:
            if "timeout" in kwargs and kwargs["timeout"] < self.config.timeout_s:
                raise OutOfTime(
                    f"the wall-clock budget ran out while {self.url} was answering; raise the budget "
                    "(--max-wall-s) to give the model more time"
                ) from e
            raise self._explain(e, "POST /chat/completions") from e
        except openai.OpenAIError as e:
            raise self._explain(e, "POST /chat/completions") from e
        choices = getattr(response, "choices", None)
        if not choices or not isinstance(choices, list):
            raise PolicyError(
                f"the model endpoint {self.url} answered without a list of choices "
                f"({str(response)[:200]}); check that it speaks the OpenAI chat-completions protocol"
            )
        choice = choices[0]
        message = getattr(choice, "message", None)
        if message is None:
            raise PolicyError(
                f"the model endpoint {self.url} answered a choice without a message "
                f"({str(choice)[:200]}); check that it speaks the OpenAI chat-completions protocol"
            )
        calls = []
        for tc in message.tool_calls or []:
            function = getattr(tc, "function", None)
            calls.append(
                parse_tool_call(
                    getattr(tc, "id", "") or "", getattr(function, "name", "") or "", getattr(function, "arguments", "")
                )
            )
        usage = response.usage
        logprobs = None
        if self.config.logprobs and choice.logprobs is not None and choice.logprobs.content:
            logprobs = [t.logprob for t in choice.logprobs.content]
        return PolicyOutput(
            text=_text(message.content),
            tool_calls=calls,
            prompt_tokens=_count(getattr(usage, "prompt_tokens", 0)),
            completion_tokens=_count(getattr(usage, "completion_tokens", 0)),
            model=response.model or self._model,
            finish_reason=choice.finish_reason or "",
            logprobs=logprobs,
        )

    def _explain(self, e: openai.OpenAIError, what: str) -> PolicyError:
        """One sentence naming the URL, the problem and what to check."""
        url, retries = self.url, self.config.max_retries
        if isinstance(e, openai.APITimeoutError):
            return PolicyError(
                f"the model endpoint {url} did not answer {what} within {self.config.timeout_s:g} s "
                f"(tried {retries + 1} times); check that the server is up and not overloaded, or "
                "raise the timeout"
            )
        if isinstance(e, openai.APIConnectionError):
            return PolicyError(
                f"could not connect to the model endpoint {url} ({what}, tried {retries + 1} times: "
                f"{e.__cause__ or e}); check that the server is running and that the URL is its "
                "OpenAI-compatible base, e.g. http://localhost:8000/v1"
            )
        if isinstance(e, openai.NotFoundError):
            return PolicyError(
                f"the model endpoint {url} answered 404 to {what}: {_detail(e)}; check that the URL "
                f"ends with /v1 and that the model {self._model!r} is served (GET {url}/models "
                "lists them)"
            )
        if isinstance(e, openai.AuthenticationError | openai.PermissionDeniedError):
            return PolicyError(
                f"the model endpoint {url} refused the API key ({e.status_code}); set "
                "OPENAI_API_KEY to a key it accepts"
            )
        if isinstance(e, openai.BadRequestError):
            return PolicyError(
                f"the model endpoint {url} rejected the request (400 to {what}): {_detail(e)}; " + _TOOLS_HINT
            )
        if isinstance(e, openai.APIStatusError):
            return PolicyError(
                f"the model endpoint {url} answered HTTP {e.status_code} to {what} after "
                f"{retries} retries: {_detail(e)}; check the server's log"
            )
        return PolicyError(f"the model endpoint {url} failed on {what}: {type(e).__name__}: {e}")


def _text(content: object) -> str:
    """The message's text: a string, or the text parts of a list of content parts joined (some servers
    answer `[{"type": "text", "text": "..."}]`)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text") if isinstance(part, dict) else getattr(part, "text", None) for part in content]
        return "".join(part for part in parts if isinstance(part, str))
    return ""


def _count(value: object) -> int:
    """A token count as the server sent it (an int, a numeric string, or nothing), as an int."""
    try:
        return max(int(value or 0), 0)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 0


def _detail(e: openai.APIStatusError) -> str:
    body = e.body
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict):
            return str(inner.get("message", inner))[:300]
        return str(inner)[:300]
    return str(e.message)[:300]
