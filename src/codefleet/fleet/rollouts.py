"""Rollouts on Ray: the agent harness as the RL environment.

A `RolloutWorker` actor runs attempts: for each group it prepares the task's
sandbox once on the sandbox fleet (`SandboxFleet`, one `SandboxHost` per
node; repository, setup commands, git baseline), forks one child per
attempt from it, and runs the product's own `solve()` + `score()` in the
child with the local engine as policy (`LocalEnginePolicy` over a
`RemoteEngine`, one engine per episode, so all its turns go to the same
engine). The attempt returns a `staleness.Rollout` holding the scored
Trajectory, which carries the episode's exact token sequence
(`Trajectory.sequence`: ids, loss mask, engine logprobs, versions, routing).

Infrastructure failures are not the agent's failures: an engine or sandbox
that died, or checks that could not run, raise `InfraError` out of
`run_attempt`, and the controller retries the attempt. Before an episode
starts, the worker makes one short call to the engine chosen for it
(`inference.engine_state`): one dead for good gets no episode from this worker
again (when none is left every attempt fails at once, saying so); one that
does not answer (restarting, or its node gone with no room elsewhere) gets
none for `AWAY_S`, then is asked again. A task whose set-up fails twice in a
row, in fresh sandboxes, is broken, not unlucky: the attempt resolves to
`AttemptResult(None, task_error=...)` and the controller drops the group
without retrying it. Everything the agent did wrong (bad tool calls, a context
overflow, wrong fix, no submit) is an ordinary scored rollout.

`AgentGroupRunner` is the controller's `GroupRunner` over a set of workers; a
group's retries move on by one worker per infrastructure failure.

A worker whose process or node dies is restarted by Ray with the arguments it was created with. So they are
passed by value: the spec, and the engines by *name* (`start_engines` names them), which the worker looks up
when it starts, and again when it restarts. Actor handles in the arguments would put them in the object
store, where nothing keeps them for a restart (ray-project/ray#53727). An engine that is no longer there when
the worker starts is dead for good to it.

`RolloutSpec.checkpoint` may be an fsspec URL (a run directory on object storage): a worker reads the
tokenizer, chat template and config from its node's `storage.local_copy` of it, without the tensor files.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import ray
import torch

from codefleet.agent.clients.local_engine import LocalEnginePolicy, grammar_options
from codefleet.agent.episode import EpisodeConfig, score, solve
from codefleet.agent.policy import PolicyError
from codefleet.chat import formats
from codefleet.fleet.controller import AttemptResult
from codefleet.fleet.fleet_config import RolloutWorkersConfig
from codefleet.fleet.inference import RemoteEngine, actor_names, engine_state
from codefleet.fleet.sandbox_fleet import SandboxFleet
from codefleet.fleet.staleness import Rollout, Ticket
from codefleet.model.checkpoint import TENSOR_SUFFIXES, load_config
from codefleet.sandbox.base import SandboxConfig
from codefleet.store import storage
from codefleet.tasks.checks import TaskSetupError, prepare_sandbox
from codefleet.types import Failure, Task


class InfraError(RuntimeError):
    """An attempt failed because of the infrastructure (engine, sandbox, actor), not the agent."""


@dataclass
class RolloutSpec:
    """How rollout workers run episodes."""

    checkpoint: str  # for the tokenizer and the context length (a directory, or a URL)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    episode: EpisodeConfig = field(default_factory=EpisodeConfig)
    max_tokens: int = 384  # per turn
    temperature: float = 1.0
    top_p: float = 1.0
    max_seq_len: int | None = None
    tool_grammar: str = "off"  # "auto"/"required": tool calls constrained to parse and fit their schemas (grammar)
    use_fleet: bool = True  # sandboxes on the SandboxHost fleet; False: in the worker's process
    namespace: str = "codefleet"


AWAY_S = 30.0  # an engine that did not answer gets no episode from a worker for this long
PROBE_S = 5.0  # how long an engine may take to answer before an episode starts on it
AWAY_PROBE_S = 60.0  # ... when every engine is away


class _BrokenTask(Exception):
    """The task's set-up failed twice in fresh sandboxes: the task's fault, not the infrastructure's."""


@dataclass
class _Prepared:
    sandbox: object
    lock: threading.Lock = field(default_factory=threading.Lock)
    users: int = 0  # attempts preparing or forking from it
    broken: _BrokenTask | None = None  # the set-up failed as the task's fault: the group's other attempts too


@ray.remote(max_restarts=-1, max_task_retries=0)
class RolloutWorker:
    def __init__(self, spec: RolloutSpec, engine_names: list[str]):
        torch.set_num_threads(1)
        self.spec = spec
        self.engines: list = []
        self._gone: set[int] = set()  # indices of engines dead for good
        for i, name in enumerate(engine_names):
            try:
                self.engines.append(ray.get_actor(name))
            except ValueError:  # gone for good: no actor holds the name any more
                self.engines.append(None)
                self._gone.add(i)
        checkpoint = storage.local_copy(spec.checkpoint, skip=TENSOR_SUFFIXES)  # a URL: its small files, here
        self.tokenizer, _ = formats.for_checkpoint(checkpoint)  # and its chat template
        self.max_seq_len = spec.max_seq_len or load_config(checkpoint).max_seq_len
        self._groups: dict[int, _Prepared] = {}
        self._lock = threading.Lock()
        self._fleet = None
        self._away: dict[int, float] = {}  # engine index -> time.monotonic() until which it gets no episode

    def _create(self):
        if not self.spec.use_fleet:
            return None
        if self._fleet is None:
            self._fleet = SandboxFleet.start(self.spec.namespace)
        return self._fleet.create

    def _child(self, task: Task, group_id: int):
        """A sandbox forked from the group's prepared sandbox. Attempts of a group arrive together and share
        one prepared sandbox; the last one to fork closes it (a later retry prepares again)."""
        with self._lock:
            prepared = self._groups.setdefault(group_id, _Prepared(None))
            prepared.users += 1
        try:
            with prepared.lock:
                if prepared.broken is not None:
                    raise prepared.broken
                if prepared.sandbox is None or not prepared.sandbox.alive():
                    try:
                        prepared.sandbox = self._prepare(task)
                    except _BrokenTask as e:
                        prepared.broken = e
                        raise
                return prepared.sandbox.fork(1)[0]
        finally:
            with self._lock:
                prepared.users -= 1
                last = prepared.users == 0
                if last:
                    self._groups.pop(group_id, None)
            if last and prepared.sandbox is not None:
                prepared.sandbox.close()

    def _prepare(self, task: Task):
        """The task's prepared sandbox. A set-up that fails (not by timing out) is tried once more in a fresh
        sandbox before it counts as the task's fault (`_BrokenTask`): a sandbox killed mid-set-up fails it too."""

        for tries in (1, 2):
            try:
                return prepare_sandbox(task, self.spec.sandbox, create=self._create())
            except TaskSetupError as e:
                if e.timed_out:
                    raise
                if tries == 2:
                    raise _BrokenTask(str(e)) from e
        raise AssertionError("the loop returns or raises")

    def _engine(self, ticket: Ticket, attempt: int) -> tuple[int, object]:
        """(index, actor) of the engine for this attempt, spread over the engines that are neither gone nor away,
        and one that answers a call now: an engine whose node is gone takes calls that never return. When every
        engine is away, the attempt waits for one a while before it fails as infrastructure."""

        start = ticket.group_id * ticket.group_size + attempt
        while True:
            alive = [i for i in range(len(self.engines)) if i not in self._gone]
            if not alive:
                raise InfraError(
                    f"all {len(self.engines)} engines are dead for good; nothing can serve the policy: "
                    "resume the run to start new engines"
                )
            now = time.monotonic()
            live = [i for i in alive if self._away.get(i, 0.0) <= now]
            i = (live or alive)[start % len(live or alive)]
            state = engine_state(self.engines[i], timeout_s=PROBE_S if live else AWAY_PROBE_S)
            self._note(i, state)
            if state == "up":
                return i, self.engines[i]
            if not live and state == "away":
                raise InfraError(
                    f"no engine answered within {AWAY_PROBE_S:.0f} s: they are restarting, or their "
                    "nodes are gone with no room for them elsewhere"
                )

    def _note(self, index: int, state: str) -> None:
        """Route by what a call to engine `index` found (`inference.engine_state`)."""
        self._away.pop(index, None)
        if state == "gone":
            self._gone.add(index)
        elif state == "away":
            self._away[index] = time.monotonic() + AWAY_S

    def run_attempt(self, task: Task, ticket: Ticket, attempt: int, version: int):
        spec = self.spec
        index, engine = self._engine(ticket, attempt)
        try:
            sandbox = self._child(task, ticket.group_id)
        except _BrokenTask as e:
            return AttemptResult(None, task_error=f"the set-up of {task.id} failed twice: {e}")
        except Exception as e:
            raise InfraError(f"could not prepare a sandbox for {task.id}: {type(e).__name__}: {e}") from e
        remote = RemoteEngine(engine, self.tokenizer, self.max_seq_len)
        base = LocalEnginePolicy(
            engine=remote,
            tokenizer=self.tokenizer,
            max_tokens=spec.max_tokens,
            temperature=spec.temperature,
            top_p=spec.top_p,
            name="local:rl",
            **grammar_options(spec.tool_grammar),
        )
        policy = base.for_episode()
        try:
            config = spec.episode
            trajectory = solve(
                sandbox,
                task.instruction,
                _Cancellable(policy),
                test_command=task.test_command,
                budgets=config.budgets or task.budgets,
                tool_config=config.tools,
                task_id=task.id,
                prompt=config.prompt,
            )
            error = str(trajectory.metadata.get("error", ""))
            if trajectory.failure == Failure.ENGINE_DIED:
                self._note(index, engine_state(engine, timeout_s=10.0))
                if index in self._gone:
                    raise InfraError(
                        f"attempt {attempt} of group {ticket.group_id}: engine {index} is dead for "
                        f"good; this worker sends no more episodes to it ({error})"
                    )
            if trajectory.failure in (Failure.ENGINE_DIED, Failure.ENGINE_FAILED, Failure.CANCELLED):
                raise InfraError(f"attempt {attempt} of group {ticket.group_id}: {error}")
            if not sandbox.alive():
                raise InfraError(f"attempt {attempt} of group {ticket.group_id}: the sandbox died")
            trajectory = score(trajectory, sandbox, task, config.reward)
            if "checks_error" in trajectory.metadata:
                raise InfraError(
                    f"attempt {attempt} of group {ticket.group_id}: the hidden checks could not run: "
                    f"{trajectory.metadata['checks_error']}"
                )
        finally:
            sandbox.close()
        tokens = policy.tokens
        versions = [v for v in tokens.versions if v >= 0]
        if versions and min(versions) < ticket.policy_version:  # an engine restarted on older weights
            raise InfraError(
                f"attempt {attempt} of group {ticket.group_id}: the engine served policy version "
                f"{min(versions)}, older than the group's {ticket.policy_version}"
            )
        trajectory.metadata.update(attempt=attempt, group=ticket.group_id)
        trajectory.sequence = tokens.sequence()
        rollout = Rollout(
            f"{ticket.group_id}/{attempt}",
            ticket.group_id,
            min(versions, default=version),
            trajectory.reward,
            trajectory,
        )
        return AttemptResult(rollout)

    def ping(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """This worker's process id: a new one after Ray restarted the worker."""
        return os.getpid()


class _Cancellable:
    """`ray.cancel` only flags a threaded actor's running call: check the flag before every turn (in the
    task's own thread, where Ray knows which task it is) and end the episode there."""

    def __init__(self, policy):
        self.policy, self.name = policy, policy.name

    def generate(self, messages: list[dict], tools: list[dict]):
        if ray.get_runtime_context().is_canceled():
            raise Cancelled("the attempt was cancelled by the controller")
        return self.policy.generate(messages, tools)


class Cancelled(PolicyError):
    """The controller cancelled the attempt (its group was abandoned); an infrastructure outcome."""

    failure = Failure.CANCELLED


class AgentGroupRunner:
    """The controller's GroupRunner: attempts spread over rollout workers. Each infrastructure failure of a
    group moves its retries on by one worker, so a worker that is stuck, or restarting with no room on the
    cluster, costs an attempt one timeout rather than every retry (and the group)."""

    def __init__(self, workers: list):
        self.workers = workers

    def start(self, ticket: Ticket, item: Task, attempts: list[int]) -> list:
        first = ticket.group_id * ticket.group_size + ticket.infra_failures
        return [
            self.workers[(first + a) % len(self.workers)].run_attempt.remote(item, ticket, a, ticket.policy_version)
            for a in attempts
        ]


def start_workers(
    spec: RolloutSpec,
    engines: list,
    n: int,
    *,
    slots_per_worker: int,
    num_cpus: float = RolloutWorkersConfig.cpus,
    resources: dict | None = None,
) -> list:
    """`n` rollout workers over the engine actors `engines` (named ones: `start_engines`); waits until they are up."""
    names = actor_names(engines)
    workers = [
        RolloutWorker.options(num_cpus=num_cpus, resources=resources or {}, max_concurrency=slots_per_worker).remote(
            spec, names
        )
        for _ in range(n)
    ]
    ray.get([w.ping.remote() for w in workers])
    return workers


def stop_workers(workers: list) -> None:
    """Kill the rollout workers for good (they restart otherwise). Done before the sandbox fleet shuts down: a
    worker still running an episode would start a new host for its next sandbox, and that host, killed by Ray at
    the job's end, would leave its sandboxes' mounts behind."""
    for worker in workers:
        ray.kill(worker, no_restart=True)
