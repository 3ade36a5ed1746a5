"""The contracts every backend implements, and the registries that choose a backend by name.

codefleet's layers meet at these Protocols: a caller holds a `Sandbox`, a `Policy`, an `Engine`, a
`Trainer`, a `Judge` or a `TaskSource` and never asks which implementation it got. Each docstring says
what a backend must guarantee; the data crossing them are the plain types of `codefleet.types`.

A backend is chosen by name from a `Registry`:

    sandbox = SANDBOXES.get(config.backend)(repo, config)
    if not SANDBOXES.get(name).isolated: ...          # a capability the backend declares

The registries load the backends themselves, so no caller has to import a backend's module first. The
built-in backends are one line each below (`name: "module:attribute"`), imported on first `get`; a
package installed beside codefleet adds its own through a Python entry point in the registry's group
(`codefleet.sandboxes`, `codefleet.engines`, `codefleet.trainers`), e.g. in its pyproject.toml:

    [project.entry-points."codefleet.sandboxes"]
    firecracker = "codefleet_firecracker:FirecrackerSandbox"

`names()` lists both without importing either, so a command's `--help` stays fast. What a caller may ask
of a backend beyond its Protocol is a capability flag the backend declares as a class attribute (a
sandbox's `isolated`, an engine's `tool_grammar`, a trainer's `sharded`; each registry's comment lists
them), never its name or its base class.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from importlib import metadata
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

from codefleet.types import ExecResult, FileEntry, PolicyOutput, SandboxInfo, SearchMatch, Task

T = TypeVar("T")


class Registry(Generic[T]):
    """Backends of one kind by name: the built-in ones (`builtins`, name -> "module:attribute", imported on
    first `get`), the ones other packages declare as entry points of `group`, and any `register`ed in this
    process. `get` of an unknown name is a ValueError naming the known ones."""

    def __init__(self, kind: str, group: str | None = None, builtins: dict[str, str] | None = None):
        self.kind = kind
        self.group = group
        self._builtins = dict(builtins or {})
        self._entries: dict[str, T] = {}
        self._plugins: dict[str, metadata.EntryPoint] | None = None  # read once, on first use

    def register(self, name: str, entry: T) -> T:
        if name in self._builtins or (name in self._entries and self._entries[name] is not entry):
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> T:
        if name in self._entries:
            return self._entries[name]
        if name in self._builtins:
            if name in self.plugins():
                raise ValueError(
                    f"{self.kind} {name!r} is built into codefleet and also declared by the package "
                    f"{_dist(self.plugins()[name])}; uninstall that package or give its backend "
                    "another name"
                )
            module, _, attribute = self._builtins[name].partition(":")
            entry = getattr(importlib.import_module(module), attribute)
        elif name in self.plugins():
            point = self.plugins()[name]
            try:
                entry = point.load()
            except (ImportError, AttributeError) as e:
                raise ImportError(
                    f"{self.kind} {name!r} (entry point {point.value!r} of the package "
                    f"{_dist(point)}) could not be loaded: {e}; reinstall that package"
                ) from e
        else:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        self._entries[name] = entry
        return entry

    def names(self) -> list[str]:
        """Every name `get` takes, without importing any backend."""
        return sorted({*self._builtins, *self.plugins(), *self._entries})

    def plugins(self) -> dict[str, metadata.EntryPoint]:
        """The entry points other installed packages declare in this registry's group, by name."""
        if self._plugins is None:
            found = metadata.entry_points(group=self.group) if self.group else ()
            self._plugins = {point.name: point for point in found}
        return self._plugins

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.names()


def _dist(point: metadata.EntryPoint) -> str:
    return repr(point.dist.name) if point.dist is not None else "that declares it"


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


# name -> a Sandbox class built as `Backend(repo, config)` (repo a directory or None, config a SandboxConfig). It
# declares, as class attributes: `isolated` (commands cannot reach the host's files, processes or network),
# `environments` (it runs an image's userland, SandboxConfig.environment), `host_binds` (it can bind host paths,
# SandboxConfig.ro_binds, e.g. a virtual environment).
SANDBOXES: Registry[Any] = Registry(
    "sandbox backend",
    "codefleet.sandboxes",
    {
        "namespace": "codefleet.sandbox.namespace:NamespaceSandbox",
        "vm": "codefleet.sandbox.vm:VMSandbox",
        "local": "codefleet.sandbox.local:LocalSandbox",
    },
)
# name -> an Engine class with `Backend.load(checkpoint_dir, max_batch=..., max_seq_len=..., **options) -> Engine`.
# It declares: `tool_grammar` (it samples only tool calls that fit their schemas, SamplingParams.tools), `gpu` (it
# can run on a GPU), `serve_options` (the `load` options for serving and agent runs, which need no routed experts),
# `omp_threads_from_env` (each thread that steps it takes its OpenMP thread count from OMP_NUM_THREADS).
ENGINES: Registry[Any] = Registry(
    "engine backend",
    "codefleet.engines",
    {"codefleet": "codefleet.inference.engine:Engine", "vllm": "codefleet.inference.vllm_engine:VLLMEngine"},
)
# name -> a Trainer class with `Trainer(model, config, device=...)` and `Trainer.load(path, config, device=...)`. It
# declares `sharded` (every rank holds a shard: all ranks build, save and load it together).
TRAINERS: Registry[Any] = Registry(
    "trainer backend",
    "codefleet.trainers",
    {
        "dp": "codefleet.rl.trainer:Trainer",
        "fsdp2": "codefleet.rl.sharded:ShardedTrainer",
        "fsdp2_ep": "codefleet.rl.sharded:ExpertParallelTrainer",
    },
)
