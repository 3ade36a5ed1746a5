"""The agent harness: the product a user runs on their repository, and the
environment that produces RL rollouts — the same code.

    policy = OpenAIPolicy("http://localhost:8000/v1")
    with create_sandbox("path/to/repo") as sb:
        trajectory = AgentLoop(policy, sb).run(build_messages("Fix the failing test"))

Modules: policy.py (the Policy contract), tools.py (the seven tools),
parallel.py (one turn's calls at once), loop.py (the loop), prompts.py,
planner.py (plan and execute), clients/ (OpenAI-compatible HTTP, scripted
expert, local engine seam), episode.py (a Task end to end: sandbox, loop,
diff, checks, reward), reward.py, attempts.py (N forked attempts, the best
kept), workspace.py (a user repo's diff, --apply), cli.py (`codefleet agent
run`). docs/agent.md is the user's guide.
"""

from codefleet.agent.loop import AgentLoop
from codefleet.agent.policy import PolicyError, parse_tool_call
from codefleet.agent.prompts import build_messages
from codefleet.agent.tools import TOOL_SPECS, Toolbox, ToolConfig, tool_schemas
from codefleet.contracts import Policy
from codefleet.types import PolicyOutput

__all__ = [
    "AgentLoop",
    "Policy",
    "PolicyError",
    "PolicyOutput",
    "TOOL_SPECS",
    "ToolConfig",
    "Toolbox",
    "build_messages",
    "parse_tool_call",
    "tool_schemas",
]
