"""Fresh names for demonstrations: which names, renamed consistently everywhere, nothing else touched."""

from __future__ import annotations

import json
import random
import re

from codefleet.agent.clients.scripted import rename_command, rename_step
from codefleet.recipe.augment import fresh_names, task_names


def _rename_episode() -> list[dict]:
    text, calls = rename_step("passed_count", "number_passed")
    return [
        {
            "role": "user",
            "content": "Task:\nRename `passed_count` in `gradebook/grading.py` to `number_passed`. "
            "The test `tests/test_grading.py::test_passed_count_0` uses it; `max` is fine.",
        },
        {
            "role": "assistant",
            "content": text,
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
                for name, args in calls
            ],
        },
        {
            "role": "tool",
            "tool_call_id": "c0",
            "content": "gradebook/grading.py:11:def passed_count(scores):\n"
            "tests/test_grading.py:14:def test_passed_count_0():",
        },
    ]


def test_task_names_are_backticked_identifiers_and_path_parts():
    text = (
        "`volumetric_weight` in `parcelpost/rates.py` is wrong: `volumetric_weight(50, 40)` returns `50.24`; "
        "`tests/test_rates.py::test_volumetric_weight_0` shows it. `max`, `if` and `ab` stay."
    )
    assert task_names(text) == ["volumetric_weight", "parcelpost", "rates"]
    assert task_names("no names here") == []


def test_every_name_is_renamed_consistently_and_nothing_else():
    before = _rename_episode()
    after = fresh_names(before, random.Random(0))
    assert before == _rename_episode()  # the input is not modified
    old = ["passed_count", "number_passed", "gradebook", "grading"]
    everything = json.dumps(after)
    for name in old:
        assert not re.search(rf"(?<![A-Za-z0-9_]){name}(?![A-Za-z0-9_])", everything), name
    task = after[0]["content"]
    new_old, new_new = re.findall(r"`([a-z_]+)`", task)[:2]
    # the call is the expert's call for the new names: `\bNAME\b` inside the sed expression was renamed too
    call = json.loads(after[1]["tool_calls"][0]["function"]["arguments"])
    assert call == {"command": rename_command(new_old, new_new)}
    assert after[1]["content"] == rename_step(new_old, new_new)[0]
    # parts of longer words (a test id) and anything outside the task's backticks are untouched
    assert "test_passed_count_0" in task and "test_passed_count_0" in after[2]["content"]
    assert f"def {new_old}(scores)" in after[2]["content"] and "`max`" in task
    assert fresh_names(before, random.Random(0)) == after  # the names come from the rng
    assert fresh_names(before, random.Random(1)) != after


def test_a_conversation_without_names_is_returned_as_is():
    messages = [{"role": "user", "content": "Make the tests pass."}]
    assert fresh_names(messages, random.Random(0)) is messages


def test_sft_batches_show_demonstrations_and_first_turns_with_new_names():
    from codefleet.chat.tokenizer import default_tokenizer
    from codefleet.recipe.config import SFTSection
    from codefleet.recipe.demos import Demos
    from codefleet.recipe.train import sft_batch

    tokenizer = default_tokenizer()
    conversation = _rename_episode() + [
        {
            "role": "assistant",
            "content": "Done.",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "submit", "arguments": "{}"}}],
        }
    ]
    demos = Demos(prompt="bare", conversations=[conversation])
    demos.examples = [demos.encode(tokenizer, conversation)]
    batch = sft_batch(demos, [0], SFTSection(fresh_names=True, first_turns=3), random.Random(0), tokenizer, 4096)
    assert len(batch) == 4
    texts = [tokenizer.decode(ids) for ids, _ in batch]
    assert not any(re.search(r"\bpassed_count\b", t) for t in texts) and len(set(texts)) == 4  # new every time
    whole, first = batch[0], batch[1]
    assert tokenizer.decode(whole[0]).count("<|assistant|>") == 2 and "<|tools|>" not in texts[0]  # bare
    assert tokenizer.decode(first[0]).count("<|assistant|>") == 1 and first[1][-1] == 1  # ends with its turn
    as_recorded = sft_batch(demos, [0], SFTSection(fresh_names=False), random.Random(0), tokenizer, 4096)
    assert as_recorded == demos.examples
