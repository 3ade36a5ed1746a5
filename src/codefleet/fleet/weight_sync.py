"""Weight sync, trainer -> engines, in buckets: flattened tensors of a bounded size, through the Ray object store
or over process groups (gloo, NCCL).

    sender = BucketSender(lambda: trainer.weights(clone=False))          # in each trainer rank
    plan = sender.plan(names_of_my_share, bucket_mb=256)                 # metadata only
    wire = sender.bucket(i)                                              # one flat 1-D array of one dtype
    receiver = BucketReceiver(); receiver.begin(plans)                   # in each engine actor
    receiver.add(plan.buckets[i], wire) ...; engine.update_weights(receiver.state_dict(), version)

Why buckets. One state dict as one object (`TrainerGroup.publish`) is serialised whole before the first
engine reads a byte, and nothing overlaps. Buckets of `bucket_mb` pipeline the three stages (the sender packs
bucket i+1 while the engines copy bucket i), bound the size of any one object, and let every trainer rank send
its own share in parallel (one sender per shard: with data parallelism every rank holds everything, so the
tensors are split between the ranks by bytes, `split_names`).

Layout. Tensors are grouped by dtype (a bucket holds one dtype, so it is one flat tensor); within a dtype they
are laid end to end in state-dict order and cut every `bucket_mb`, so every bucket but the last of a dtype is
full and a tensor larger than a bucket spans several. A `Piece` says which slice of which tensor sits where in
which bucket; `SenderPlan` carries the tensor specs (name, shape, dtype) too, so a receiver needs nothing else.

Atomicity. The receiver assembles a state dict (a tensor that lies whole in one bucket is a zero-copy view of
it; one cut across buckets is copied into a staging tensor kept between versions) and only once every element
of every tensor has arrived calls `engine.update_weights(state, version)` once: the engine swaps all of it
between two steps, so no token is ever sampled from half-updated weights, and a failed or partial sync leaves
the engine on its old version.
The engine's pause is its own copy from staging into the model (`Engine.update_weights`), not the transfer.

Transport, Ray object store (`publish_buckets`): each bucket is the return value of one call to its sender, so
the driver owns it (it outlives the sender) but only ever holds `ObjectRef`s; engines read the buckets
zero-copy from shared memory. A sync actor runs its calls in order, so a trainer step submitted after the
bucket calls cannot change the weights under them.

Transport, process groups (`GroupSync`): each sender is rank 0 of a torch.distributed group of its own whose
other ranks are the engines (gloo for weights on CPU, NCCL for weights on a GPU; separate from the trainer's
own default group), formed once. Per version the sender packs each bucket and broadcasts it (the next is packed
while one travels); each engine receives every sender's buckets at once into flat buffers it keeps between
versions, then assembles and applies them as above. Nothing passes through the driver or the object store. A
dead or stuck member fails the sync with `GroupSyncError`: the driver tells the engines to stop waiting, nothing
is applied, and the caller sends that version through the object store and forms new groups.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import ray
import torch
import torch.distributed as dist

_SAME_WIDTH_INT = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype without the "torch." prefix

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class Piece:
    """Elements [start, start + numel) of tensor `name` (flattened) at [offset, offset + numel) of a bucket."""

    name: str
    start: int
    offset: int
    numel: int


@dataclass(frozen=True)
class BucketPlan:
    dtype: str
    numel: int
    pieces: tuple[Piece, ...]

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


@dataclass(frozen=True)
class SenderPlan:
    """What one sender sends: the specs of its tensors and the buckets they are cut into."""

    specs: tuple[TensorSpec, ...]
    buckets: tuple[BucketPlan, ...]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


def specs_of(state: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, tuple(t.shape), _dtype_name(t)) for n, t in state.items()]


def split_names(specs: list[TensorSpec], n: int) -> list[list[str]]:
    """Tensor names split into `n` shares of balanced bytes (largest first, onto the lightest share), each share in
    state-dict order."""
    load, shares = [0] * n, [set() for _ in range(n)]
    for s in sorted(specs, key=lambda s: -s.nbytes):
        r = min(range(n), key=lambda r: (load[r], r))
        shares[r].add(s.name)
        load[r] += s.nbytes
    return [[s.name for s in specs if s.name in share] for share in shares]


def plan_buckets(specs: list[TensorSpec], bucket_mb: float) -> SenderPlan:
    """Cut `specs` into buckets of at most `bucket_mb` (see the module docstring for the layout)."""
    if bucket_mb <= 0:
        raise ValueError(f"bucket_mb must be positive, got {bucket_mb}")
    buckets: list[BucketPlan] = []
    for dtype in dict.fromkeys(s.dtype for s in specs):
        capacity = max(int(bucket_mb * 2**20) // _itemsize(dtype), 1)
        pieces: list[Piece] = []
        used = 0
        for spec in (s for s in specs if s.dtype == dtype):
            start = 0
            while start < spec.numel:
                take = min(spec.numel - start, capacity - used)
                pieces.append(Piece(spec.name, start, used, take))
                start, used = start + take, used + take
                if used == capacity:
                    buckets.append(BucketPlan(dtype, used, tuple(pieces)))
                    pieces, used = [], 0
        if pieces:
            buckets.append(BucketPlan(dtype, used, tuple(pieces)))
    return SenderPlan(tuple(specs), tuple(buckets))


def pack(state: dict[str, torch.Tensor], bucket: BucketPlan) -> torch.Tensor:
    """The bucket as one flat tensor on the tensors' device (a copy; the state is not changed)."""
    device = state[bucket.pieces[0].name].device
    flat = torch.empty(bucket.numel, dtype=getattr(torch, bucket.dtype), device=device)
    for p in bucket.pieces:
        flat[p.offset : p.offset + p.numel] = state[p.name].detach().reshape(-1)[p.start : p.start + p.numel]
    return flat


def to_wire(flat: torch.Tensor) -> np.ndarray:
    """A flat tensor as numpy (Ray stores it as one out-of-band buffer); bfloat16 and the like travel as integers
    of the same width."""
    flat = flat.cpu()
    try:
        return flat.numpy()
    except TypeError:
        return flat.view(getattr(torch, np.dtype(_SAME_WIDTH_INT[flat.element_size()]).name)).numpy()


def from_wire(array: np.ndarray, dtype: str) -> torch.Tensor:
    with warnings.catch_warnings():  # the object store's buffers are read-only; nothing writes to them
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array).view(getattr(torch, dtype))


class BucketSender:
    """One sender's side, inside a trainer rank (or any holder of a state dict or a shard of one)."""

    def __init__(self, weights: Callable[[], dict[str, torch.Tensor]]):
        self.weights = weights  # called per bucket: the live tensors, not a copy
        self.current: SenderPlan | None = None

    def plan(self, names: list[str] | None, bucket_mb: float) -> SenderPlan:
        state = self.weights()
        specs = specs_of({n: state[n] for n in (state if names is None else names)})
        self.current = plan_buckets(specs, bucket_mb)
        return self.current

    def bucket(self, index: int) -> list[np.ndarray]:
        """Bucket `index` as its pieces, views of the live tensors: Ray writes them end to end into one object
        (out-of-band buffers), so the object store holds the flat bucket without a packing copy here."""
        if self.current is None:
            raise RuntimeError("BucketSender.bucket() before plan(): plan the buckets first")
        state = self.weights()
        return [
            to_wire(state[p.name].detach().reshape(-1)[p.start : p.start + p.numel])
            for p in self.current.buckets[index].pieces
        ]


class BucketReceiver:
    """One engine's side: assembles the buckets of every sender into a state dict and says when it is complete.

    A tensor that lies whole in one bucket is a view of that bucket (for a bucket read from the object store,
    of its shared memory: no copy); one cut across buckets is copied into a staging tensor kept between
    versions. The views hold their buckets until the next `begin` or `release`."""

    def __init__(self):
        self.staging: dict[str, torch.Tensor] = {}
        self.views: dict[str, torch.Tensor] = {}
        self.specs: dict[str, TensorSpec] = {}
        self._expected = 0
        self._received = 0

    def begin(self, plans: list[SenderPlan]) -> None:
        specs = [s for p in plans for s in p.specs]
        if len({s.name for s in specs}) != len(specs):
            raise ValueError("two senders send the same tensor; give every sender a disjoint share (split_names)")
        self.specs = {s.name: s for s in specs}
        split = {
            p.name for plan in plans for b in plan.buckets for p in b.pieces if p.numel != self.specs[p.name].numel
        }
        self.staging = {
            n: t
            for n, t in self.staging.items()
            if n in split and (tuple(t.shape), _dtype_name(t)) == (self.specs[n].shape, self.specs[n].dtype)
        }
        for n in split - set(self.staging):
            self.staging[n] = torch.empty(self.specs[n].shape, dtype=getattr(torch, self.specs[n].dtype))
        self.views = {}
        self._expected = sum(s.numel for s in specs)
        self._received = 0

    def add(self, bucket: BucketPlan, wire: np.ndarray | torch.Tensor | list) -> None:
        """`wire`: the flat bucket (`pack`), or its pieces in plan order (`BucketSender.bucket`)."""
        if isinstance(wire, list):
            pieces = [w if isinstance(w, torch.Tensor) else from_wire(w, bucket.dtype) for w in wire]
        else:
            flat = wire if isinstance(wire, torch.Tensor) else from_wire(wire, bucket.dtype)
            pieces = [flat[p.offset : p.offset + p.numel] for p in bucket.pieces]
        if [t.numel() for t in pieces] != [p.numel for p in bucket.pieces]:
            raise ValueError(f"a bucket of {sum(t.numel() for t in pieces)} elements where the plan has {bucket.numel}")
        for p, piece in zip(bucket.pieces, pieces):
            if p.name in self.staging:
                self.staging[p.name].view(-1)[p.start : p.start + p.numel].copy_(piece)
            else:
                self.views[p.name] = piece.view(self.specs[p.name].shape)
        self._received += bucket.numel

    @property
    def complete(self) -> bool:
        return self._received == self._expected

    def state_dict(self) -> dict[str, torch.Tensor]:
        if not self.complete:
            raise RuntimeError(
                f"weight sync incomplete: {self._received} of {self._expected} elements arrived; "
                "the engine keeps its current weights"
            )
        return {n: self.views[n] if n in self.views else self.staging[n] for n in self.specs}

    def release(self) -> None:
        """Let go of the buckets the views point into (once the engine has copied them)."""
        self.views = {}


# ---- over the Ray object store (driver side) ----------------------------------------------------


@dataclass
class Buckets:
    """One version in the object store: per sender its plan and one ref per bucket. The driver holds refs only."""

    version: int
    plans: list[SenderPlan]
    refs: list[list[ray.ObjectRef]]

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.plans)


def publish_buckets(senders: list, plans: list[SenderPlan], version: int) -> Buckets:
    """One call per bucket to each sender actor (its `bucket(i)` method), all submitted at once: the object store
    fills while the engines already read. `plans[i]` is what `senders[i].plan(...)` returned."""
    refs = [[s.bucket.remote(i) for i in range(len(p.buckets))] for s, p in zip(senders, plans)]
    return Buckets(version, list(plans), refs)


async def receive_buckets(
    receiver: BucketReceiver, buckets_plans: list[SenderPlan], refs: list[list[ray.ObjectRef]]
) -> dict[str, torch.Tensor]:
    """Inside an async engine actor: await every bucket in order (senders interleaved, so all of them progress)
    and assemble it (in a worker thread: the actor's event loop keeps serving); the complete staging state dict."""
    loop = asyncio.get_running_loop()
    receiver.begin(buckets_plans)
    order = [
        (i, j) for j in range(max((len(r) for r in refs), default=0)) for i in range(len(refs)) if j < len(refs[i])
    ]
    for i, j in order:
        wire = await refs[i][j]
        await loop.run_in_executor(None, receiver.add, buckets_plans[i].buckets[j], wire)
        del wire
    return receiver.state_dict()


# ---- over a process group: gloo on CPU, NCCL on GPU ---------------------------------------------


def open_store(timeout_s: float) -> tuple[dist.TCPStore, str]:
    """A rendezvous store served from this process on a free port, and its host:port for the others."""
    store = dist.TCPStore("0.0.0.0", 0, None, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    return store, f"{ray.util.get_node_ip_address()}:{store.port}"


def open_group(store: dist.Store, rank: int, world: int, backend: str, timeout_s: float):
    """A process group of its own (not torch.distributed's default one, which a trainer rank already has)."""
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=timeout_s))
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world)
    raise ValueError(f"weight sync over a process group uses gloo (CPU) or nccl (GPU), not {backend!r}")


def _broadcast_options() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


class GroupSender:
    """One sender's side: its buckets (`BucketSender.plan`) broadcast from rank 0 of a group of its own, whose
    other ranks are the engines. gloo for weights on CPU, NCCL for weights on a GPU."""

    def __init__(self, sender: BucketSender, device: torch.device | str = "cpu"):
        self.sender, self.device = sender, torch.device(device)  # where the sender's weights live
        self.store = self.group = None

    def address(self, timeout_s: float) -> tuple[str, str]:
        """Serve a new group's rendezvous: (host:port, backend); then `join` (collectively with the engines)."""
        self.group = None
        self.store, address = open_store(timeout_s)
        return address, "nccl" if self.device.type == "cuda" else "gloo"

    def join(self, world: int, backend: str, timeout_s: float) -> None:
        self.group = open_group(self.store, 0, world, backend, timeout_s)

    def send(self) -> int:
        """Broadcast every bucket of the current plan (two in flight: the next is packed while one travels); the
        bytes sent. Blocks until every engine has received them."""
        if self.group is None or self.sender.current is None:
            raise RuntimeError("GroupSender.send() before address()/join() and the sender's plan()")
        state, opts, work = self.sender.weights(), _broadcast_options(), None
        for bucket in self.sender.current.buckets:
            flat = pack(state, bucket)
            if work is not None:
                work.wait()
            work = self.group.broadcast([flat], opts)
        if work is not None:
            work.wait()
        return self.sender.current.nbytes


class GroupReceiver:
    """One engine's side: one group per sender, and a flat buffer per bucket kept between versions (the
    broadcasts land in them; `BucketReceiver.add` then takes views of them)."""

    def __init__(self):
        self.groups: dict[int, object] = {}
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        self.aborted = -1  # the newest version the driver gave up on (`abort`)
        self._broken: list = []  # groups and buffers of an aborted sync: gloo may still hold them until it times out

    def join(self, sender: int, address: str, rank: int, world: int, backend: str, timeout_s: float) -> None:
        host, port = address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=timeout_s))
        self.groups[sender] = open_group(store, rank, world, backend, timeout_s)

    def abort(self, version: int) -> None:
        """Stop waiting for `version` (a sender or another engine failed): a receive of it raises, and the groups
        are left until new ones are joined."""
        self.aborted = max(self.aborted, version)

    def receive(self, plans: list[SenderPlan], version: int, device: str = "cpu") -> list[list[torch.Tensor]]:
        """Every sender's buckets, in its group's order; all groups at once."""
        if sorted(self.groups) != list(range(len(plans))):
            raise RuntimeError(
                f"this engine is in the sync groups of senders {sorted(self.groups)}, not of all "
                f"{len(plans)} (it restarted since they were formed); the driver re-forms them"
            )
        works = self._post(plans, device)
        for w in works:
            while not w.is_completed():
                if self.aborted >= version:
                    self._broken.append((self.groups, self.buffers))
                    self.groups, self.buffers = {}, {}
                    raise RuntimeError(
                        f"weight sync of version {version} over the sync groups was aborted by the "
                        "driver (a sender or another engine failed)"
                    )
                time.sleep(0.0005)
            w.wait()
        return [[self.buffers[(i, j)] for j in range(len(p.buckets))] for i, p in enumerate(plans)]

    def _post(self, plans: list[SenderPlan], device: str) -> list:
        opts, works = _broadcast_options(), []
        for i, plan in enumerate(plans):
            for j, b in enumerate(plan.buckets):
                buf = self.buffers.get((i, j))
                if buf is None or buf.numel() != b.numel or _dtype_name(buf) != b.dtype or buf.device.type != device:
                    buf = self.buffers[(i, j)] = torch.empty(b.numel, dtype=getattr(torch, b.dtype), device=device)
                works.append(self.groups[i].broadcast([buf], opts))
        return works


class GroupSyncError(RuntimeError):
    """A sync over the process groups failed (an engine or a sender died or timed out); nothing was applied."""


class GroupSync:
    """Driver side of weight sync over process groups: one group per sender (rank 0) with every engine.

        sync = GroupSync(trainer_workers, engines, timeout_s=120)   # forms the groups (collectively)
        sync.send(plans, version)                                     # plans: each sender's bucket_plan(...)

    The actors expose `sync_group_address` / `join_sync_group` / `send_sync_group` (senders) and
    `join_sync_group` / `receive_sync_group` (engines). A failure raises GroupSyncError; the groups are then
    broken, and the caller sends that version another way and forms new groups (a new GroupSync)."""

    def __init__(self, senders: list, engines: list, timeout_s: float = 120.0):
        self.senders, self.engines, self.timeout_s = list(senders), list(engines), timeout_s
        world = 1 + len(self.engines)
        addresses = self._get([s.sync_group_address.remote(timeout_s) for s in self.senders])
        self.backend = addresses[0][1]
        if any(b != self.backend for _, b in addresses):
            raise ValueError(f"the senders' weights are on different devices ({[b for _, b in addresses]})")
        refs = [s.join_sync_group.remote(world, self.backend, timeout_s) for s in self.senders]
        refs += [
            e.join_sync_group.remote(i, address, 1 + k, world, self.backend, timeout_s)
            for i, (address, _) in enumerate(addresses)
            for k, e in enumerate(self.engines)
        ]
        self._get(refs)

    def send(self, plans: list[SenderPlan], version: int) -> None:
        refs = [s.send_sync_group.remote() for s in self.senders]
        refs += [e.receive_sync_group.remote(plans, version) for e in self.engines]
        try:
            self._get(refs)
        except GroupSyncError:  # the engines still waiting would wait out the group's timeout
            ray.wait(
                [e.abort_sync_group.remote(version) for e in self.engines], num_returns=len(self.engines), timeout=10
            )
            raise

    def _get(self, refs: list) -> list:
        """Every result, or GroupSyncError at the first failure (or at the timeout)."""
        deadline, pending = time.monotonic() + self.timeout_s, list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=1, timeout=max(deadline - time.monotonic(), 0))
                if not done:
                    raise TimeoutError(f"no answer within {self.timeout_s:g} s")
                ray.get(done)
            return ray.get(refs)
        except (ray.exceptions.RayError, RuntimeError, TimeoutError) as e:
            raise GroupSyncError(
                f"weight sync over {getattr(self, 'backend', 'a process group')} failed: "
                f"{str(e).strip().splitlines()[-1][:300]}"
            ) from e
