"""Serving a model: codefleet's engine, its caches, sampling and tool-call grammar, the vLLM backend
and the OpenAI-compatible server.

    engine = Engine.load("runs/ckpt")
    result = engine.generate([prompt_ids], SamplingParams(max_tokens=64))[0]
    engine.update_weights(state_dict, version=3)          # between decode steps, requests in flight

Modules: engine.py (continuous batching, token-in token-out results with logprobs, policy versions and
routed experts), request.py (a request and its result), next_token.py (sampling each row's next token under
the grammar), validation.py (the size and prompt checks both engines make), cache.py (the slot KV cache),
prefix_cache.py, sampling.py, grammar.py and turn_matcher.py (constrained decoding of tool calls),
weight_swap.py (new weights while serving), fast.py (the model's math computed faster with gradients off: the
engine and the trainer's scoring pass it to `Transformer.forward`), vllm_engine.py and vllm_weights.py (vLLM as
the engine backend), openai_request.py, server.py and serve_cli.py (`codefleet serve`). It knows nothing of
sandboxes or agents.
"""
