"""The contracts every backend implements, and the registries that choose a backend by name.

codefleet's layers meet at these Protocols: a caller holds a `Sandbox`, a `Policy`, an `Engine`, a
`Trainer`, a `Judge` or a `TaskSource` and never asks which implementation it got. Each docstring says
what a backend must guarantee; the data crossing them are the plain types of `codefleet.types`.

A backend is chosen by name from a `Registry`:

    SANDBOXES.register("namespace", NamespaceSandbox)   # in the backend's package
    sandbox = SANDBOXES.get(config.backend)(repo, config)

The registries here are filled by the packages that own the backends (`codefleet.sandbox` its
sandboxes, `codefleet.model` the codefleet engine, `codefleet.rl` the trainer), so a new backend (a
microVM sandbox, a vLLM engine, a sharded trainer) plugs in by registering a name, without touching its
callers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from codefleet.types import ExecResult, FileEntry, PolicyOutput, SandboxInfo, SearchMatch, Task

T = TypeVar("T")


class Registry(Generic[T]):
    """Backends of one kind by name. `get` of an unknown name is a ValueError naming the known ones."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str, entry: T) -> T:
        if name in self._entries and self._entries[name] is not entry:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._entries))}") from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries


@runtime_checkable
class Sandbox(Protocol):
    """An isolated, stateful machine over a copy-on-write copy of one repository.

    A backend guarantees: `exec` runs in one persistent shell (cwd and environment persist between calls)
    and returns within its timeout, with output capped (`ExecResult.truncated`); nothing a command does
    reaches the host's files, processes or network beyond what the backend documents; paths are relative
    to the workspace (absolute ones under /workspace are accepted) and never escape it (`PathEscapeError`);
    `fork(n)` gives n independent copies of the current state; `close()` is idempotent and leaves nothing
    behind (mounts, processes, cgroups). A sandbox that died raises `SandboxDeadError` and can be replaced.
    """

    id: str
    info: SandboxInfo

    def exec(self, command: str, timeout_s: float | None = None) -> ExecResult:
        """Run `command` in the persistent shell (cwd/env persist)."""
        ...

    def run_oneoff(self, argv: list[str], timeout_s: float | None = None) -> ExecResult:
        """Run argv in a fresh process over the same workspace, outside the shell."""
        ...

    def read_file(self, path: str, start_line: int | None = None, end_line: int | None = None) -> str: ...

    def write_file(self, path: str, content: str | bytes) -> None: ...

    def list_dir(self, path: str = ".", recursive: bool = False) -> list[FileEntry]: ...

    def search(self, pattern: str, path: str = ".", max_matches: int = 200) -> list[SearchMatch]: ...

    def fork(self, n: int) -> list[Sandbox]: ...

    def alive(self) -> bool: ...

    def close(self) -> None: ...


@runtime_checkable
class ExactBytes(Protocol):
    """A sandbox that also gives a file's exact bytes, as read_file would find them (same path checks, same
    size cap). The shell backends (namespace, local) do; a sandbox without it gives text only, where bytes
    that are not UTF-8 read as \ufffd."""

    def read_bytes(self, path: str) -> bytes: ...


@runtime_checkable
class Policy(Protocol):
    """A model that writes assistant turns.

    A backend guarantees: `generate` returns one turn for the conversation, its tool calls parsed (a
    malformed call is kept with its error, never raised); it is safe to call from several threads at once
    (parallel attempts share one policy); a failure of the endpoint raises an exception whose class
    attribute `failure` (codefleet.types.Failure) says what failed. For RL, the turn carries the exact
    token ids the model sampled, their logprobs, the policy version of each and (MoE) the routed experts.
    """

    name: str

    def generate(self, messages: list[dict], tools: list[dict]) -> PolicyOutput:
        """One assistant turn for `messages`, allowed to call `tools` (OpenAI function schemas)."""
        ...


class Generation(Protocol):
    """One finished request of an Engine: the tokens it sampled and what RL needs to train on them."""

    prompt_token_ids: list[int]
    token_ids: list[int]  # sampled, the stop token included
    logprobs: list[float]  # the sampling logprob of each sampled token
    versions: list[int]  # the policy version that sampled each token
    routed_experts: list  # [token][moe layer][top_k]; empty for a dense model
    finish_reason: str  # "stop" | "length"


@runtime_checkable
class Engine(Protocol):
    """Batched generation from token ids, serving one policy whose weights change while it runs.

    A backend guarantees: token-in, token-out (the ids a caller sends are the prompt, never re-tokenized
    text); every sampled token reports its logprob and the policy version that produced it; an MoE engine
    reports each token's routed experts for routing replay; `update_weights` swaps the weights between
    steps (requests in flight continue on the new version, and cached prefixes computed under the old
    weights are dropped) and `version` is the version now served; `pause_s` is how long the last update kept
    steps from running.
    """

    version: int
    pause_s: float

    def generate(self, prompts: list[list[int]], params: Any = None) -> list[Generation]:
        """Generate a completion for each prompt (token ids), under `params` (one, or one per prompt)."""
        ...

    def update_weights(self, state_dict: dict, version: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class Trainer(Protocol):
    """One worker's share of training: the Tinker API shape.

    A backend guarantees: `forward_backward` accumulates the gradients of `batch` under `loss` ("sft": SFT
    examples; "rl": RL samples with advantages) and returns its metrics, and may be called several times
    before one `optim_step`, which applies them and returns the step's metrics; `save(path)` then `load`
    resumes bit for bit (weights, optimizer, step). Sharded backends keep this API on every rank.
    """

    def forward_backward(self, batch: list, loss: str, total_tokens: int | None = None) -> dict[str, float]: ...

    def optim_step(self) -> dict[str, float]: ...

    def save(self, path: str) -> None: ...


@runtime_checkable
class Judge(Protocol):
    """Scores a batch of rollouts (rows of the rollout store, as a pyarrow Table).

    A backend guarantees: it returns the batch with the judge's columns appended (score, reason, error per
    row); a row it cannot judge gets its error set, never an exception that loses the batch.
    """

    def __call__(self, batch: Any) -> Any: ...


@runtime_checkable
class TaskSource(Protocol):
    """Where coding tasks come from: generated families, a task directory, an imported benchmark.

    A backend guarantees: each Task is valid (codefleet.tasks.spec.validate_task) and its hidden checks
    and reference patch stay outside the agent's sandbox.
    """

    def __iter__(self) -> Iterator[Task]: ...


# name -> a factory: (repo, SandboxConfig) -> Sandbox
SANDBOXES: Registry[Callable[..., Sandbox]] = Registry("sandbox backend")
# name -> a loader: (checkpoint_dir, max_batch=..., max_seq_len=..., **options) -> Engine
ENGINES: Registry[Callable[..., Engine]] = Registry("engine backend")
# name -> a Trainer class with `Trainer(model, config, device=...)` and `Trainer.load(path, config, device=...)`
TRAINERS: Registry[Any] = Registry("trainer backend")
