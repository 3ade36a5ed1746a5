"""codefleet's chat template: OpenAI-style messages and tools <-> text and token ids.

One conversation renders as

    <|bos|><|system|>You are ...<|end|>
    <|tools|>{"name": "read_file", "description": ..., "parameters": {...}}
    {"name": "run", ...}<|end|>
    <|user|>Task: ...<|end|>
    <|assistant|>Reading both files.<|tool_call|>{"name": "read_file", "arguments": {"path": "a.py"}}<|/tool_call|>
    <|tool_call|>{...}<|/tool_call|><|end|>
    <|tool|>     1	import os ...<|end|>
    <|tool|>...<|end|>
    <|assistant|>                                   <- the generation prompt

(no newlines between blocks: the special tokens delimit them). The tools
block (one JSON function schema per line) follows the leading system
message(s). Tool results come in the order of the calls they answer, so a
`<|tool|>` block carries no id. An assistant turn ends with `<|end|>`: that
is the stop token (`STOP`); the engine also stops on `<|eos|>`.

Special tokens enter the ids only where this template puts them: every
piece of message text is encoded as plain text (`Tokenizer.encode`), so a
user or a tool result that contains the string "<|tool_call|>" gets
ordinary byte tokens, never the special id. `encode_chat` and
`tokenizer.encode(render(...), allow_special=True)` give the same ids as
long as no message text spells a special token.

`encode_chat_with_mask` is the SFT view: mask 1 exactly on the tokens the
assistant wrote (its content, its tool calls and the `<|end|>` closing its
turn), 0 on the prompt, the role tokens, tool results and everything else.

Tool calls the model writes in this template are parsed by `tool_parser.PARSERS["codefleet"]`.
Inside a rendered call, "<|" is written "<\\u007c" (the same JSON value), so arguments that mention a
special token cannot end the block early.
"""

from __future__ import annotations

import json
from typing import NamedTuple, Protocol

BOS = "<|bos|>"
EOS = "<|eos|>"
END = "<|end|>"
SYSTEM = "<|system|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
TOOL = "<|tool|>"
TOOLS = "<|tools|>"
CALL_OPEN = "<|tool_call|>"
CALL_CLOSE = "<|/tool_call|>"

ROLE_TOKENS = {"system": SYSTEM, "user": USER, "assistant": ASSISTANT, "tool": TOOL}
STOP = [END, EOS]  # strings (and, via stop_ids, token ids) that end an assistant turn

# Prompt styles a policy is trained and served with: "full", the system prompt and tool schemas (what any
# model needs to use the agent harness); "bare", the conversation alone, for a policy trained on the harness
# from its demonstrations. A checkpoint records its style (checkpoint.usage); the server renders requests in it.
PROMPTS = ("full", "bare")


def check_prompt(prompt: str) -> str:
    """`prompt` if it is a prompt style, else a ValueError naming the styles."""
    if prompt not in PROMPTS:
        raise ValueError(
            f"prompt {prompt!r} is not a prompt style; use 'full' (system prompt and tool schemas) "
            "or 'bare' (the task alone, for a policy trained on this harness)"
        )
    return prompt


class Piece(NamedTuple):
    text: str
    special: bool  # one special token (text is its string)
    assistant: bool  # written by the assistant (loss mask 1)


class Encoder(Protocol):
    """What the template needs of a tokenizer (`tokenizer.Tokenizer` and a checkpoint's own both have it)."""

    def encode(self, text: str) -> list[int]: ...

    def special_id(self, token: str) -> int: ...


# -- rendering ---------------------------------------------------------------------------


def _text(content: object) -> str:
    """Message content as text: a string, None, or a list of OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def _call_json(call: dict) -> str:
    """`{"name": ..., "arguments": ...}` for one OpenAI tool call, arguments as the model wrote them."""
    function = call.get("function", call)
    raw = function.get("arguments")
    if isinstance(raw, dict):
        raw = json.dumps(raw, ensure_ascii=False)
    if not isinstance(raw, str) or not raw.strip():
        raw = "{}"
    text = f'{{"name": {json.dumps(function.get("name", ""), ensure_ascii=False)}, "arguments": {raw}}}'
    # "<|" can only occur inside JSON strings, where "<\u007c" means the same: a call that edits text holding
    # "<|/tool_call|>" (codefleet's own codefleet_template.py, say) cannot end its block early.
    return text.replace("<|", "<\\u007c")


def _tools_text(tools: list[dict]) -> str:
    return "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)


def pieces(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> list[Piece]:
    """The conversation as a flat list of text and special-token pieces (what render and encode share)."""
    out = [Piece(BOS, True, False)]
    tools_done = not tools

    def emit_tools() -> None:
        nonlocal tools_done
        out.extend([Piece(TOOLS, True, False), Piece(_tools_text(tools or []), False, False), Piece(END, True, False)])
        tools_done = True

    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLE_TOKENS:
            raise ValueError(
                f"message {i} has role {role!r}; the chat template knows "
                f"{', '.join(ROLE_TOKENS)} (OpenAI chat messages)"
            )
        if role != "system" and not tools_done:
            emit_tools()
        mine = role == "assistant"
        out.append(Piece(ROLE_TOKENS[role], True, False))
        out.append(Piece(_text(message.get("content")), False, mine))
        calls = (message.get("tool_calls") or []) if mine else []
        for call in calls:
            out += [Piece(CALL_OPEN, True, True), Piece(_call_json(call), False, True), Piece(CALL_CLOSE, True, True)]
        out.append(Piece(END, True, mine))
    if not tools_done:
        emit_tools()
    if add_generation_prompt:
        out.append(Piece(ASSISTANT, True, False))
    return [p for p in out if p.text]


def render(messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True) -> str:
    """The conversation as template text (special tokens spelled out)."""
    return "".join(p.text for p in pieces(messages, tools, add_generation_prompt))


def encode_chat_with_mask(
    tokenizer: Encoder, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation and a loss mask: 1 on the assistant's own tokens, 0 elsewhere."""
    ids: list[int] = []
    mask: list[int] = []
    for piece in pieces(messages, tools, add_generation_prompt):
        piece_ids = [tokenizer.special_id(piece.text)] if piece.special else tokenizer.encode(piece.text)
        ids += piece_ids
        mask += [int(piece.assistant)] * len(piece_ids)
    return ids, mask


def encode_chat(
    tokenizer: Encoder, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True
) -> list[int]:
    """Token ids of the conversation; with the generation prompt, ready for the model to write a turn."""
    return encode_chat_with_mask(tokenizer, messages, tools, add_generation_prompt)[0]


def stop_ids(tokenizer: Encoder) -> list[int]:
    """The token ids that end an assistant turn."""
    return [tokenizer.special_id(s) for s in STOP]
