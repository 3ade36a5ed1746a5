"""What every engine backend refuses, with the same sentence (codefleet's `engine.Engine` and
`vllm_engine.VLLMEngine`): a batch or sequence size it cannot run, and a prompt it cannot take."""

from __future__ import annotations


def check_sizes(max_batch: int, max_seq_len: int | None) -> None:
    """Raise ValueError unless `max_batch` holds a request and `max_seq_len` (None: the model's) a prompt
    token and a generated one."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    if max_seq_len is not None and max_seq_len < 2:
        raise ValueError(f"max_seq_len must be at least 2 (a prompt token and a generated one), got {max_seq_len}")


def check_prompt(prompt: list[int], vocab_size: int, max_seq_len: int) -> None:
    """Raise ValueError naming the problem and the fix for an empty prompt, a token id outside the model's
    vocabulary, or a prompt that leaves no room for a generated token."""
    if not prompt:
        raise ValueError("the prompt is empty; give at least one token")
    bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(
            f"the prompt holds token id {bad} but the model's vocabulary is 0..{vocab_size - 1}; "
            "encode the prompt with the model's tokenizer"
        )
    if len(prompt) >= max_seq_len:
        raise ValueError(
            f"the prompt has {len(prompt)} tokens but the engine holds at most {max_seq_len} "
            "per sequence (prompt + completion); shorten it or raise max_seq_len"
        )
