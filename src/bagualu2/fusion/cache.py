"""Memo cache of orders keyed by (discretized budget, imbalance bucket, pipeline phase) — §V-B "Runtime
Solving": the chains of a scheduling point are fixed by the micro-batch budget, and budgets repeat."""

from __future__ import annotations

from typing import Callable, Hashable

from ..costmodel.buckets import BucketCache
from .chains import Chains
from .order import Order


class OrderCache(BucketCache[Order]):
    """LRU cache of orders. ``budget_quantum_bytes`` and ``imbalance_step`` set the bucket widths. The key does not
    identify the chains' stage/chunk: keep one cache per (stage, chunk) or put them into ``phase``."""

    def get(self, budget_bytes: int, imbalance: float, phase: Hashable, chains: Callable[[], Chains],
            solve: Callable[[Chains], Order]) -> Order:
        """Cached order of the bucket, else ``solve(chains())`` stored under it."""
        key = self.key(budget_bytes, imbalance, phase)
        found = self._memo.get(key)
        return found if found is not None else self._memo.put(key, solve(chains()))
