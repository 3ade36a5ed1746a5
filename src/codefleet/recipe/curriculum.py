"""Which training task RL attempts next: uniform passes, or a curriculum that follows the signal.

A group of G attempts teaches a group-relative estimator (GRPO, RLOO)
something only when its rewards differ: a task the policy always fails (or
always solves) costs G whole episodes and yields all-zero advantages. Early
in RL most tasks are like that; on the tiny default run, three of the five
task families are never solved by the SFT policy, so three groups in five
are spent for nothing.

`TaskSampler(mode="learnable")` keeps, per task family (`key`, default the
task's `metadata["family"]`), a Beta posterior on the policy's success
probability, `p_k ~ Beta(a + solved_k, b + failed_k)` with the Jeffreys
prior a = b = 1/2, and draws the next family with weight

    floor + P(a group of G has both a success and a failure) = floor + 1 - p^G - (1 - p)^G

at the posterior mean p. An untried family starts at p = 1/2 (weight ~1);
one all-failed group of 4 brings it to p = 0.1 (0.34), two to 0.056 (0.21),
while a family with one success in four stays near 0.75. `floor` keeps every
family in play, so one that becomes learnable later is noticed. Within a
family, tasks come in a shuffled order, reshuffled every pass. This is the
online difficulty filtering of recent RL recipes (DAPO's dynamic sampling
drops zero-variance groups after paying for them; Kimi k1.5 and Polaris
sample by pass rate) at the granularity the run can estimate: a family is
seen many times in a run of a few dozen groups, a single task rarely twice.

`mode="uniform"` is the plain stream: every task once per pass, reshuffled
every pass. Both are deterministic given the seed and the order of
`observe` calls; `skip` (resume) passes over that many draws of the uniform
stream, and re-seeds the curriculum (whose past is restored by `observe`-ing
the accepted groups again).
"""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Iterator

MODES = ("uniform", "learnable")


def family_of(task) -> str:
    """The task's family (`metadata["family"]`), else its id up to the first '-' (generated ids start with it)."""
    return str(task.metadata.get("family") or task.id.split("-", 1)[0])


def mixed_group_probability(p: float, group_size: int) -> float:
    """P(a group of `group_size` independent attempts with success probability p has a success and a failure)."""
    return 1.0 - p**group_size - (1.0 - p) ** group_size


class TaskSampler(Iterator):
    """Training tasks forever: `next(sampler)` is the next task to attempt; `observe` reports how a group did."""

    def __init__(
        self,
        tasks: list,
        seed: int = 0,
        mode: str = "uniform",
        group_size: int = 4,
        floor: float = 0.1,
        prior: tuple[float, float] = (0.5, 0.5),
        key=family_of,
        skip: int = 0,
    ):
        if mode not in MODES:
            raise ValueError(f"task sampling mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not tasks:
            raise ValueError("TaskSampler needs at least one task")
        self.tasks, self.seed, self.mode, self.group_size = list(tasks), seed, mode, group_size
        self.floor, self.prior = floor, prior
        self.by_key: dict[str, list] = defaultdict(list)
        for task in self.tasks:
            self.by_key[key(task)].append(task)
        self.keys = sorted(self.by_key)
        self.key_of = {task.id: key(task) for task in self.tasks}
        self.excluded: set[str] = set()
        self.solved: dict[str, int] = defaultdict(int)
        self.failed: dict[str, int] = defaultdict(int)
        self._rng = random.Random(f"{seed}/curriculum/{skip}")
        self._queues: dict[str, list] = {}
        self._passes: dict[str, int] = defaultdict(int)
        self._uniform = self._uniform_stream()
        if mode == "uniform":
            for _ in range(skip):
                next(self._uniform)

    def __next__(self):
        if not self.key_of.keys() - self.excluded:
            raise StopIteration  # every task was left out
        if self.mode == "uniform":
            return next(self._uniform)
        keys = [k for k in self.keys if any(t.id not in self.excluded for t in self.by_key[k])]
        key = self._rng.choices(keys, weights=[self.weight(k) for k in keys])[0]
        if not self._queues.get(key):
            order = list(self.by_key[key])
            random.Random(f"{self.seed}/{key}/{self._passes[key]}").shuffle(order)
            self._passes[key] += 1
            self._queues[key] = [t for t in order if t.id not in self.excluded]
        return self._queues[key].pop(0)

    def exclude(self, task_id: str) -> None:
        """Never hand out `task_id` again (its set-up fails: it cannot be attempted). Once every task is
        excluded, `next()` raises StopIteration."""
        self.excluded.add(task_id)
        for queue in self._queues.values():
            queue[:] = [t for t in queue if t.id != task_id]

    def observe(self, task_id: str, solved: list[bool]) -> None:
        """A finished group of attempts at `task_id`: which attempts solved it. Unknown task ids are ignored."""
        key = self.key_of.get(task_id)
        if key is None:
            return
        self.solved[key] += sum(1 for s in solved if s)
        self.failed[key] += sum(1 for s in solved if not s)

    def success_estimate(self, key: str) -> float:
        """The posterior mean of the policy's success probability on family `key`."""
        a, b = self.prior
        return (self.solved[key] + a) / (self.solved[key] + self.failed[key] + a + b)

    def weight(self, key: str) -> float:
        return self.floor + mixed_group_probability(self.success_estimate(key), self.group_size)

    def stats(self) -> dict[str, dict[str, float]]:
        """Per family: attempts seen, success estimate and sampling weight (for logs and metrics)."""
        return {
            k: {"attempts": self.solved[k] + self.failed[k], "p": self.success_estimate(k), "weight": self.weight(k)}
            for k in self.keys
        }

    def _uniform_stream(self):
        for epoch in range(10**9):
            order = list(self.tasks)
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            yield from (t for t in order if t.id not in self.excluded)
