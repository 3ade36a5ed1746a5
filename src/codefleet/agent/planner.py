"""Plan and execute: a slow, smart planner model writes the plan; a fast executor carries it out.

The planner sees the task and the repository's layout (the `list_dir` tool's
own output, so it reads what the executor will) and answers in text, with no
tools. The plan then goes into the executor's context as a user message
(prompts.plan_message). Its cost is recorded apart from the executor's turns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from codefleet.agent.prompts import planner_messages
from codefleet.agent.tools import Toolbox
from codefleet.contracts import Policy, Sandbox
from codefleet.types import ToolCall


@dataclass
class Plan:
    text: str
    model_s: float
    prompt_tokens: int = 0
    completion_tokens: int = 0
    planner: str = ""


def make_plan(planner: Policy, instruction: str, sandbox: Sandbox, test_command: str = "") -> Plan:
    """Ask `planner` for a plan; raises what the planner raises (e.g. PolicyError)."""
    listing = Toolbox(sandbox).execute(ToolCall("plan_listing", "list_dir", "{}", {})).output
    started = time.perf_counter()
    output = planner.generate(planner_messages(instruction, listing, test_command), [])
    return Plan(
        output.text.strip(),
        time.perf_counter() - started,
        output.prompt_tokens,
        output.completion_tokens,
        getattr(planner, "name", ""),
    )
