"""Shared data types: the contract between codefleet's layers.

Every layer (sandbox, tasks, agent, model, rl, fleet, analysis) exchanges
these plain dataclasses and nothing else, so that a layer can be read and
tested without the others. Keep them small, typed and serialisable (Ray
pickles them; the rollout store writes them as Parquet rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


@dataclass(frozen=True)
class ExecResult:
    """What one command in a sandbox produced.

    `output` is stdout and stderr merged in the order they were written,
    decoded as UTF-8 with invalid bytes replaced. When the command printed
    more than the sandbox's output cap, `truncated` is true, the head and the
    tail are kept and a marker line in between says how many bytes were cut
    (`cut_bytes`).
    """

    output: str
    exit_code: int
    timed_out: bool = False
    truncated: bool = False
    duration_s: float = 0.0
    cut_bytes: int = 0
    shell_restarted: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


@dataclass(frozen=True)
class FileEntry:
    """One entry of a directory listing, path relative to the workspace."""

    path: str
    kind: str  # "file" | "dir" | "symlink" | "other"
    size_bytes: int


@dataclass(frozen=True)
class SearchMatch:
    """One line matching a search, path relative to the workspace."""

    path: str
    line_number: int
    line: str


@dataclass(frozen=True)
class SandboxInfo:
    """How a sandbox is built; reported so a user knows what protects them."""

    sandbox_id: str
    backend: str  # its name in codefleet.contracts.SANDBOXES: "namespace", "vm", "local", ...
    workspace: str  # path of the workspace inside the sandbox
    filesystem: str  # "overlay" | "fuse-overlayfs" | "copy"
    limits: dict[str, str] = field(default_factory=dict)
    isolated: bool = True


# -- tasks ---------------------------------------------------------------------------

TASK_SPEC_VERSION = 1


@dataclass
class Budgets:
    """Limits of one episode. The default allows at least 150 tool calls."""

    max_turns: int = 200
    max_tool_calls: int = 200
    max_tokens: int = 400_000
    wall_clock_s: float = 1800.0


@dataclass
class HiddenChecks:
    """Tests the agent never sees: FAIL_TO_PASS must go from failing to
    passing, PASS_TO_PASS must keep passing. `command` runs them; `{tests}` in
    it is replaced by the space-separated test ids."""

    command: str
    fail_to_pass: list[str] = field(default_factory=list)
    pass_to_pass: list[str] = field(default_factory=list)
    files: dict[str, str] = field(default_factory=dict)  # test files written just before checking


@dataclass
class Task:
    """One coding task (spec version TASK_SPEC_VERSION, JSON: docs/tasks.md).

    `repo` is a directory or a .tar/.tar.gz file. `reference_patch` is a
    unified diff that solves the task; it and `checks.files` are never
    visible inside the agent's sandbox.
    """

    id: str
    repo: str
    instruction: str
    checks: HiddenChecks
    setup_commands: list[str] = field(default_factory=list)
    test_command: str = ""
    budgets: Budgets = field(default_factory=Budgets)
    metadata: dict[str, str | int | float] = field(default_factory=dict)
    reference_patch: str = ""
    spec_version: int = TASK_SPEC_VERSION
    # the userland its sandboxes run in: an OCI image archive, a root filesystem or an imported image's id
    # (docs/environments.md); "" = the host's
    environment: str = ""


# -- agent episodes ------------------------------------------------------------------


@dataclass
class ToolCall:
    """A tool call as the model wrote it. `arguments` is None when
    `raw_arguments` is not valid JSON (then `error` says why)."""

    id: str
    name: str
    raw_arguments: str
    arguments: dict | None = None
    error: str | None = None


@dataclass
class ToolResult:
    call_id: str
    name: str
    output: str
    ok: bool
    duration_s: float = 0.0


@dataclass
class Turn:
    """One model turn and the tool calls it made, with what they cost.

    For RL the exact sampled tokens travel with the turn (token-in,
    token-out): `token_ids`, their `logprobs`, the policy version that
    produced each token and, for MoE, the routed experts per token.
    """

    index: int
    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_results: list[ToolResult] = field(default_factory=list)
    model_s: float = 0.0
    tool_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    errors: list[str] = field(default_factory=list)
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    policy_versions: list[int] | None = None
    routed_experts: list[list[int]] | None = None


@dataclass
class TokenSequence:
    """The exact tokens of one episode as the engine sampled them: what RL trains on (token-in, token-out).

    All lists have one entry per token. `loss_mask` is 1 on the tokens the policy sampled (the prompt, tool
    results and template tokens are 0); `logprobs` are the engine's sampling logprobs (0 where the mask is 0);
    `versions` the policy version that sampled each token (-1 where none did); `routed_experts`, for an MoE
    policy, each token's experts, layer-major, for routing replay (None when some token has no record).
    """

    ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    routed_experts: list[list[int]] | None = None

    def __len__(self) -> int:
        return len(self.ids)


class Failure(str, Enum):  # noqa: UP042 (a StrEnum's str() and f"{}" give "policy", not "Failure.POLICY")
    """Why an episode stopped with stop_reason "error": what failed, so that a caller decides on a kind, never
    on an error message. An exception says its kind with a class attribute `failure` (default POLICY)."""

    POLICY = "policy"  # the model endpoint could not produce a turn (down, bad response)
    ENGINE_DIED = "engine_died"  # the engine actor serving the episode died
    ENGINE_FAILED = "engine_failed"  # the engine is alive but failed the request
    CANCELLED = "cancelled"  # the attempt was cancelled by its caller (e.g. the RL controller)


@dataclass
class PolicyOutput:
    """One assistant turn as a policy produced it."""

    text: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    model: str = ""
    finish_reason: str = ""
    # For RL (token-in, token-out); None where the backend cannot provide them.
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    policy_versions: list[int] | None = None
    routed_experts: list[list[int]] | None = None


@dataclass
class CheckResult:
    """Outcome of the hidden checks after an episode."""

    passed: int
    total: int
    all_passed: bool
    per_test: dict[str, bool] = field(default_factory=dict)
    output: str = ""

    @property
    def fraction(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass
class Trajectory:
    """Everything one episode produced: the transcript, the turns with their
    tokens and timings, the final diff, the checks and the figures."""

    task_id: str
    messages: list[dict]
    turns: list[Turn]
    # stop_reason: "submit" | "no_tool_calls" | "max_turns" | "max_tool_calls" | "max_tokens" | "wall_clock" |
    # "error" | "cancelled"
    stop_reason: str
    failure: Failure | None = None  # with stop_reason "error": what failed (the message is metadata["error"])
    sequence: TokenSequence | None = None  # the exact tokens the policy sampled, when it gave them (RL)
    diff: str = ""
    checks: CheckResult | None = None
    reward: float = 0.0
    wall_s: float = 0.0
    model_s: float = 0.0
    tool_s: float = 0.0
    metadata: dict[str, str | int | float] = field(default_factory=dict)

    @property
    def n_turns(self) -> int:
        return len(self.turns)

    @property
    def n_tool_calls(self) -> int:
        return sum(len(t.tool_calls) for t in self.turns)

    @property
    def tool_calls_per_turn(self) -> float:
        return self.n_tool_calls / self.n_turns if self.turns else 0.0

    @property
    def tokens(self) -> int:
        return sum(t.prompt_tokens + t.completion_tokens for t in self.turns)
