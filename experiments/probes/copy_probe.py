"""Can a policy learn to copy identifiers from its instruction within a given number of SFT steps?

The skill every generated task needs, isolated: a rename instruction (the
rename family's own wording) with two fresh identifiers, and the expert's
answer, one `run` call with `rename_command(old, new)`. Names are made of
random words, so they cannot be memorised: the model has to copy them.
Each step trains on `--batch` new examples (cross-entropy on the assistant's
tokens, the real Trainer); every `--every` steps the engine decodes 20
held-out instructions greedily and counts exact copies of the command.

    python experiments/probes/copy_probe.py --steps 300                  # the demo's prompt (system + tools), ~6 min
    python experiments/probes/copy_probe.py --steps 1500 --batch 8 --short   # instruction only, ~8 min
    python experiments/probes/copy_probe.py --steps 4000 --batch 8 --short --every 500   # until it copies, ~18 min
    python experiments/probes/copy_probe.py --steps 300 --batch 8 --short --induction 600   # induction heads first
    # ... and kept training during the probe:
    python experiments/probes/copy_probe.py --steps 300 --batch 8 --short --induction 600 --induction-mix 0.5

A copy counts when the first `run` call's command, JSON-decoded as the
harness would run it, equals the expert's; the probe checks that on the
expert's own answer first. (Until 2026-12-03 it looked for the raw command in
the JSON-escaped text, which never matched: the "0 of 20" of every earlier
run measured nothing; their cross-entropy figures stand.)

Measured on this 2-core machine with the tiny config (lr 2e-3, cosine), fixed
metric, before the model had previous-token embeddings (`--prev-tokens 0`) and
with the expert's names after a space: `--steps 4000 --batch 8 --short`
copies 0 of 20 up to step 3000 (CE 0.71 at 500 steps, 0.42 at 1500, 0.12 at
3000), 2 of 20 at 3500 and 4 of 20 at 4000 (CE 0.07, 17.8 min). With the
default now (2 previous tokens, quoted names; a variant of this script that
decodes without the engine): 5 of 20 at 750 steps, 13 of 20 at 1000 (CE 0.07,
~7 min). With the copy head (`--copy-head`, `CopyConfig.head`): 16 of 20 at 100
steps (43 s), 20 of 20 at every check from 200 to 400 (CE 0.002 at 400).
With `--copy-scope prompt` (2026-12-04, `--steps 150 --batch 8 --short`):
0, 11, 19 of 20 at steps 50, 100, 150; adding `--copy-match`: 1, 13, 17.
`--induction N` first trains up to N steps on repeated random token
sequences (copy the second half from the first) until the copy loss is under
0.3, so the model starts the probe with working induction heads;
`--induction-mix W` keeps training them during the probe (they form in ~260
steps; neither moved the CE at 300 steps). See docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from codefleet.agent.clients.scripted import rename_command, rename_step
from codefleet.agent.prompts import build_messages
from codefleet.agent.tools import tool_schemas
from codefleet.chat.codefleet_template import encode_chat, encode_chat_with_mask
from codefleet.chat.tokenizer import default_tokenizer
from codefleet.chat.tool_parser import PARSERS
from codefleet.inference.engine import Engine
from codefleet.inference.sampling import SamplingParams
from codefleet.model.config import ModelConfig
from codefleet.model.copying import CopyConfig
from codefleet.model.transformer import Transformer
from codefleet.recipe.augment import identifier
from codefleet.rl.trainer import TrainConfig, Trainer
from codefleet.tasks.families.rename import _ASKS


def conversation(rng: random.Random, short: bool) -> tuple[list[dict], str, str]:
    """The instruction's messages and the names it asks to rename."""
    old = identifier(rng)
    new = identifier(rng)
    while new == old:
        new = identifier(rng)
    path = f"{identifier(rng).split('_')[0]}kit/{identifier(rng)}.py"
    messages = build_messages(rng.choice(_ASKS).format(old=old, new=new, path=path), "python3 -m pytest -q tests")
    return (messages[1:] if short else messages), old, new


def induction_loss(
    model: Transformer, batch: int = 16, length: int = 32, alphabet: int = 512
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of predicting the repeat of `batch` sequences of `length` random tokens (ids
    16..alphabet-1) from their first occurrence, and the model's router losses."""
    first = torch.randint(16, alphabet, (batch, length))
    tokens = torch.cat([first, first], dim=1)
    out = model(tokens[:, :-1])
    logits = out.logits_BTV[:, length - 1 :]
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, length:].reshape(-1))
    return ce, out.aux_loss + out.z_loss


def induction_warmup(model: Transformer, max_steps: int, lr: float) -> int:
    """Train on `induction_loss` until it is under 0.3; returns the steps taken."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    for step in range(1, max_steps + 1):
        loss, router_loss = induction_loss(model)
        optimizer.zero_grad(set_to_none=True)
        (loss + router_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if loss.item() < 0.3:
            return step
    return max_steps


def expert_answer(old: str, new: str) -> dict:
    text, calls = rename_step(old, new)
    return {
        "role": "assistant",
        "content": text,
        "tool_calls": [
            {"id": f"call_0_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for i, (name, args) in enumerate(calls)
        ],
    }


def example(rng: random.Random, tokenizer, short: bool) -> tuple[list[int], list[int]]:
    messages, old, new = conversation(rng, short)
    return encode_chat_with_mask(tokenizer, messages + [expert_answer(old, new)], None if short else tool_schemas())


def copied_command(text: str) -> str | None:
    """The `command` of the first `run` call in a generated turn, as the harness would run it (JSON-decoded)."""
    for call in PARSERS["codefleet"].parse(text).tool_calls:
        if call["name"] == "run":
            try:
                return json.loads(call["arguments_json"]).get("command")
            except (json.JSONDecodeError, AttributeError):
                return None
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--short", action="store_true", help="instruction only: no system prompt, no tool schemas")
    ap.add_argument(
        "--induction",
        type=int,
        default=0,
        metavar="N",
        help="first train up to N steps on copying repeated random tokens (induction heads)",
    )
    ap.add_argument(
        "--prev-tokens",
        type=int,
        default=CopyConfig.prev_tokens,
        metavar="K",
        help="the model's previous-token embeddings (CopyConfig.prev_tokens; 0 = none, as in the "
        "runs before 2026-12-03)",
    )
    ap.add_argument("--copy-head", action="store_true", help="the model's pointer-generator output (CopyConfig.head)")
    ap.add_argument(
        "--copy-scope",
        choices=["all", "prompt"],
        default="all",
        help="what the copy head may point at (CopyConfig.scope)",
    )
    ap.add_argument(
        "--copy-match",
        action="store_true",
        help="the copy head also scores where the context repeats the last tokens (CopyConfig.match)",
    )
    ap.add_argument(
        "--induction-mix",
        type=float,
        default=0.0,
        metavar="W",
        help="add W x the induction loss to every probe step (keeps the heads from being overwritten)",
    )
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    tokenizer = default_tokenizer()
    copy = CopyConfig(prev_tokens=args.prev_tokens, head=args.copy_head, scope=args.copy_scope, match=args.copy_match)
    model = Transformer(ModelConfig.tiny(vocab_size=tokenizer.vocab_size, copy=copy))
    if args.induction:
        started = time.perf_counter()
        steps = induction_warmup(model, args.induction, args.lr)
        print(f"induction warm-up: {steps} steps ({time.perf_counter() - started:.0f} s)", flush=True)
    trainer = Trainer(model, TrainConfig(lr=args.lr, warmup_steps=5, decay_steps=args.steps))
    rng, held_out = random.Random(0), random.Random(123)
    probes = []
    for _ in range(20):
        messages, old, new = conversation(held_out, args.short)
        probes.append(
            (encode_chat(tokenizer, messages, None if args.short else tool_schemas()), rename_command(old, new))
        )
    # the metric must accept the expert's own answer, decoded as generated text is (until 2026-12-03 it compared
    # the raw command with the JSON-escaped text, which never matched: every earlier "0 of 20" was that)
    ids, mask = encode_chat_with_mask(tokenizer, [{"role": "user", "content": "x"}, expert_answer("a_b", "c_d")], None)
    assert copied_command(tokenizer.decode([t for t, m in zip(ids, mask) if m])) == rename_command("a_b", "c_d")
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        metrics = trainer.forward_backward_sft([example(rng, tokenizer, args.short) for _ in range(args.batch)])
        if args.induction_mix:  # keep the induction heads trained: its gradient joins this step's
            loss, router_loss = induction_loss(model)
            (args.induction_mix * loss + router_loss).backward()
        trainer.optim_step()
        if step % args.every and step != args.steps:
            continue
        model.eval()
        with Engine(model, tokenizer, max_batch=len(probes)) as engine:
            results = engine.generate([ids for ids, _ in probes], SamplingParams(max_tokens=100, temperature=0))
        model.train()
        copied = sum(
            copied_command(tokenizer.decode(r.token_ids)) == command for r, (_, command) in zip(results, probes)
        )
        kept = ""
        if args.induction or args.induction_mix:
            with torch.no_grad():
                kept = f", induction ce {induction_loss(model)[0].item():.2f}"
        print(
            f"step {step}: assistant ce {metrics['ce']:.3f}, exact commands {copied}/{len(probes)}{kept} "
            f"({time.perf_counter() - started:.0f} s); e.g. {tokenizer.decode(results[0].token_ids)[:160]!r}",
            flush=True,
        )


if __name__ == "__main__":
    main()
