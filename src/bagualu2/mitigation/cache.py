"""Plan cache keyed by (discretized budget, imbalance bucket, pipeline phase) — §V-B "Runtime Solving".

Keys are conservative so a hit is always safe: the budget is rounded *down* to a multiple of
``budget_quantum_bytes`` and the imbalance *up* to a multiple of ``imbalance_step``; the cached plan was solved
for that smaller budget on the graph of that larger imbalance, so it fits every request in the bucket.
"""

from __future__ import annotations

from typing import Callable, Hashable

from ..costmodel import OpGraph
from ..costmodel.buckets import Buckets, Lru
from . import greedy
from .solution import Solution


class PlanCache:
    """LRU cache of solutions. The key does not identify the graph: keep one cache per (stage, chunk) or put
    them into ``phase``.

      budget_quantum_bytes  budget discretization step (bytes, > 0).
      imbalance_step        imbalance bucket width (> 0).
      max_entries           entries kept (least recently used evicted).
    """

    def __init__(self, *, budget_quantum_bytes: int = 64 << 20, imbalance_step: float = 0.1,
                 max_entries: int = 4096):
        self.buckets = Buckets(budget_quantum_bytes=budget_quantum_bytes, imbalance_step=imbalance_step)
        self._memo: Lru[Solution] = Lru(max_entries=max_entries)

    @property
    def hits(self) -> int:
        return self._memo.hits

    @property
    def misses(self) -> int:
        return self._memo.misses

    def key(self, budget_bytes: int, imbalance: float, phase: Hashable) -> tuple:
        return self.buckets.key(budget_bytes, imbalance, phase)

    def get(self, budget_bytes: int, imbalance: float, phase: Hashable,
            build: Callable[[float], OpGraph],
            solve: Callable[[OpGraph, int], Solution] = greedy.solve) -> Solution:
        """Cached solution for the bucket, or ``solve(build(bucket_imbalance), bucket_budget)`` on a miss."""
        key = self.key(budget_bytes, imbalance, phase)
        found = self._memo.get(key)
        if found is not None:
            return found
        graph = build(key[1])
        solution = solve(graph, key[0])
        if not solution.ok:  # the floored budget fell below M0: solve this request exactly, do not cache it
            return solve(graph, budget_bytes)
        return self._memo.put(key, solution)

    def __len__(self) -> int:
        return len(self._memo)

    def clear(self) -> None:
        self._memo.clear()
