"""The model's math: codefleet's mixture-of-experts transformer and the Hugging Face architectures it
loads (Qwen3, Qwen3-MoE, Llama), and checkpoints in and out.

Seams between the parts (keep them stable):

- `config.ModelConfig`: one typed dataclass; `ModelConfig.tiny()` trains in
  minutes on 2 CPU cores.
- `transformer.Transformer.forward(tokens_BT, positions_BT=None, cache=None,
  routing_replay=None, return_routing=False) -> ModelOutput` with
  `ModelOutput(logits_BTV, routed_experts, aux_loss, z_loss)`;
  `routed_experts` is one `[B, T, top_k]` int tensor per MoE layer, and
  `routing_replay` takes the same structure to force the experts (R3).
- `cache`: an object with `attend(layer, q_BHTD, k_BHTD, v_BHTD) -> out_BHTD`
  that stores the new keys/values and attends over everything cached for
  each sequence (`codefleet.inference.cache` is the engine's). Without a cache
  the model runs causal SDPA over the given tokens (training).
- `checkpoint.save/load`: a self-describing directory (`hf.py` for the Hugging
  Face layout); `expert_parallel.py` shards the experts across ranks;
  `kernels.py` builds the native CPU kernels in `csrc/`.

How the model is served (the engine, sampling, the server) is `codefleet.inference`; its text side
(tokenizer, chat templates, tool-call parsing) is `codefleet.chat`.
"""
