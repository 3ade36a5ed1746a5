"""How the sandbox benches time a figure: calls timed one by one (`timed_ms`), in alternating blocks with their
peer (`alternated`) so a burst of load on a shared machine hits both sides alike, and summarised by a
percentile without interpolation (`percentile`)."""

from __future__ import annotations

import time
from collections.abc import Callable


def percentile(values: list[float], q: float) -> float:
    """The sorted `values`' item at index int(q * n), the last for q = 1 (no interpolation)."""
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def timed_ms(fn, n: int) -> list[float]:
    """Milliseconds of each of `n` calls of `fn`."""
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def alternated(timed: dict[str, tuple[Callable[[], object], int]], rounds: int = 10) -> dict[str, list[float]]:
    """Milliseconds of each of `n` calls per named function, run in `rounds` alternating blocks (round i calls
    every function its share of times before round i + 1 starts), so load bursts hit every function alike."""
    out: dict[str, list[float]] = {name: [] for name in timed}
    for i in range(rounds):
        for name, (fn, n) in timed.items():
            share = n * (i + 1) // rounds - n * i // rounds
            out[name] += timed_ms(fn, share)
    return out
