"""Serving a model: codefleet's engine, its caches, sampling and tool-call grammar, the vLLM backend
and the OpenAI-compatible server.

    engine = Engine.load("runs/ckpt")
    result = engine.generate([prompt_ids], SamplingParams(max_tokens=64))[0]
    engine.update_weights(state_dict, version=3)          # between decode steps, requests in flight

Modules: engine.py (continuous batching, token-in token-out results with logprobs, policy versions and
routed experts), cache.py (the slot KV cache), prefix_cache.py, sampling.py,
grammar.py (constrained decoding of tool calls), weight_swap.py (new weights while serving), fast.py
(the model's math computed faster with gradients off: the engine and the trainer's scoring pass it to
`Transformer.forward`), vllm_engine.py (vLLM as the engine backend), server.py and serve_cli.py
(`codefleet serve`). It knows nothing of sandboxes or agents.
"""
