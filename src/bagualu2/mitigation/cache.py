"""Plan cache keyed by (discretized budget, imbalance bucket, pipeline phase) — §V-B "Runtime Solving".

Keys are conservative so a hit is always safe: the budget is rounded *down* to a multiple of
``budget_quantum_bytes`` and the imbalance *up* to a multiple of ``imbalance_step``; the cached plan was solved
for that smaller budget on the graph of that larger imbalance, so it fits every request in the bucket.
"""

from __future__ import annotations

from typing import Callable, Hashable

from ..costmodel import OpGraph
from ..costmodel.buckets import BucketCache
from . import greedy
from .solution import Solution


class PlanCache(BucketCache[Solution]):
    """LRU cache of solutions. The key does not identify the graph: keep one cache per (stage, chunk) or put
    them into ``phase``.

      budget_quantum_bytes  budget discretization step (bytes, > 0).
      imbalance_step        imbalance bucket width (> 0).
      max_entries           entries kept (least recently used evicted).
    """

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
