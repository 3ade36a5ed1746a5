"""The text side of a policy: tokenizers, chat templates and the tool-call parser.

    tokenizer, fmt = formats.for_checkpoint("runs/ckpt")   # codefleet's or a Hugging Face checkpoint's
    ids = fmt.encode_chat(tokenizer, messages, tools)      # the prompt, ready for an engine
    turn = fmt.parse_tool_calls(text, "call_0_")           # ParsedTurn(content, tool_calls, errors)

Modules: tokenizer.py (codefleet's byte-level BPE, and a Hugging Face checkpoint's own tokenizer),
codefleet_template.py (codefleet's chat template: messages and tools <-> text and ids), formats.py (the
chat format of a checkpoint: codefleet's template or the checkpoint's own Jinja one), tool_parser.py (the
one parser of the tool calls a model writes, by format; the engine's tool-call grammar constrains
between the same markers). It knows nothing of models or sandboxes: a tokenizer and a template are text.
"""
