"""New weights for a serving model, prepared beside it and swapped in by reference.

    swap = WeightSwap(model)
    staged = swap.stage(state_dict)      # any thread, while the model keeps serving: copies and derived forms
    swap.apply(staged)                   # between two forward passes: pointer swaps only

`stage` checks the state dict against the model (names, shapes) and copies every tensor into a buffer of the
model's dtype and device: the previous version's storage when it fits (double buffering), else a new one. It
also builds, for the new tensors, every inference-only derived form the model has built for its current ones
(`fast.derived_weight`: fused and prepacked projections, packed experts), so the first forward pass after the
swap does not rebuild them. None of this touches the model.

`apply` points each parameter and buffer at its staged tensor (`tensor.data = new`) and installs the
prebuilt derived forms under the keys `derived_weight` will look them up by: its cost does not grow with the
model's size, so the serving model pauses for microseconds, not for a copy of its weights. The storage it
replaced becomes the next `stage`'s buffers, so memory is two copies of the weights, not one per version.

A tensor shared by two names (tied embeddings) is staged and swapped once.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from codefleet.inference import fast


@dataclass
class Staged:
    tensors: dict[str, torch.Tensor]  # one name per distinct parameter or buffer
    derived: list[tuple[torch.nn.Module, str, object]]  # (owner, derived name, prebuilt value)


@dataclass
class Update:
    """A staged update waiting for the engine to apply it between two steps; `done` is set once it landed."""

    staged: Staged
    version: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class WeightSwap:
    def __init__(self, model: torch.nn.Module):
        self.model = model
        self._targets: dict[str, torch.Tensor] = {}  # state-dict name -> the Parameter or buffer it loads into
        for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            if name in model.state_dict():
                self._targets[name] = t
        first: dict[int, str] = {}
        self._aliases = {name: first.setdefault(id(t), name) for name, t in self._targets.items()}
        self._spare: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()  # one stage at a time: they share the spare buffers

    def stage(self, state: dict[str, torch.Tensor]) -> Staged:
        self._check(state)
        with self._lock, torch.inference_mode(False), torch.no_grad():
            tensors = {}
            for name, target in self._targets.items():
                if self._aliases[name] != name:
                    continue
                buf = self._spare.pop(name, None)
                if buf is None or buf.shape != target.shape or buf.dtype != target.dtype:
                    buf = torch.empty_like(target, requires_grad=False)
                tensors[name] = buf.copy_(state[name])
            new = {id(self._targets[n]): t for n, t in tensors.items()}
            derived = []
            for owner in self.model.modules():
                for key, entry in list(owner.__dict__.get("_derived_weights", {}).items()):
                    weights, build = entry[2], entry[3]
                    if all(id(w) in new for w in weights):
                        derived.append((owner, key, build(*(new[id(w)] for w in weights))))
            return Staged(tensors, derived)

    def apply(self, staged: Staged) -> None:
        """Swap the staged tensors in (call it where no forward pass runs)."""
        with torch.inference_mode(False), torch.no_grad():
            for name, t in staged.tensors.items():
                target = self._targets[name]
                self._spare[name] = target.data
                target.data = t
            for owner, key, value in staged.derived:
                weights, build = owner.__dict__["_derived_weights"][key][2:]
                owner.__dict__["_derived_weights"][key] = (fast.weights_key(weights), value, weights, build)

    def _check(self, state: dict[str, torch.Tensor]) -> None:
        missing = sorted(set(self._targets) - set(state))
        unexpected = sorted(set(state) - set(self._targets))
        if missing or unexpected:
            raise ValueError(
                f"the new weights do not fit the model: missing {missing[:5]}"
                f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
                f"{' ...' if len(unexpected) > 5 else ''}; send a state dict of the same model"
            )
        for name, target in self._targets.items():
            if tuple(state[name].shape) != tuple(target.shape):
                raise ValueError(
                    f"the new weights do not fit the model: {name} has shape {tuple(state[name].shape)}"
                    f", the model's is {tuple(target.shape)}; send a state dict of the same model"
                )
