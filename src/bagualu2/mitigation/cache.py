"""Plan cache keyed by (discretized budget, imbalance bucket, pipeline phase) — §V-B "Runtime Solving".

Keys are conservative so a hit is always safe: the budget is rounded *down* to a multiple of
``budget_quantum_bytes`` and the imbalance *up* to a multiple of ``imbalance_step``; the cached plan was solved
for that smaller budget on the graph of that larger imbalance, so it fits every request in the bucket.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

from ..costmodel import OpGraph
from ..costmodel.build import check_imbalance
from . import greedy
from .solution import Solution, check_budget

Key = tuple[int, float, Hashable]


@dataclass(kw_only=True)
class PlanCache:
    """LRU cache of solutions. The key does not identify the graph: keep one cache per (stage, chunk) or put
    them into ``phase``.

      budget_quantum_bytes  budget discretization step (bytes, > 0).
      imbalance_step        imbalance bucket width (> 0).
      max_entries           entries kept (least recently used evicted).
    """

    budget_quantum_bytes: int = 64 << 20
    imbalance_step: float = 0.1
    max_entries: int = 4096
    hits: int = 0
    misses: int = 0
    _entries: "OrderedDict[Key, Solution]" = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.budget_quantum_bytes, bool) or not isinstance(self.budget_quantum_bytes, int) \
                or self.budget_quantum_bytes < 1:
            raise ValueError(f"budget_quantum_bytes must be an integer >= 1, got {self.budget_quantum_bytes!r}")
        if isinstance(self.imbalance_step, bool) or not isinstance(self.imbalance_step, (int, float)) \
                or not math.isfinite(self.imbalance_step) or not self.imbalance_step > 0:
            raise ValueError(f"imbalance_step must be a number > 0, got {self.imbalance_step!r}")
        if isinstance(self.max_entries, bool) or not isinstance(self.max_entries, int) or self.max_entries < 1:
            raise ValueError(f"max_entries must be an integer >= 1, got {self.max_entries!r}")

    def key(self, budget_bytes: int, imbalance: float, phase: Hashable) -> Key:
        budget = check_budget(budget_bytes) // self.budget_quantum_bytes * self.budget_quantum_bytes
        bucket = math.ceil(check_imbalance(imbalance) / self.imbalance_step) * self.imbalance_step
        return budget, round(max(bucket, 1.0), 9), phase

    def get(self, budget_bytes: int, imbalance: float, phase: Hashable,
            build: Callable[[float], OpGraph],
            solve: Callable[[OpGraph, int], Solution] = greedy.solve) -> Solution:
        """Cached solution for the bucket, or ``solve(build(bucket_imbalance), bucket_budget)`` on a miss."""
        key = self.key(budget_bytes, imbalance, phase)
        entries = self._entries
        found = entries.get(key)
        if found is not None:
            self.hits += 1
            entries.move_to_end(key)
            return found
        self.misses += 1
        graph = build(key[1])
        solution = solve(graph, key[0])
        if not solution.ok:  # the floored budget fell below M0: solve this request exactly, do not cache it
            return solve(graph, budget_bytes)
        entries[key] = solution
        if len(entries) > self.max_entries:
            entries.popitem(last=False)
        return solution

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = 0
