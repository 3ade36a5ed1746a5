"""A slot-based KV cache for continuous batching.

Each running sequence owns one *slot*: a row of preallocated key/value
tensors `[n_layers, n_slots, n_kv_heads, max_len, head_dim]`. Nothing is
allocated per step; a step writes the new keys/values in place and attends
over a view of the slots in use.

The engine keeps the running sequences packed in slots `0..n-1` (when one
finishes, the last one moves into its slot, `move`), so a decode step reads
`K[:, :n, :, :L]` — a view, not a gather — where `L` is the longest length
in the batch. Rows shorter than `L` are masked.

One forward pass of the model is one `begin(slots, starts, n_new)` followed by
one `attend` per layer:

- `slots_B`: the slot of each batch row,
- `starts_B`: how many tokens that slot already holds (its current length),
- `n_new_B`: how many of the `T` new tokens of the row are real (prefill of
  prompts of different lengths is right-padded to `T`; a decode step has
  `T = 1`).

Query `t` of row `b` sees the keys at positions `j <= starts[b] + t`: the
sequence's own past plus causal attention within the new tokens. Padded
queries are computed and discarded; padded keys sit beyond the row's length
and are overwritten before anything real can see them.

Grouped-query attention without copying the cache: the `G = n_heads /
n_kv_heads` query heads that share a kv head are folded into the query-length
axis (`q[B, Hkv, G*T, D]`), so one SDPA call attends with `[B, Hkv, L, D]`
keys directly. Head `h` uses kv head `h // G` (the `repeat_interleave`
convention of HF's `repeat_kv`).

A model with a copy head (`CopyConfig.head`) also keeps, per slot and
position, the copy head's key (`copy_dim` wide) and the token there:
`copy_context` stores the new ones and returns each row's history; with
`copy_ends` given to `begin` (`CopyConfig.scope = "prompt"`: each request's
prompt length), a row's queries see only the copy keys before it.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


class CacheFullError(RuntimeError):
    """A sequence would grow past the cache's `max_len`."""


class SlotKVCache:
    """Preallocated per-slot keys and values for every layer."""

    def __init__(
        self,
        n_layers: int,
        n_slots: int,
        n_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        copy_dim: int = 0,
    ):
        self.n_layers, self.n_slots, self.max_len = n_layers, n_slots, max_len
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        shape = (n_layers, n_slots, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # the copy head's keys and the tokens they point at (empty without a copy head), with a head axis of 1 so
        # that the keys' and values' write/read serve them too
        self.copy_k = torch.zeros((n_slots, 1, max_len, copy_dim) if copy_dim else (0,), dtype=dtype, device=device)
        self.tokens = torch.zeros((n_slots, 1, max_len, 1) if copy_dim else (0,), dtype=torch.long, device=device)
        self.lengths = [0] * n_slots  # tokens held per slot (host side; the engine owns the bookkeeping)
        self._step: _Step | None = None

    # -- one forward pass -------------------------------------------------------------

    def begin(
        self, slots: list[int], starts: list[int], n_new: list[int], t_new: int, copy_ends: list[int] | None = None
    ) -> None:
        """Prepare the next forward pass: row b writes `n_new[b]` (of `t_new`) tokens into `slots[b]` after
        `starts[b]`; its copy-head queries point only before `copy_ends[b]` if given."""
        for s, n in zip(starts, n_new):
            if s + n > self.max_len:
                raise CacheFullError(
                    f"a sequence of {s + n} tokens does not fit the cache (max_len "
                    f"{self.max_len}); raise max_seq_len or lower max_tokens"
                )
        self._step = _Step(self, slots, starts, n_new, t_new, copy_ends)

    def end(self) -> None:
        """Commit the lengths of the forward pass that `begin` prepared."""
        step = self._step
        assert step is not None, "end() without begin()"
        for slot, s, n in zip(step.slots, step.starts, step.n_new):
            self.lengths[slot] = s + n
        self._step = None

    @property
    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`(slots_B, positions_B)` of the forward pass in progress when it is a decode step (one new token per
        row, written at `positions_B[b]` of slot `slots_B[b]`), else None. The native decode step
        (`fast.blocks`) writes and attends with these instead of `attend`."""
        step = self._step
        return None if step is None or step.t_new != 1 else (step.slots_B, step.positions_B)

    def attend(self, layer: int, q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor) -> torch.Tensor:
        """Store the new keys/values of `layer` and attend over each row's cached history plus them."""
        step = self._step
        assert step is not None, "cache.attend() called outside begin()/end(); the engine drives the cache"
        B, H, T, D = q_BHTD.shape
        Hkv = k_BHTD.shape[1]
        step.write(self.k[layer], k_BHTD)
        step.write(self.v[layer], v_BHTD)
        keys_BHLD, values_BHLD = step.read(self.k[layer]), step.read(self.v[layer])
        G = H // Hkv
        q_BHgD = q_BHTD.reshape(B, Hkv, G * T, D)  # heads h = kv * G + g
        if T == 1:  # decode: bmm-softmax-bmm beats SDPA's CPU kernel ~2x at these sizes
            # (batch, kv head) folded into one batch axis X: views, as the cache's slot axis is outermost
            L = keys_BHLD.shape[2]
            q_XGD = q_BHgD.reshape(B * Hkv, G, D)
            keys_XDL = keys_BHLD.reshape(B * Hkv, L, D).transpose(1, 2)
            # mask + scale * q k^T in one call (the mask broadcasts over the G query heads)
            scores_XGL = torch.baddbmm(step.additive_mask(Hkv), q_XGD, keys_XDL, alpha=D**-0.5)
            out = torch.bmm(torch.softmax(scores_XGL, dim=-1), values_BHLD.reshape(B * Hkv, L, D))
        else:
            out = F.scaled_dot_product_attention(q_BHgD, keys_BHLD, values_BHLD, attn_mask=step.mask(G))
        return out.reshape(B, H, T, D)

    def copy_context(
        self, k_BTD: torch.Tensor, tokens_BT: torch.Tensor, at_B: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Store the copy head's new keys and tokens; return each row's keys `[B, L, D]`, tokens `[B, L]`,
        which of them each query sees, `[B, T, L]`, and each query's position, `[B, T]` (`at_B`: only that
        query of each row, T = 1)."""
        step = self._step
        assert step is not None, "cache.copy_context() called outside begin()/end(); the engine drives the cache"
        if not self.tokens.numel():
            raise ValueError("this cache keeps no copy-head keys: build it with copy_dim = the model's head_dim")
        step.write(self.copy_k, k_BTD[:, None])
        step.write(self.tokens, tokens_BT[:, None, :, None])
        visible_BTL, query_pos_BT = step.copy_mask_BTL, step.query_pos_BT.clamp(max=step.length - 1)
        if at_B is not None:
            rows_B = torch.arange(len(at_B), device=at_B.device)
            visible_BTL, query_pos_BT = visible_BTL[rows_B, at_B][:, None], query_pos_BT[rows_B, at_B][:, None]
        return step.read(self.copy_k)[:, 0], step.read(self.tokens)[:, 0, :, 0], visible_BTL, query_pos_BT

    # -- slot management ----------------------------------------------------------------

    def move(self, src: int, dst: int) -> None:
        """Copy slot `src` into slot `dst` (packing running sequences into the lowest slots)."""
        self.copy(src, dst, self.lengths[src])
        self.lengths[src] = 0

    def copy(self, src: int, dst: int, n: int) -> None:
        """Copy the first `n` positions of slot `src` into slot `dst`, which then holds `n` tokens (prefix
        reuse: a cached conversation continues in a running slot)."""
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        if self.tokens.numel():
            self.copy_k[dst, :, :n] = self.copy_k[src, :, :n]
            self.tokens[dst, :, :n] = self.tokens[src, :, :n]
        self.lengths[dst] = n

    def free(self, slot: int) -> None:
        self.lengths[slot] = 0


class _Step:
    """Indices and the mask of one forward pass, computed once and shared by every layer."""

    def __init__(
        self,
        cache: SlotKVCache,
        slots: list[int],
        starts: list[int],
        n_new: list[int],
        t_new: int,
        copy_ends: list[int] | None = None,
    ):
        self.slots, self.starts, self.n_new, self.t_new = slots, starts, n_new, t_new
        self.device = cache.k.device
        B = len(slots)
        self.packed = slots == list(range(B))  # rows are slots 0..B-1: read a view, not a gather
        self.slots_B = torch.tensor(slots, device=self.device)
        # keys to attend over; a padded row (prefill after a reused prefix) may reach past max_len: its padding
        # writes to the last position, beyond its real tokens, and is never attended to by a real query
        self.length = min(max(s + t_new for s in starts), cache.max_len)
        self.starts_B = torch.tensor(starts, device=self.device)
        if t_new == 1:
            self.positions_B = self.starts_B
        else:
            positions_BT = self.starts_B[:, None] + torch.arange(t_new, device=self.device)[None, :]
            self.positions_BT = positions_BT.clamp_(max=cache.max_len - 1)
        self.copy_ends = copy_ends
        self._masks: dict[int, torch.Tensor] = {}
        self._additive: torch.Tensor | None = None
        self.dtype = cache.k.dtype

    # the masks are built on first use (the native decode step needs none of them), then shared by every layer

    @functools.cached_property
    def query_pos_BT(self) -> torch.Tensor:
        return self.starts_B[:, None] + torch.arange(self.t_new, device=self.device)[None, :]

    @functools.cached_property
    def key_pos_L(self) -> torch.Tensor:
        return torch.arange(self.length, device=self.device)

    @functools.cached_property
    def mask_BTL(self) -> torch.Tensor:
        """True where query t of row b may attend to key position l."""
        return self.key_pos_L[None, None, :] <= self.query_pos_BT[:, :, None]

    @functools.cached_property
    def copy_mask_BTL(self) -> torch.Tensor:
        if self.copy_ends is None:
            return self.mask_BTL
        ends_B = torch.tensor(self.copy_ends, device=self.device)
        return self.mask_BTL & (self.key_pos_L[None, None, :] < ends_B[:, None, None])

    def additive_mask(self, n_kv_heads: int) -> torch.Tensor:
        """[B * n_kv_heads, 1, L] of 0 (visible) and -inf, for a decode step (T = 1): row b * n_kv_heads + h
        is sequence b's; broadcasts over the query heads of a kv head."""
        if self._additive is None:
            m = torch.zeros(self.mask_BTL.shape, dtype=self.dtype, device=self.mask_BTL.device)
            m.masked_fill_(~self.mask_BTL, float("-inf"))
            self._additive = m.repeat_interleave(n_kv_heads, dim=0)
        return self._additive

    def mask(self, G: int) -> torch.Tensor:
        m = self._masks.get(G)
        if m is None:  # [B, 1, G*T, L]: the same visibility for the G query heads of a kv head
            B, T, L = self.mask_BTL.shape
            m = self.mask_BTL[:, None, None].expand(B, 1, G, T, L).reshape(B, 1, G * T, L)
            self._masks[G] = m
        return m

    def write(self, store: torch.Tensor, new_BHTD: torch.Tensor) -> None:
        if new_BHTD.dtype != store.dtype:
            new_BHTD = new_BHTD.to(store.dtype)
        if self.t_new == 1:
            store[self.slots_B, :, self.positions_B] = new_BHTD[:, :, 0]
        else:  # [B, T] positions per row; advanced indices (slot, position) broadcast to [B, T] -> [B, T, H, D]
            store[self.slots_B[:, None], :, self.positions_BT] = new_BHTD.transpose(1, 2)

    def read(self, store: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return store[: len(self.slots), :, : self.length]
        return store[self.slots_B, :, : self.length]
