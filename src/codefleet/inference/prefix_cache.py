"""The engine's prefix cache: finished sequences' keys/values kept in spare slots of the KV cache for reuse.

The engine's `SlotKVCache` has `max_batch` slots for running sequences and
`n_slots` more, owned here. `park` copies a finished sequence's keys/values
(every token that went through the model) into a free one, evicting the least
recently used entry when none is free; `match` finds the entry sharing the
longest prefix with a new prompt; `take` copies that prefix into the
request's running slot and marks the entry superseded when the prompt extends
all of it (the next turn supersedes the last); `drop_superseded` frees those
once every request admitted in the same step has copied what it matched
(several attempts of a group can extend the same entry whole); `clear` drops
everything (a weight update: a prefix is reused only under the weights that
computed it). See docs/engine.md.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from codefleet.inference.cache import SlotKVCache


@dataclass
class Parked:
    """A finished sequence's keys/values kept in a prefix-cache slot."""

    slot: int
    tokens: list[int]  # the tokens whose keys/values the slot holds, in order
    routing: list[list[list[int]]] | None  # [token][moe layer][top_k] of those tokens (None without routing)
    used: int  # last use, for least-recently-used eviction
    superseded: bool = False  # a prompt extended it whole: freed by `drop_superseded`


class PrefixCache:
    def __init__(self, cache: SlotKVCache, first_slot: int, n_slots: int, min_prefix: int = 16):
        self.cache = cache
        self.min_prefix = max(1, int(min_prefix))
        self.entries: list[Parked] = []
        self._free = list(range(first_slot + n_slots - 1, first_slot - 1, -1))
        self._uses = itertools.count()
        self.hits = 0  # requests that reused a parked prefix
        self.tokens_reused = 0  # prompt tokens copied instead of computed

    def match(self, prompt: list[int]) -> tuple[Parked | None, int]:
        """The entry sharing the longest prefix with `prompt` and that length (at most len(prompt) - 1: the
        last prompt token always runs, its logits sample the first new token); (None, 0) below `min_prefix`."""
        best, best_n = None, 0
        for parked in self.entries:
            n = common_prefix(parked.tokens, prompt, len(prompt) - 1)
            if n > best_n:
                best, best_n = parked, n
        return (best, best_n) if best_n >= self.min_prefix else (None, 0)

    def take(self, parked: Parked, slot: int, n: int) -> None:
        """Copy the entry's first `n` positions into `slot`; an entry the prompt extends whole is superseded
        (kept until `drop_superseded`, so that other requests admitted with it can still copy it)."""
        self.cache.copy(parked.slot, slot, n)
        parked.used = next(self._uses)
        parked.superseded |= n == len(parked.tokens)
        self.hits += 1
        self.tokens_reused += n

    def drop_superseded(self) -> None:
        for parked in [p for p in self.entries if p.superseded]:
            self._drop(parked)

    def park(self, slot: int, tokens: list[int], routing: list | None) -> None:
        """Keep the keys/values of `tokens` (held by `slot`) for reuse."""
        if (not self._free and not self.entries) or len(tokens) < self.min_prefix:
            return  # no slots at all, or too short to be worth a copy
        if not self._free:  # evict the least recently used
            self._drop(min(self.entries, key=lambda p: p.used))
        parked = Parked(self._free.pop(), tokens, routing, next(self._uses))
        self.cache.copy(slot, parked.slot, len(tokens))
        self.entries.append(parked)

    def clear(self) -> None:
        for parked in list(self.entries):
            self._drop(parked)

    def _drop(self, parked: Parked) -> None:
        self.entries.remove(parked)
        self.cache.free(parked.slot)
        self._free.append(parked.slot)


def common_prefix(a: list[int], b: list[int], limit: int) -> int:
    """The length of the longest common prefix of `a` and `b`, at most `limit` (slice compares run in C)."""
    hi = min(len(a), len(b), limit)
    if a[:hi] == b[:hi]:
        return hi
    lo = 0  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
