"""The trainer: SFT and RL steps on the MoE policy, in the Tinker API shape (pure PyTorch, no Ray).

    trainer = Trainer(model, TrainConfig(lr=3e-4))
    trainer.forward_backward_rl(samples)      # accumulate gradients (any number of calls)
    trainer.optim_step()                      # clip, AdamW, router bias, version += 1
    trainer.save("ckpt/")  /  Trainer.load("ckpt/", config, device="cuda")
    engine.update_weights(trainer.weights(), trainer.version)
    trainer.logprobs(samples)                 # per-token logprobs now, to compare with the engine's

The trainer runs on its model's device (CPU, or a GPU: move the model before
building the trainer, or `load(..., device=)`); batches are moved there and
`weights()` comes back on CPU. MoE layers on a GPU take the pure-PyTorch path
(`model.moe`: the native kernels are CPU-only).

Gradient accumulation. A call packs its examples into micro-batches of at
most `micro_batch_tokens` padded tokens (least padding, `pack`), runs
forward + backward on each and lets the gradients add up. The losses of
`rl.sft` and `rl.losses` are means *within* the batch they see, so each
micro-batch's loss is multiplied by `its units / total units of the step`;
the sum of the scaled micro-batch losses is then the loss of the whole step
as one batch, and so are the gradients (tests check 1e-5). The unit is what
the loss averages over:

- SFT and RL `reduction="token_mean"`: masked tokens (the trained targets);
- RL `reduction="seq_mean"`: sequences (every sample counts, as in
  `losses.masked_reduce`);
- GSPO (`ratio_level="sequence"`): sequences with at least one masked token.

`total_tokens` (default: the units of this call) is that count for the
*whole step*: pass it when a step is split over several calls or over
data-parallel workers (`fleet.trainer_group` passes the full batch's count to
each worker, then sums the gradients). `loss_units` / `sft_units` compute it.
Despite the name, for sequence-mean losses it counts sequences.

The MoE router losses (aux, z) are statistics of the tokens a forward sees
(padding included), so they are exact only per micro-batch: each
micro-batch's router loss gets the same weight as its policy loss, making the
step's router loss a weighted mean of the micro-batch ones. With
`balance="bias"` the expert loads counted in every forward are summed across
workers (`all_reduce`) before `optim_step` moves the bias.

Off-policy losses (`LossConfig.off_policy` "decoupled" / "tis") need the
proximal policy's logprobs: the weights at the start of this step, i.e. the
current weights, since they change only in `optim_step`. They are computed
per micro-batch under `torch.no_grad()` through the inference fast path
(`codefleet.inference.fast`, as the engine computes them) in eval mode, so
that the scoring forward does not count expert loads. KL
(`LossConfig.kl_coef > 0`) is to a frozen copy of the weights the trainer
started from (saved with the checkpoint, so a resumed run keeps its
reference). Routing replay (R3) applies when `TrainConfig.routing_replay` is
on and every sample of a micro-batch carries the engine's `routed_experts`;
the proximal and reference forwards replay the same routing.

Checkpoints are `model.checkpoint`'s directory (weights, config, metadata
with `policy_version`) plus `trainer.pt` (optimizer state, RNG, version) and
`reference/` when there is a KL reference. `save` writes a sibling temporary
directory and renames it into place, so a crash leaves the old checkpoint or
the new one, never half of one. `load` also accepts a plain model checkpoint
(an SFT result): the optimizer then starts fresh.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from codefleet.inference import fast
from codefleet.model import checkpoint
from codefleet.model.transformer import Transformer
from codefleet.rl.batch import Sample, collate, rl_loss
from codefleet.rl.logprobs import forward_logprobs
from codefleet.rl.losses import LossConfig
from codefleet.rl.sft import pad_batch, sft_step_loss
from codefleet.store import safe_files

TRAINER_FILE, REFERENCE_DIR = "trainer.pt", "reference"
Example = tuple[list[int], list[int]]  # (token ids, mask 1 on the assistant's tokens)


@dataclass
class TrainConfig:
    lr: float = 3e-4
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8  # AdamW's
    grad_clip: float = 1.0  # max global gradient norm; 0 = no clipping (the norm is still reported)
    micro_batch_tokens: int = 8192  # padded tokens (rows x longest row) per forward; a longer sample goes alone
    loss: LossConfig = field(default_factory=LossConfig)  # RL loss; `loss.kl_coef > 0` keeps a reference model
    routing_replay: bool = True  # R3: replay the engine's routing when the samples carry it
    seed: int = 0  # torch's global RNG is seeded with it (saved and restored with checkpoints)
    warmup_steps: int = 0  # linear warm-up of the learning rate over the first steps
    decay_steps: int = 0  # cosine decay to lr * min_lr_ratio at this step (0: constant after warm-up)
    min_lr_ratio: float = 0.1

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based). A pure function of the step, so a resumed
        trainer continues the schedule from its version with no scheduler state to save."""
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_steps <= self.warmup_steps:
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps))
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def __post_init__(self) -> None:
        if isinstance(self.loss, dict):  # from YAML / JSON
            self.loss = LossConfig(**self.loss)
        self.betas = tuple(self.betas)
        if self.lr <= 0 or self.micro_batch_tokens < 1 or self.grad_clip < 0:
            raise ValueError("TrainConfig: need lr > 0, micro_batch_tokens >= 1 and grad_clip >= 0")


# ---- units of the loss and packing (pure functions) ----------------------------------


def sft_units(examples: Sequence[Example]) -> int:
    """Trained targets of SFT examples: the mask shifted by one (the first token predicts nothing)."""
    return int(sum(sum(mask[1:]) for _, mask in examples))


def loss_units(samples: Sequence[Sample], loss: LossConfig) -> int:
    """What `loss`'s reduction averages over in these samples: masked tokens, sequences (seq_mean) or
    sequences with a masked token (GSPO). See the module docstring."""
    if loss.ratio_level == "sequence":
        return sum(1 for s in samples if any(s.loss_mask))
    if loss.reduction == "seq_mean":
        return len(samples)
    return int(sum(sum(s.loss_mask) for s in samples))


def has_signal(samples: Sequence[Sample], loss: LossConfig) -> bool:
    """Whether an RL step on `samples` has a gradient worth taking: a non-zero advantage, or a KL term. Without
    one, the router losses alone would move every weight a full Adam step toward expert balance (a demo's
    policy drifted from ~5.5 turns to ~1.5 in 16 such steps); `skip_step` counts the step instead."""
    return loss.kl_coef > 0 or any(s.advantage != 0 for s in samples)


def check_examples(examples: Sequence[Example]) -> None:
    """Raise ValueError, naming the example, unless each has ids and mask of the same length >= 2."""
    for i, (ids, mask) in enumerate(examples):
        if len(ids) != len(mask) or len(ids) < 2:
            raise ValueError(f"example {i}: ids and mask need the same length >= 2, got {len(ids)} and {len(mask)}")


def check_samples(samples: Sequence[Sample]) -> None:
    """Raise ValueError, naming the sample, unless its per-token lists line up and its first token is unmasked."""
    for i, s in enumerate(samples):
        if not (len(s.tokens) == len(s.loss_mask) == len(s.behave_logprobs)) or not s.tokens:
            raise ValueError(
                f"sample {i}: tokens, loss_mask and behave_logprobs need the same non-zero length, got "
                f"{len(s.tokens)}, {len(s.loss_mask)}, {len(s.behave_logprobs)}"
            )
        if s.loss_mask[0]:
            raise ValueError(f"sample {i}: the first token has no prediction to train; its loss_mask must be 0")
        if s.routed_experts is not None and len(s.routed_experts) > len(s.tokens):
            raise ValueError(f"sample {i}: routing for {len(s.routed_experts)} tokens but only {len(s.tokens)} tokens")


def pack(lengths: Sequence[int], max_tokens: int, overhead: int = 256) -> list[list[int]]:
    """Indices grouped into micro-batches whose padded size (rows x longest row) is at most `max_tokens`, with
    the least padded tokens + `overhead` per micro-batch (the fixed cost of a forward, in tokens). Sorted
    longest first, the best split into consecutive runs is a small dynamic programme; an item longer than
    `max_tokens` gets a micro-batch of its own. (Greedy filling padded an SFT step's 4 demonstrations and 8
    first turns to 2.1x their tokens, this to 1.1x.)"""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    longest = [lengths[i] for i in order]
    cost = [0.0] + [math.inf] * len(order)  # cost[j]: the cheapest packing of the j longest
    start = [0] * (len(order) + 1)  # start[j]: where the last micro-batch of that packing starts
    for j in range(1, len(order) + 1):
        for i in range(j - 1, -1, -1):  # the last micro-batch is order[i:j], padded to longest[i]
            rows = j - i
            if rows > 1 and rows * longest[i] > max_tokens:
                break  # earlier starts are longer and have more rows
            c = cost[i] + overhead + rows * longest[i]
            if c < cost[j]:
                cost[j], start[j] = c, i
    batches, j = [], len(order)
    while j:
        batches.append(order[start[j] : j])
        j = start[j]
    return batches[::-1]


def to_device(batch, device: torch.device):
    """A batch dataclass with its tensors (and lists of tensors) on `device`."""

    def move(x):
        if isinstance(x, list):
            return [t.to(device) for t in x]
        return x.to(device) if isinstance(x, torch.Tensor) else x

    return dataclasses.replace(batch, **{f.name: move(getattr(batch, f.name)) for f in dataclasses.fields(batch)})


class _MetricMean:
    """Weighted means of the micro-batches' metrics (weight = the micro-batch's share of the units)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weight = 0.0

    def add(self, metrics: dict[str, float], weight: float) -> None:
        self.weight += weight
        for k, v in metrics.items():
            self.sums[k] = self.sums.get(k, 0.0) + weight * float(v)

    def means(self) -> dict[str, float]:
        return {k: v / self.weight for k, v in self.sums.items()} if self.weight > 0 else {}


class Trainer:
    """AdamW on a `Transformer`, with token-exact gradient accumulation. See the module docstring."""

    sharded = False  # capability (codefleet.contracts.TRAINERS): each worker holds the whole model

    def __init__(self, model: Transformer, config: TrainConfig | None = None, version: int = 0):
        self.model = model.train()
        self.config = config or TrainConfig()
        self.version = int(version)
        torch.manual_seed(self.config.seed)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
        )
        self.reference: Transformer | None = None
        if self.config.loss.kl_coef > 0:
            self.reference = copy.deepcopy(model).eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.params[0].device

    # ---- forward + backward ----------------------------------------------------------

    def forward_backward(self, batch: list, loss: str, total_tokens: int | None = None) -> dict[str, float]:
        """The contract's entry (codefleet.contracts.Trainer): `loss` "sft" takes Examples, "rl" Samples."""
        if loss == "sft":
            return self.forward_backward_sft(batch, total_tokens)
        if loss == "rl":
            return self.forward_backward_rl(batch, total_tokens)
        raise ValueError(f"loss must be 'sft' or 'rl', got {loss!r}")

    def forward_backward_sft(self, examples: list[Example], total_tokens: int | None = None) -> dict[str, float]:
        """Cross-entropy on the assistant's tokens; gradients accumulate. `total_tokens`: trained targets of the
        whole step (default: of these examples). Returns `loss` (this call's share of the step's loss: the batch
        loss when total_tokens is None), token-weighted ce / aux_loss / z_loss, and counts."""
        check_examples(examples)
        units = [sft_units([ex]) for ex in examples]
        total = self._total(sum(units), total_tokens)
        mean, loss_sum = _MetricMean(), 0.0
        micro = pack([len(ids) - 1 for ids, _ in examples], self.config.micro_batch_tokens)
        for idx in micro:
            batch = to_device(pad_batch([examples[i] for i in idx]), self.device)
            weight = sum(units[i] for i in idx) / total
            loss, metrics = sft_step_loss(self.model, batch)
            (loss * weight).backward()
            loss_sum += weight * float(loss.detach())
            metrics.pop("tokens")
            mean.add(metrics, weight)
        return {
            "loss": loss_sum,
            **mean.means(),
            "tokens": float(sum(units)),
            "loss_units": float(sum(units)),
            "sequences": float(len(examples)),
            "micro_batches": float(len(micro)),
        }

    def forward_backward_rl(self, samples: list[Sample], total_tokens: int | None = None) -> dict[str, float]:
        """The policy loss (`config.loss`) + router losses; gradients accumulate. `total_tokens`: the loss units of
        the whole step (`loss_units`; sequences for sequence-mean losses; default: of these samples). Returns
        `loss` (this call's share of the step's loss), the loss metrics weighted by units, and counts."""
        cfg, mcfg = self.config, self.model.config
        check_samples(samples)
        units = [loss_units([s], cfg.loss) for s in samples]
        total = self._total(sum(units), total_tokens)
        mean, loss_sum, replayed = _MetricMean(), 0.0, 0
        micro = pack([len(s.tokens) for s in samples], cfg.micro_batch_tokens)
        for idx in micro:
            batch = to_device(collate([samples[i] for i in idx], mcfg.n_moe_layers, mcfg.top_k), self.device)
            replay = cfg.routing_replay and batch.routing_replay is not None
            routing = batch.routing_replay if replay else None
            prox = self._score(self.model, batch, routing) if cfg.loss.off_policy != "none" else None
            ref = self._score(self.reference, batch, routing) if self.reference is not None else None
            weight = sum(units[i] for i in idx) / total
            loss, metrics = rl_loss(
                self.model, batch, cfg.loss, routing_replay=replay, prox_logprobs_BT=prox, ref_logprobs_BT=ref
            )
            (loss * weight).backward()
            loss_sum += weight * float(loss.detach())
            mean.add(metrics, weight)
            replayed += len(idx) if replay else 0
        tokens = float(sum(sum(s.loss_mask) for s in samples))
        return {
            "loss": loss_sum,
            **mean.means(),
            "tokens": tokens,
            "loss_units": float(sum(units)),
            "sequences": float(len(samples)),
            "micro_batches": float(len(micro)),
            "routing_replay_frac": replayed / max(len(samples), 1),
        }

    def _total(self, units: int, total_tokens: int | None) -> int:
        total = units if total_tokens is None else int(total_tokens)
        if total < units or total <= 0:
            raise ValueError(
                f"total_tokens={total_tokens} but these examples alone have {units} loss units (masked "
                "tokens, or sequences for sequence-mean losses): pass the whole step's count, which is "
                "at least this call's and positive; a batch with nothing masked cannot be trained on"
            )
        return total

    def logprobs(self, samples: list[Sample]) -> list[list[float]]:
        """Each sample's per-token logprobs under the current weights, as a step scores the proximal policy
        (`_score`, with the samples' routing when `routing_replay` is on): aligned with its tokens, 0 at the first
        token and where its loss_mask is 0, to compare with the engine's `behave_logprobs`. A sharded trainer's
        ranks must all call it with the same samples (its forward is a collective)."""
        check_samples(samples)
        mcfg = self.model.config
        out: list[list[float]] = [[] for _ in samples]
        for idx in pack([len(s.tokens) for s in samples], self.config.micro_batch_tokens):
            batch = to_device(collate([samples[i] for i in idx], mcfg.n_moe_layers, mcfg.top_k), self.device)
            routing = batch.routing_replay if self.config.routing_replay else None
            logprobs_BT = self._score(self.model, batch, routing).cpu()
            for row, i in enumerate(idx):
                out[i] = logprobs_BT[row, : len(samples[i].tokens)].tolist()
        return out

    @torch.no_grad()
    def _score(self, model: nn.Module, batch, routing) -> torch.Tensor:
        """Per-token logprobs under `model` without gradients, in eval mode (no expert-load counting)."""
        was_training = model.training
        model.eval()
        try:
            return forward_logprobs(model, batch.tokens_BT, batch.mask_BT, routing, fast=fast).logprobs_BT
        finally:
            model.train(was_training)

    # ---- data parallelism and the step -----------------------------------------------

    def gradients(self) -> list[torch.Tensor]:
        """Every trainable parameter's gradient, zeros where none was computed (so all ranks agree on the list)."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]

    def all_reduce(self, reduce_sum: Callable[[torch.Tensor], None]) -> None:
        """Sum this step's gradients and router expert loads across data-parallel ranks: `reduce_sum(t)` must
        replace `t` in place by its sum over ranks (e.g. `torch.distributed.all_reduce`). Gradients are already
        weighted by the whole step's units, so their sum is the full batch's gradient."""
        for tensors in (self.gradients(), [b for n, b in self.model.named_buffers() if n.endswith("load_E")]):
            if not tensors:
                continue
            flat = torch.cat([t.reshape(-1) for t in tensors])
            reduce_sum(flat)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def optim_step(self) -> dict[str, float]:
        """Clip the global gradient norm, AdamW step, zero the gradients, move the router bias
        (balance="bias"), version += 1. Returns grad_norm (before clipping), lr and the new version."""
        if all(p.grad is None for p in self.params):
            raise RuntimeError("optim_step without gradients: call forward_backward_sft/_rl first")
        grads = self.gradients()
        if self.config.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        return self._step(norm)

    def _step(self, norm: torch.Tensor) -> dict[str, float]:
        """The optimiser step at this version's learning rate once the gradients are final (clipped), then the
        router bias and the version; `norm` is the gradient norm reported."""
        for group in self.optimizer.param_groups:
            group["lr"] = self.config.lr_at(self.version)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.update_router_bias()
        self.version += 1
        return {"grad_norm": float(norm), "lr": self.optimizer.param_groups[0]["lr"], "version": float(self.version)}

    def skip_step(self) -> dict[str, float]:
        """Count a step that carries no gradient signal (`has_signal` is False) without moving any weight:
        version += 1, as `optim_step` would. Returns the same keys, grad_norm 0."""
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": 0.0, "lr": self.config.lr_at(self.version - 1), "version": float(self.version)}

    # ---- weights and checkpoints -----------------------------------------------------

    def weights(self, clone: bool = True) -> dict[str, torch.Tensor]:
        """The model's state dict, detached on CPU, for `Engine.update_weights`. `clone=False` may share memory
        with the live parameters (on CPU), which the next `optim_step` changes: serialise it at once."""
        state = {k: v.detach().cpu() for k, v in self.model.state_dict().items()}
        return {k: v.clone() for k, v in state.items()} if clone else state

    def save(self, path: str) -> None:
        """Weights, optimizer, RNG, version (and the KL reference), written atomically into directory `path`."""
        path = os.path.abspath(path)
        tmp, old = f"{path}.tmp-{os.getpid()}", f"{path}.old-{os.getpid()}"
        # a run directory may be prepared by someone else: a link planted at tmp (its name is predictable) is
        # removed, never followed, and every file goes in through safe_files (checkpoint.write_file)
        safe_files.remove_beneath(os.path.dirname(path), tmp, ignore_errors=True)
        checkpoint.save(
            self.model,
            tmp,
            metadata={"policy_version": self.version, "train_config": json.loads(json.dumps(asdict(self.config)))},
        )
        state = {"optimizer": self.optimizer.state_dict(), "rng": torch.get_rng_state(), "version": self.version}
        checkpoint.write_file(tmp, TRAINER_FILE, lambda f: torch.save(state, f))
        if self.reference is not None:
            checkpoint.save(self.reference, os.path.join(tmp, REFERENCE_DIR))
        checkpoint.swap_in(tmp, path, old)

    @classmethod
    def load(cls, path: str, config: TrainConfig | None = None, device: str | torch.device = "cpu") -> Trainer:
        """A trainer resumed from `save(path)`, or a fresh optimizer on a plain model checkpoint. The given
        config's hyperparameters (lr, betas, weight decay) replace the saved ones."""
        model = checkpoint.load(path, device=device)
        state_file = os.path.join(path, TRAINER_FILE)
        state = torch.load(state_file, weights_only=True) if os.path.isfile(state_file) else None
        version = state["version"] if state else int(checkpoint.read_metadata(path).get("policy_version", 0))
        trainer = cls(model, config, version=version)
        if trainer.reference is not None and os.path.isdir(os.path.join(path, REFERENCE_DIR)):
            trainer.reference = checkpoint.load(os.path.join(path, REFERENCE_DIR), device=device).eval()
            trainer.reference.requires_grad_(False)
        if state:
            trainer.optimizer.load_state_dict(state["optimizer"])
            for group in trainer.optimizer.param_groups:
                group.update(
                    lr=trainer.config.lr,
                    betas=trainer.config.betas,
                    eps=trainer.config.eps,
                    weight_decay=trainer.config.weight_decay,
                )
            torch.set_rng_state(state["rng"])
        return trainer
