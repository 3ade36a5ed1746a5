"""Shared data types: the contract between codefleet's layers.

Every layer (sandbox, tasks, agent, model, rl, fleet, analysis) exchanges
these plain dataclasses and nothing else, so that a layer can be read and
tested without the others. Keep them small, typed and serialisable (Ray
pickles them; the rollout store writes them as Parquet rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    backend: str  # "namespace" | "local"
    workspace: str  # path of the workspace inside the sandbox
    filesystem: str  # "overlay" | "fuse-overlayfs" | "copy"
    limits: dict[str, str] = field(default_factory=dict)
    isolated: bool = True
