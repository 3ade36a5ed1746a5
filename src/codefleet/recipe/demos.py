"""Expert demonstrations for SFT: the scripted expert solves training tasks through the real harness.

Each task is run by `agent.episode.run_episode` with `ScriptedExpert` in a
real sandbox, exactly as a model would be run (same prompt style, same
tools, same tool outputs), and only solved episodes are kept. The
conversation is encoded with the checkpoint's chat format into `(ids, mask)`,
mask 1 on the assistant's tokens (`Demos.encode`, `encode_chat_with_mask` of
`formats.of(tokenizer)`: codefleet's template or a Hugging Face one),
which is what `rl.sft` trains on; the conversations are kept too, so SFT can
show them with fresh names (`recipe.augment`). Demonstrations longer than the
model's context are dropped and counted, never truncated (a cut
demonstration teaches a turn without its ending).

`explore_fraction` of the tasks (drawn per task from `seed` and its id) get
an expert that first explores (lists the repository and searches for what
the patch touches), the rest one that acts on the instruction at once where
it names the files. `chain_fraction` of the renames run the tests in the
same command as the rename. Real demonstrations vary like this; RL, whose
reward costs turns, then learns which habit is faster.

That needs the policy to *have* a choice on a task. With one habit per task,
the SFT policy learns each training task's habit by heart, so RL's attempts at
a task all take the same path and no group has a fast and a slow solved
attempt to compare (docs/experiments/, "Habits RL can choose between"). With
`all_habits`, the expert also records every other habit that makes a different
episode of the task (`Demos.variants`), and SFT draws the habit anew each time
it shows the task (`Demos.conversation`): the policy's habit becomes a coin it
tosses on every task, which is what RL's turn costs can weigh.

The durations pytest prints (`8 passed in 0.02s`) are the one thing in a
demonstration that changes from run to run; `steady_timings` writes them all
as 0.01s, so the same tasks give the same demonstrations, token for token,
and SFT the same checkpoint. (They differed in 4 to 19 of 80 demonstrations
between runs, and two such runs' SFT checkpoints solved 0.6% and 9.4% of the
held-out episodes.)
"""

from __future__ import annotations

import random
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from codefleet.agent.clients.scripted import ScriptedExpert
from codefleet.agent.episode import EpisodeConfig, run_episode
from codefleet.agent.tools import tool_schemas
from codefleet.chat import formats
from codefleet.tasks.checks import TaskSetupError
from codefleet.types import Task

_DURATION = re.compile(
    r"\b((?:passed|failed|errors?|skipped|warnings?|deselected|xfailed|xpassed|no tests ran)"
    r" in )\d+(?:\.\d+)?s\b"
)


def steady_timings(messages: list[dict]) -> list[dict]:
    """The conversation with every duration pytest printed in a tool result written as 0.01s."""
    return [
        dict(m, content=_DURATION.sub(r"\g<1>0.01s", m["content"]))
        if m.get("role") == "tool" and isinstance(m.get("content"), str)
        else m
        for m in messages
    ]


@dataclass
class Demos:
    examples: list[tuple[list[int], list[int]]] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)
    unsolved: list[str] = field(default_factory=list)
    too_long: list[str] = field(default_factory=list)
    no_patch: list[str] = field(default_factory=list)  # tasks without a reference patch: RL attempts them only
    broken: dict[str, str] = field(default_factory=dict)  # task id -> why its set-up fails (RL leaves it out too)
    conversations: list[list[dict]] = field(default_factory=list)  # the messages of each example
    prompt: str = "full"  # the prompt style they were made with (agent.prompts): "full" encodes the tool schemas
    # per example, when made with all_habits: (explore, chain) -> the conversation of the expert with that habit
    # (habits that make the same episode share it); empty otherwise
    variants: list[dict[tuple[bool, bool], list[dict]]] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.examples)

    def encode(self, tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
        """A conversation as SFT trains on it: ids and the assistant mask, with the tool schemas if "full"."""

        fmt = formats.of(tokenizer)
        return fmt.encode_chat_with_mask(tokenizer, messages, tool_schemas() if self.prompt == "full" else None)

    def conversation(
        self, j: int, rng: random.Random | None = None, explore_fraction: float = 0.5, chain_fraction: float = 0.5
    ) -> list[dict]:
        """Example j's messages: with `rng` and recorded variants, those of a habit drawn now (explore with
        `explore_fraction`, chain the tests with `chain_fraction`); otherwise the habit drawn when recorded."""
        if rng is None or j >= len(self.variants) or not self.variants[j]:
            return self.conversations[j]
        return self.variants[j][(rng.random() < explore_fraction, rng.random() < chain_fraction)]


def expert_demos(
    tasks: list[Task],
    tokenizer,
    max_seq_len: int,
    sandbox_config=None,
    episode_config=None,
    jobs: int = 2,
    explore_fraction: float = 1.0,
    chain_fraction: float = 0.0,
    seed: int = 0,
    all_habits: bool = False,
) -> Demos:
    """One solved demonstration per task, its habit drawn from `seed` and the task's id; with `all_habits`,
    also the task's other habits' episodes (`Demos.variants`). A task is kept only if every one is solved
    and fits the context; a task whose set-up fails is recorded in `Demos.broken`, not raised."""

    habits = [(e, c) for e in (True, False) for c in (False, True)]

    def one(task: Task):
        if not task.reference_patch.strip():  # nothing for the expert to replay: no demonstration
            return None
        try:
            return demonstrate(task)
        except TaskSetupError as e:
            return e

    def demonstrate(task: Task):
        drawn = (
            random.Random(f"{seed}:{task.id}").random() < explore_fraction,
            random.Random(f"{seed}:chain:{task.id}").random() < chain_fraction,
        )
        experts = {h: ScriptedExpert(task, explore=h[0], chain_tests=h[1]) for h in (habits if all_habits else [drawn])}
        episodes: dict[tuple, object] = {}  # the expert's steps -> its episode: habits that change nothing share one
        for expert in experts.values():
            if tuple(expert.steps) not in episodes:
                episodes[tuple(expert.steps)] = run_episode(task, expert, sandbox_config, config=episode_config)
        return drawn, {h: episodes[tuple(expert.steps)] for h, expert in experts.items()}

    demos = Demos(prompt=(episode_config or EpisodeConfig()).prompt)
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="demo") as pool:
        for task, made in zip(tasks, pool.map(one, tasks), strict=True):
            if made is None:
                demos.no_patch.append(task.id)
                continue
            if isinstance(made, TaskSetupError):
                demos.broken[task.id] = str(made)
                continue
            drawn, trajectories = made
            if not all(t.checks and t.checks.all_passed for t in trajectories.values()):
                demos.unsolved.append(task.id)
                continue
            cleaned = {id(t): steady_timings(t.messages) for t in trajectories.values()}
            messages = {h: cleaned[id(t)] for h, t in trajectories.items()}
            encoded = {h: demos.encode(tokenizer, m) for h, m in messages.items()}
            if any(len(ids) > max_seq_len for ids, _ in encoded.values()):
                demos.too_long.append(task.id)
                continue
            demos.examples.append(encoded[drawn])
            demos.task_ids.append(task.id)
            demos.conversations.append(messages[drawn])
            if all_habits:
                demos.variants.append(messages)
    return demos
