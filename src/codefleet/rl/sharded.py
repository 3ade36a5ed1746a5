"""The sharded trainer: `rl.trainer.Trainer`'s API on every rank, the model sharded with FSDP2 (TRAINERS "fsdp2").

    dist.init_process_group("gloo")       # or "nccl" on GPUs; one process per rank
    trainer = ShardedTrainer(Transformer(cfg), TrainConfig())   # or ShardedTrainer.load(path, cfg)
    trainer.forward_backward_sft(my_examples, total_tokens=units_of_the_whole_step)
    trainer.optim_step()
    trainer.save("ckpt/")                 # DCP: every rank writes its shards
    consolidate("ckpt/", "hf/")           # one process, no process group: a normal (or HF) checkpoint

Sharding. `fully_shard` (torch.distributed.fsdp, FSDP2) wraps every block and
then the root (embeddings, final norm, LM head), over a 1-D device mesh of
all ranks; each parameter becomes a DTensor sharded along its first dimension,
gathered block by block in the forward and backward, and AdamW steps on the
shards. Buffers (the router's selection bias and load counts) stay replicated.
The same code serves codefleet's configs and HF checkpoints (Qwen3-MoE, ...),
since `checkpoint.load` turns both into a `Transformer`.

Exactness. Each rank runs `forward_backward` on its part of the batch with
the *whole step's* loss units (as `fleet.trainer_group` does), so its
gradient is its share of the one-batch gradient; the reduce-scatter sums the
shares (`set_gradient_divide_factor(1)`: FSDP2 would average), and the
router's expert loads are summed before `optim_step` moves the bias. A 2-rank
step equals the single-process step on the whole batch to fp32 rounding
(tests: 1e-5).

Collectives need every rank to run the same sequence of forwards and
backwards, but the ranks' micro-batch counts differ with their data. Before a
call, the ranks agree on the largest count (one all-reduce), and a rank with
fewer runs the rest on a one-token dummy batch whose loss is multiplied by 0
(in eval mode, so the dummy counts no expert load): no gradient changes, the
collectives line up. A rank with no examples at all takes part the same way.

Scoring forwards (proximal and KL-reference logprobs) run the model's own
code, not the inference fast path the data-parallel trainer passes
(`codefleet.inference.fast` reads block weights directly and would bypass
FSDP2's per-block gathering, and would see one rank's experts under expert
parallelism), with gradients on as in training, and are detached.

Checkpoints. `save(path)` writes one `torch.distributed.checkpoint` (DCP)
directory: the model's and the optimizer's sharded state (each rank its own
shards, into one directory: a shared filesystem on a cluster), torch's RNG
state, `model_config.json` (the `ModelConfig`) and `metadata.json`
(`policy_version`, `train_config`, `sharded: true`); the KL reference, if any,
in `reference/`. It is written to a sibling temporary directory that rank 0
renames into place after every rank is done, so a rank killed mid-save
leaves the previous checkpoint whole. Where a rank's disk is not rank 0's
(each rank saving into a directory of its own node, to upload it:
fleet.trainer_worker), that rank renames its own temporary directory, which
holds its part of the checkpoint. The temporary directory is made afresh
through codefleet.store.safe_files (a link planted at its predictable name
is removed, never written into; `save` says what DCP's own writes leave).
`load(path)` resumes from it on any
number of ranks (DCP reshards), or starts from a plain or HF checkpoint with
a fresh optimizer. `consolidate(sharded_dir, out_dir)` reads the DCP
directory in one process into a whole `Transformer` and writes it with
`checkpoint.save`: an HF directory that transformers loads when the model
came from one (`config.architecture`), else codefleet's format.

Expert parallelism (TRAINERS "fsdp2_ep", `ExpertParallelTrainer`): the MoE
layers become `model.expert_parallel.ExpertParallelMoE` over all ranks (EP =
world size), each rank holding E / W experts; FSDP2 shards everything else and
ignores the expert weights (`ignored_params`), whose gradients are complete
on their owner after the reverse all-to-all. The clipping norm is the square
root of every rank's sum of squares over its shards and its experts (one
all-reduce), AdamW runs without foreach (DTensors and plain tensors mixed),
and the checkpoint stores each expert weight and its Adam moments as one
DTensor of row blocks, so `consolidate` and a resume see whole expert
tensors; a KL reference is saved the same way. Not yet: EP over a subgroup
of the ranks (EP < world size, a 2-D mesh).

`fleet.trainer_group.TrainerGroup` runs it for `codefleet train
trainer.backend=fsdp2|fsdp2_ep`: its workers join the process group
before they build the trainer, and call `weights` and `save` on every rank
(these are collectives here).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from codefleet.model import checkpoint
from codefleet.model.config import ModelConfig
from codefleet.model.expert_parallel import ExpertParallelMoE, parallelize_experts
from codefleet.model.transformer import Transformer
from codefleet.rl.batch import Sample
from codefleet.rl.logprobs import forward_logprobs
from codefleet.rl.sft import pad_batch, sft_step_loss
from codefleet.rl.trainer import Example, TrainConfig, Trainer, loss_units, pack, sft_units, to_device
from codefleet.store import safe_files

MODEL_CONFIG_FILE, METADATA_FILE, REFERENCE_DIR = "model_config.json", "metadata.json", "reference"


def is_sharded_checkpoint(path: str) -> bool:
    """Whether `path` is a DCP directory written by `ShardedTrainer.save`."""
    return os.path.isfile(os.path.join(path, ".metadata")) and os.path.isfile(os.path.join(path, MODEL_CONFIG_FILE))


def expert_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """The expert-parallel MoE layers' expert weights by name (each rank holds its own experts' rows)."""
    return {
        f"{name}.{p}": getattr(m, p)
        for name, m in model.named_modules()
        if isinstance(m, ExpertParallelMoE)
        for p in ("w_gate_up_EDG", "w_down_EFD")
    }


def shard_model(model: Transformer, mesh: DeviceMesh, expert_parallel: bool = False) -> Transformer:
    """FSDP2 in place: every block, then the root; gradients summed (not averaged) across ranks. With
    `expert_parallel`, the MoE layers first become `ExpertParallelMoE` over all ranks, and FSDP2 leaves their
    expert weights alone (each rank's are its own; their gradients are already complete)."""
    if expert_parallel:
        parallelize_experts(model)
    ignored = set(expert_weights(model).values())
    for block in model.layers:
        fully_shard(block, mesh=mesh, ignored_params=ignored & set(block.parameters()) or None)
    fully_shard(model, mesh=mesh, ignored_params=ignored or None)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
    return model


class ShardedTrainer(Trainer):
    """`Trainer` on an FSDP2-sharded model, one per rank of the default process group. See the module docstring."""

    sharded = True  # capability (codefleet.contracts.TRAINERS): all ranks build, save and load it together
    expert_parallel = False  # `ExpertParallelTrainer`: the MoE experts split across the ranks

    def __init__(
        self,
        model: Transformer,
        config: TrainConfig | None = None,
        version: int = 0,
        device: str | torch.device | None = None,
    ):
        if not dist.is_initialized():
            raise RuntimeError(
                "ShardedTrainer runs one process per rank: call torch.distributed.init_process_group "
                "(gloo on CPU, nccl on GPU) in every rank first"
            )
        device = torch.device(device or ("cuda" if dist.get_backend() == "nccl" else "cpu"))
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        model = model.to(device)
        for t in model.state_dict().values():  # rank 0's weights everywhere, whatever each rank initialised
            dist.broadcast(t, src=0)
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        self.config = config or TrainConfig()
        reference = None
        if self.config.loss.kl_coef > 0:  # copied before sharding, then sharded like the policy
            reference = shard_model(copy.deepcopy(model).eval().requires_grad_(False), self.mesh, self.expert_parallel)
        self.model = shard_model(model, self.mesh, self.expert_parallel).train()
        self.experts = expert_weights(self.model)
        self.reference = reference
        self.version = int(version)
        torch.manual_seed(self.config.seed)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
            foreach=False if self.experts else None,
        )  # DTensors and plain tensors

    # ---- forward + backward, in lockstep --------------------------------------------------

    def forward_backward_sft(self, examples: list[Example], total_tokens: int | None = None) -> dict[str, float]:
        """`Trainer.forward_backward_sft` on this rank's examples; `total_tokens` defaults to the trained targets
        of every rank's examples of this call (summed across ranks)."""
        if total_tokens is None:
            total_tokens = self._sum(sft_units(examples))
        n = len(pack([len(ids) - 1 for ids, _ in examples], self.config.micro_batch_tokens))
        extra = self._missing_micro_batches(n)
        metrics = super().forward_backward_sft(examples, total_tokens)
        for _ in range(extra):
            self._dummy_pass(rl=False)
        return metrics

    def forward_backward_rl(self, samples: list[Sample], total_tokens: int | None = None) -> dict[str, float]:
        """`Trainer.forward_backward_rl` on this rank's samples; `total_tokens` defaults to the loss units of
        every rank's samples of this call (summed across ranks)."""
        if total_tokens is None:
            total_tokens = self._sum(loss_units(samples, self.config.loss))
        n = len(pack([len(s.tokens) for s in samples], self.config.micro_batch_tokens))
        extra = self._missing_micro_batches(n)
        metrics = super().forward_backward_rl(samples, total_tokens)
        for _ in range(extra):
            self._dummy_pass(rl=True)
        return metrics

    def _sum(self, n: int) -> int:
        total = torch.tensor([n], device=self.device)
        dist.all_reduce(total)
        return int(total)

    def _missing_micro_batches(self, n: int) -> int:
        """How many micro-batches fewer than the busiest rank this rank has."""
        most = torch.tensor([n], device=self.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        return int(most) - n

    def _dummy_pass(self, rl: bool) -> None:
        """The forwards and the backward of one micro-batch on one token, contributing exactly 0."""
        batch = to_device(pad_batch([([0, 0], [0, 1])]), self.device)
        if rl and self.config.loss.off_policy != "none":
            self._logprobs(self.model, batch.tokens_BT, batch.loss_mask_BT)
        if rl and self.reference is not None:
            self._logprobs(self.reference, batch.tokens_BT, batch.loss_mask_BT)
        self.model.eval()  # no expert-load counting
        try:
            loss, _ = sft_step_loss(self.model, batch)
            (loss * 0).backward()
        finally:
            self.model.train()

    def _score(self, model, batch, routing) -> torch.Tensor:
        return self._logprobs(model, batch.tokens_BT, batch.mask_BT, routing)

    @staticmethod
    def _logprobs(model, tokens_BT, mask_BT, routing=None) -> torch.Tensor:
        """Per-token logprobs in eval mode without keeping a graph, through the training path (the module
        docstring)."""
        was_training = model.training
        model.eval()
        try:
            with torch.enable_grad():
                return forward_logprobs(model, tokens_BT, mask_BT, routing).logprobs_BT.detach()
        finally:
            model.train(was_training)

    # ---- the step -----------------------------------------------------------------------

    def optim_step(self) -> dict[str, float]:
        """`Trainer.optim_step` on the shards: the router's expert loads summed across ranks first, and the
        global gradient norm for clipping summed from every rank's shards (and its own experts)."""
        if all(p.grad is None for p in self.params):
            raise RuntimeError("optim_step without gradients: call forward_backward_sft/_rl first")
        for name, b in self.model.named_buffers():
            if name.endswith("load_E"):
                dist.all_reduce(b)
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in self.gradients()]
        sq = torch.stack([g.float().square().sum() for g in grads]).sum()
        dist.all_reduce(sq)
        norm = sq.sqrt()
        if self.config.grad_clip > 0:  # as torch.nn.utils.clip_grad_norm_
            coef = torch.clamp(self.config.grad_clip / (norm + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return self._step(norm)

    def all_reduce(self, reduce_sum) -> None:
        raise RuntimeError(
            "ShardedTrainer sums gradients in its backward (FSDP2 reduce-scatter); the data-parallel "
            "all_reduce is for the 'dp' trainer"
        )

    # ---- weights and checkpoints ------------------------------------------------------------

    def weights(self, clone: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's state dict on CPU, on every rank (a collective: every rank must call it)."""
        return self._full_state(self.model)

    def _full_state(self, model: Transformer) -> dict[str, torch.Tensor]:
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        for name, p in expert_weights(model).items():  # every rank's experts, in rank order
            parts = [torch.empty_like(p) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, p.detach().contiguous())
            state[name] = torch.cat(parts)
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def _state(self) -> dict:
        """What DCP saves and loads: the sharded model and optimizer state, with each rank's experts (and their
        Adam moments) as row blocks of one DTensor, so the checkpoint holds whole expert tensors."""
        model, optim = self._model_state(self.model), get_optimizer_state_dict(self.model, self.optimizer)
        for name in self.experts:
            if name in optim["state"]:  # a new dict: this one may be the optimizer's own
                optim["state"][name] = {
                    k: self._as_rows(v) if isinstance(v, torch.Tensor) and v.dim() else v
                    for k, v in optim["state"][name].items()
                }
        return {"model": model, "optim": optim, "rng": torch.get_rng_state()}

    def _model_state(self, model: Transformer) -> dict:
        """A model's sharded state dict for DCP, its experts as row blocks (the policy's or the KL reference's)."""
        state = get_model_state_dict(model)
        for name in expert_weights(model):
            state[name] = self._as_rows(state[name])
        return state

    def _as_rows(self, local: torch.Tensor) -> DTensor:
        return DTensor.from_local(local.detach(), self.mesh, [Shard(0)], run_check=False)

    def _set_state(self, state: dict) -> None:
        """`_state` loaded by DCP, into the model and optimizer."""
        for name in self.experts:
            state["model"][name] = state["model"][name].to_local()
            if name in state["optim"]["state"]:
                state["optim"]["state"][name] = {
                    k: v.to_local() if isinstance(v, DTensor) else v for k, v in state["optim"]["state"][name].items()
                }
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"])
        torch.set_rng_state(state["rng"])

    def save(self, path: str) -> None:
        """A DCP checkpoint in directory `path`, written atomically (a collective; see the module docstring).

        `path` is in a run directory someone else may have prepared, and its temporary sibling has a predictable
        name: rank 0 removes whatever is at `TMP` (a link as the link itself) and makes `TMP` and `TMP/reference`
        afresh through codefleet.store.safe_files, never following a link below `path`'s parent, before any rank
        writes. DCP then writes its shards by path into that directory: what remains is a race, a link swapped
        in at `TMP` by someone who can write `path`'s parent while the shards are written. The config and the
        metadata go in through safe_files, and the rename into place moves links, never what they point to."""
        path = os.path.abspath(path)
        parent, tmp = os.path.dirname(path), f"{path}.tmp"
        if dist.get_rank() == 0:
            safe_files.remove_beneath(parent, tmp, ignore_errors=True)
            safe_files.makedirs_beneath(parent, tmp)
            if self.reference is not None:
                safe_files.makedirs_beneath(parent, os.path.join(tmp, REFERENCE_DIR))
        dist.barrier()
        dcp.save(self._state(), checkpoint_id=tmp)
        if self.reference is not None:
            dcp.save({"model": self._model_state(self.reference)}, checkpoint_id=os.path.join(tmp, REFERENCE_DIR))
        if dist.get_rank() == 0:
            metadata = {
                "policy_version": self.version,
                "sharded": True,
                "train_config": json.loads(json.dumps(asdict(self.config))),
            }
            for name, value in ((MODEL_CONFIG_FILE, self.model.config.to_dict()), (METADATA_FILE, metadata)):
                safe_files.write_file_beneath(parent, os.path.join(tmp, name), json.dumps(value, indent=1), mode=0o644)
            checkpoint.swap_in(tmp, path, f"{path}.old")
        dist.barrier()
        # a disk rank 0 does not share: this rank's own shards (a directory, not a link to one)
        if os.path.isdir(tmp) and not os.path.islink(tmp) and not os.path.lexists(path):
            safe_files.replace_beneath(parent, tmp, path)

    @classmethod
    def load(
        cls, path: str, config: TrainConfig | None = None, device: str | torch.device | None = None
    ) -> ShardedTrainer:
        """Resume from `save(path)` (any number of ranks), or start from a plain / HF checkpoint with a fresh
        optimizer. The given config's hyperparameters replace the saved ones. A collective."""
        if not is_sharded_checkpoint(path):
            model = checkpoint.load(path)
            version = int(checkpoint.read_metadata(path).get("policy_version", 0))
            return cls(model, config, version=version, device=device)
        with open(os.path.join(path, MODEL_CONFIG_FILE)) as f:
            model_config = ModelConfig.from_dict(json.load(f))
        with open(os.path.join(path, METADATA_FILE)) as f:
            version = int(json.load(f)["policy_version"])
        trainer = cls(Transformer(model_config), config, version=version, device=device)
        state = trainer._state()
        dcp.load(state, checkpoint_id=path)
        trainer._set_state(state)
        if trainer.reference is not None and os.path.isdir(os.path.join(path, REFERENCE_DIR)):
            ref = {"model": trainer._model_state(trainer.reference)}
            dcp.load(ref, checkpoint_id=os.path.join(path, REFERENCE_DIR))
            for name in expert_weights(trainer.reference):
                ref["model"][name] = ref["model"][name].to_local()
            set_model_state_dict(trainer.reference, ref["model"])
        for group in trainer.optimizer.param_groups:
            group.update(
                lr=trainer.config.lr,
                betas=trainer.config.betas,
                eps=trainer.config.eps,
                weight_decay=trainer.config.weight_decay,
            )
        return trainer


def consolidate(sharded_dir: str, out_dir: str) -> str:
    """The model of a `ShardedTrainer.save` directory as one normal checkpoint (`checkpoint.save`: an HF
    directory when the model came from one). One process, no process group needed. Returns `out_dir`."""
    if not is_sharded_checkpoint(sharded_dir):
        raise ValueError(
            f"{sharded_dir} is not a sharded trainer checkpoint (no .metadata / {MODEL_CONFIG_FILE}): "
            "pass the directory ShardedTrainer.save wrote"
        )
    with open(os.path.join(sharded_dir, MODEL_CONFIG_FILE)) as f:
        model_config = ModelConfig.from_dict(json.load(f))
    with open(os.path.join(sharded_dir, METADATA_FILE)) as f:
        metadata = json.load(f)
    model = Transformer(model_config, init_weights=False)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=sharded_dir)  # into the model's own tensors
    checkpoint.save(
        model,
        out_dir,
        metadata={"policy_version": metadata["policy_version"], "train_config": metadata["train_config"]},
    )
    return out_dir


class ExpertParallelTrainer(ShardedTrainer):
    """`ShardedTrainer` with the MoE experts split across the ranks (`model.expert_parallel`), the rest FSDP2."""

    expert_parallel = True
