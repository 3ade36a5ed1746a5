"""Which habit does a checkpoint open with on each task: explore first, or act at once?

RL on the demo is meant to make the policy faster by choosing between the
habits its demonstrations mix (rl.demos): explore the repository first, or
act at once where the task names what to change. Sampled evaluations show
the choice only through noisy turn counts; this probe reads it off the
model. For every task (one with a reference patch, where the two habits
differ), it scores the scripted expert's first assistant turn under each
habit and compares the logprobs of their first `--tokens` tokens (the words
that commit to a habit: "Let me look at..." or "Renaming ..."), normalised
over the two, so it prints P(explore) per task and its mean per checkpoint:

    python experiments/probes/habit_probe.py --tasks RUN/tasks/eval RUN/checkpoints/sft RUN/checkpoints/rl-step-000016

Only tasks where the habits differ are scored (renames, and tasks whose
instruction names every file the patch reads). The prompt is the bare one
(`model.prompt=bare`, the default run's).

Measured (docs/training.md, 2026-12-05): on the four held-out renames,
P(explore) 0.63 for an SFT checkpoint trained with habits drawn per showing
(`sft.habits=epoch`) and 0.64 to 0.70 after six RL variants from it; 0.76 ->
0.79 for a default run's SFT and RL. RL moves the held-out renames' habit
towards exploring, the slower path.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys

import torch

from codefleet.agent.clients.scripted import ScriptedExpert
from codefleet.agent.prompts import build_messages
from codefleet.chat.codefleet_template import encode_chat_with_mask
from codefleet.chat.tokenizer import default_tokenizer
from codefleet.model import checkpoint
from codefleet.rl.logprobs import forward_logprobs
from codefleet.tasks.spec import load_task


def first_turn(task, explore: bool, messages: list[dict] | None = None) -> dict:
    """The expert's first assistant message under a habit, as a chat message (`messages`: the task's prompt)."""
    messages = messages or build_messages(task.instruction, task.test_command, prompt="bare")
    out = ScriptedExpert(task, explore=explore).generate(messages, [])
    return {
        "role": "assistant",
        "content": out.text,
        "tool_calls": [
            {"id": f"call_0_{i}", "type": "function", "function": {"name": c.name, "arguments": c.raw_arguments}}
            for i, c in enumerate(out.tool_calls)
        ],
    }


def opening_logprob(model, tokenizer, task, explore: bool, n_tokens: int) -> float:
    messages = build_messages(task.instruction, task.test_command, prompt="bare")
    ids, mask = encode_chat_with_mask(tokenizer, messages + [first_turn(task, explore, messages)], None)
    start = mask.index(1)
    mask = [1 if start <= i < start + n_tokens else 0 for i in range(len(mask))]
    with torch.no_grad():
        return float(forward_logprobs(model, torch.tensor([ids]), torch.tensor([mask])).logprobs_BT.sum())


def p_explore(model, tokenizer, task, n_tokens: int) -> float:
    explore, act = (opening_logprob(model, tokenizer, task, e, n_tokens) for e in (True, False))
    return 1.0 / (1.0 + math.exp(act - explore))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", help="checkpoint directories")
    parser.add_argument("--tasks", required=True, help="a task directory (RUN/tasks/eval, or one of your own)")
    parser.add_argument("--tokens", type=int, default=3, help="how many opening tokens decide the habit")
    args = parser.parse_args(argv)
    tasks = []
    for path in sorted(glob.glob(os.path.join(args.tasks, "*", "task.json"))):
        task = load_task(path)
        if task.reference_patch.strip() and ScriptedExpert(task, True).steps != ScriptedExpert(task, False).steps:
            tasks.append(task)
    if not tasks:
        print(
            f"habit_probe: no task in {args.tasks} has two habits (a rename, or a task naming its files)",
            file=sys.stderr,
        )
        return 1
    tokenizer = default_tokenizer()
    for ckpt in args.checkpoints:
        model = checkpoint.load(ckpt).eval()
        p = {t.id: p_explore(model, tokenizer, t, args.tokens) for t in tasks}
        print(
            f"{ckpt}: P(explore) {sum(p.values()) / len(p):.3f} over {len(p)} tasks  "
            + "  ".join(f"{k} {v:.3f}" for k, v in p.items())
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
