"""SFT: padded next-token batches, cross-entropy on assistant tokens only, one optimiser step lowers the loss."""

import math

import torch

from codefleet.chat.codefleet_template import encode_chat_with_mask
from codefleet.chat.tokenizer import default_tokenizer
from codefleet.model.config import ModelConfig
from codefleet.model.transformer import Transformer
from codefleet.rl.sft import pad_batch, sft_loss, sft_step_loss


def _tiny() -> ModelConfig:
    return ModelConfig(
        vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, n_experts=4, top_k=2, d_expert=16
    )


def test_pad_batch_shifts_targets_and_mask_by_hand():
    batch = pad_batch([([5, 6, 7, 8], [0, 0, 1, 1]), ([9, 10], [0, 1])], pad_id=0)
    assert batch.tokens_BT.tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch.targets_BT.tolist() == [[6, 7, 8], [10, 0, 0]]
    assert batch.loss_mask_BT.tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch.positions_BT.tolist() == [[0, 1, 2], [0, 1, 2]]


def test_sft_loss_is_hand_cross_entropy_on_masked_targets_only():
    # position 0: softmax([0, ln 2, ln 3]) = [1, 2, 3] / 6, target 2 -> -ln(1/2) = ln 2
    # position 1: uniform over 3, any target -> ln 3 ; position 2 is masked out
    logits = torch.tensor([[[0.0, math.log(2), math.log(3)], [0.0, 0.0, 0.0], [5.0, -3.0, 1.0]]], requires_grad=True)
    targets = torch.tensor([[2, 0, 1]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = sft_loss(logits, targets, mask)
    torch.testing.assert_close(loss, torch.tensor((math.log(2) + math.log(3)) / 2))
    changed = logits.detach().clone()
    changed[0, 2] = torch.tensor([-9.0, 7.0, 0.5])
    torch.testing.assert_close(sft_loss(changed, targets, mask), loss.detach())
    loss.backward()
    assert torch.equal(logits.grad[0, 2], torch.zeros(3))


def test_chat_mask_puts_the_loss_exactly_on_assistant_tokens():
    tok = default_tokenizer()
    messages = [{"role": "user", "content": "fix it"}, {"role": "assistant", "content": "done"}]
    ids, mask = encode_chat_with_mask(tok, messages)
    batch = pad_batch([(ids, mask)])
    assistant_targets = batch.targets_BT[0][batch.loss_mask_BT[0].bool()].tolist()
    assert assistant_targets == [i for i, m in zip(ids, mask) if m]  # every assistant token, nothing else
    assert tok.decode(assistant_targets) == "done<|end|>"


def test_one_sft_step_lowers_the_loss_on_a_tiny_model():
    torch.manual_seed(0)
    model = Transformer(_tiny())
    g = torch.Generator().manual_seed(1)
    examples = []
    for n in (12, 7, 9):
        ids = torch.randint(1, 61, (n,), generator=g).tolist()
        examples.append((ids, [0] * 3 + [1] * (n - 3)))
    batch = pad_batch(examples)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss, metrics = sft_step_loss(model, batch)
    assert metrics["tokens"] == (12 - 3) + (7 - 3) + (9 - 3)
    assert metrics["aux_loss"] > 0 and loss.item() > metrics["ce"]  # router losses are in the loss
    loss.backward()
    opt.step()
    with torch.no_grad():
        after, _ = sft_step_loss(model, batch)
    assert after.item() < loss.item() - 1e-3
