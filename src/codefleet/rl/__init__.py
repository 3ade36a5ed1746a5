"""RL algorithms in pure PyTorch (no Ray): advantages, policy losses, SFT, the trainer's logprobs.

- `advantages`: GRPO, Dr.GRPO, RLOO over groups of attempts; zero-variance groups.
- `losses`: PPO-clip (clip-higher), GSPO, decoupled PPO / truncated IS for stale tokens, k3 KL,
  token- or sequence-mean reduction, selected by `LossConfig`; `add_moe_losses`.
- `sft`: cross-entropy on the assistant's tokens; padded batches.
- `logprobs`: `forward_logprobs` (per-token logprobs, routing replay) and the engine-routing conversion.
- `batch`: rollouts (`Sample`) -> padded `RLBatch`; `rl_loss` = policy loss + router losses under the model.
- `trainer`: `Trainer` (Tinker API: forward_backward_sft / _rl, optim_step, save / load, weights) with
  gradient accumulation that gives the one-batch gradient, and sums across data-parallel ranks.
- `rewards`: group rewards of trajectories (calls `codefleet.agent.reward.compute_reward`).
"""
