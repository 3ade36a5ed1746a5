"""`EvalConfig`, how `codefleet eval` and a training run's evaluations run a policy on tasks (`evaluate.py` runs
them). It lives apart from the evaluation, which needs torch, so that a run's configuration loads without it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalConfig:
    attempts: int = 1  # episodes per task and policy
    # sampling temperature; 0 = greedy, so an evaluation is repeatable (a run's policy is trained at rl.temperature)
    temperature: float = 0.0
    max_tokens: int = 384  # per turn
    jobs: int = 4  # tasks evaluated at once
    threads: int = 2  # torch threads of the engine that serves a checkpoint in process
    # each episode's prompts extend the exact sampled tokens, as RL's rollouts do, instead of the conversation
    # rendered again as a server would (agent.attempts.run_task_attempts); a checkpoint's engine only
    exact_tokens: bool = False
