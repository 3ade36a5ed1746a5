"""Expert demonstrations for SFT: the scripted expert solves training tasks through the real harness.

Each task is run by `agent.episode.run_episode` with `ScriptedExpert` in a
real sandbox, exactly as a model would be run (same prompt style, same
tools, same tool outputs), and only solved episodes are kept. The
conversation is encoded with the chat template into `(ids, mask)`, mask 1
on the assistant's tokens (`Demos.encode`, `chat.encode_chat_with_mask`),
which is what `rl.sft` trains on; the conversations are kept too, so SFT can
show them with fresh names (`rl.augment`). Demonstrations longer than the
model's context are dropped and counted, never truncated (a cut
demonstration teaches a turn without its ending).

`explore_fraction` of the tasks (drawn per task from `seed` and its id) get
an expert that first explores (lists the repository and searches for what
the patch touches), the rest one that acts on the instruction at once where
it names the files. `chain_fraction` of the renames run the tests in the
same command as the rename. Real demonstrations vary like this; RL, whose
reward costs turns, then learns which habit is faster.

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

from codefleet.types import Task


_DURATION = re.compile(r"\b((?:passed|failed|errors?|skipped|warnings?|deselected|xfailed|xpassed|no tests ran)"
                       r" in )\d+(?:\.\d+)?s\b")


def steady_timings(messages: list[dict]) -> list[dict]:
    """The conversation with every duration pytest printed in a tool result written as 0.01s."""
    return [dict(m, content=_DURATION.sub(r"\g<1>0.01s", m["content"]))
            if m.get("role") == "tool" and isinstance(m.get("content"), str) else m for m in messages]


@dataclass
class Demos:
    examples: list[tuple[list[int], list[int]]] = field(default_factory=list)
    task_ids: list[str] = field(default_factory=list)
    unsolved: list[str] = field(default_factory=list)
    too_long: list[str] = field(default_factory=list)
    no_patch: list[str] = field(default_factory=list)  # tasks without a reference patch: RL attempts them only
    conversations: list[list[dict]] = field(default_factory=list)  # the messages of each example
    prompt: str = "full"  # the prompt style they were made with (agent.prompts): "full" encodes the tool schemas

    @property
    def tokens(self) -> int:
        return sum(len(ids) for ids, _ in self.examples)

    def encode(self, tokenizer, messages: list[dict]) -> tuple[list[int], list[int]]:
        """A conversation as SFT trains on it: ids and the assistant mask, with the tool schemas if "full"."""
        from codefleet.agent.tools import tool_schemas
        from codefleet.model import chat

        return chat.encode_chat_with_mask(tokenizer, messages, tool_schemas() if self.prompt == "full" else None)


def expert_demos(tasks: list[Task], tokenizer, max_seq_len: int, sandbox_config=None, episode_config=None,
                 jobs: int = 2, explore_fraction: float = 1.0, chain_fraction: float = 0.0, seed: int = 0) -> Demos:
    from codefleet.agent.clients.scripted import ScriptedExpert
    from codefleet.agent.episode import EpisodeConfig, run_episode

    def one(task: Task):
        if not task.reference_patch.strip():  # nothing for the expert to replay: no demonstration
            return None
        explore = random.Random(f"{seed}:{task.id}").random() < explore_fraction
        chain = random.Random(f"{seed}:chain:{task.id}").random() < chain_fraction
        return run_episode(task, ScriptedExpert(task, explore=explore, chain_tests=chain), sandbox_config,
                           config=episode_config)

    demos = Demos(prompt=(episode_config or EpisodeConfig()).prompt)
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="demo") as pool:
        for task, trajectory in zip(tasks, pool.map(one, tasks)):
            if trajectory is None:
                demos.no_patch.append(task.id)
                continue
            if not (trajectory.checks and trajectory.checks.all_passed):
                demos.unsolved.append(task.id)
                continue
            messages = steady_timings(trajectory.messages)
            ids, mask = demos.encode(tokenizer, messages)
            if len(ids) > max_seq_len:
                demos.too_long.append(task.id)
                continue
            demos.examples.append((ids, mask))
            demos.task_ids.append(task.id)
            demos.conversations.append(messages)
    return demos
