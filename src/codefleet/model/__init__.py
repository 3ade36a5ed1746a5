"""The mixture-of-experts policy: model, tokenizer and chat template, inference
engine and OpenAI-compatible server.

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
  each sequence (engine.py owns it). Without a cache the model runs causal
  SDPA over the given tokens (training).
- `tokenizer.Tokenizer` (byte-level BPE, special tokens that user text can
  never forge); `chat.render(messages, tools) -> str`,
  `chat.encode_chat(tokenizer, messages, tools) -> ids` and
  `chat.parse_tool_calls(text) -> ParsedTurn(content, tool_calls, errors)`.
- `engine.Engine`: batched generation with continuous batching, results with
  token ids, logprobs, policy versions and routed experts;
  `update_weights(state_dict, version)` between decode steps.
"""
