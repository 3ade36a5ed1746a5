"""What the agent is told: the system prompt, the task message, the plan.

Kept apart from the loop so the words can change (and be trained against)
without touching control flow. The product CLI and RL rollouts use the same
prompts.

Two styles (`PROMPTS`): "full", the system prompt and the tool schemas, what
any model needs to use the harness (the product's default); "bare", the task
message alone, for a policy trained on this harness from scratch: it learns
the tools from demonstrations and could not read English guidance anyway, and
its episodes are ~2.3x shorter (the schemas alone are ~770 tokens).
"""

from __future__ import annotations

from codefleet.chat.codefleet_template import PROMPTS, check_prompt

__all__ = [
    "PROMPTS",
    "check_prompt",
    "SYSTEM_PROMPT",
    "PLANNER_PROMPT",
    "build_messages",
    "task_message",
    "plan_message",
]

SYSTEM_PROMPT = """\
You are a fast, careful coding agent. You work in a sandboxed copy of a software repository; your \
working directory is its root. Use the tools to explore the code, change it and check your work.

How to work:
- Be quick. When tool calls do not depend on each other (reading several files, several searches, \
several test commands), make them all in the same turn: they run in parallel.
- Read before you edit. Change files with edit_file (old_text must match exactly once) or write_file \
for new files. read_file shows line numbers; never copy them into old_text.
- Check your change by running the relevant tests with run.
- When the task is done, call submit with a one-sentence summary. Nobody answers questions while you \
work, so decide and act."""

PLANNER_PROMPT = """\
You are a senior engineer writing a plan for a fast coding agent that will carry it out with tools \
(search, read_file, edit_file, write_file, list_dir, run, submit). Write a short numbered plan: which \
files to look at first (several can be read at once), what to change, and how to verify it. Be \
concrete and brief; do not write the full code."""


def task_message(instruction: str, test_command: str = "") -> str:
    text = f"Task:\n{instruction.strip()}"
    if test_command:
        text += f"\n\nThe visible tests run with: {test_command}"
    return text


def plan_message(plan: str) -> str:
    return f"A planner wrote this plan for the task. Follow it, adapting where the code says otherwise:\n\n{plan}"


def build_messages(instruction: str, test_command: str = "", plan: str = "", prompt: str = "full") -> list[dict]:
    """The executor's first messages: system prompt ("full" only), the task, and the plan if there is one."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}] if check_prompt(prompt) == "full" else []
    messages.append({"role": "user", "content": task_message(instruction, test_command)})
    if plan:
        messages.append({"role": "user", "content": plan_message(plan)})
    return messages


def planner_messages(instruction: str, listing: str = "", test_command: str = "") -> list[dict]:
    user = task_message(instruction, test_command)
    if listing:
        user += f"\n\nThe repository's files:\n{listing}"
    return [{"role": "system", "content": PLANNER_PROMPT}, {"role": "user", "content": user}]
