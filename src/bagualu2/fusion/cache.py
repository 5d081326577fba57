"""Memo cache of orders keyed by (discretized budget, imbalance bucket, pipeline phase) — §V-B "Runtime
Solving": the chains of a scheduling point are fixed by the micro-batch budget, and budgets repeat."""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Hashable

from ..costmodel.build import check_imbalance
from .chains import Chains
from .order import Order

Key = tuple[int, float, Hashable]


@dataclass(kw_only=True)
class OrderCache:
    """LRU cache of orders. ``budget_quantum_bytes`` and ``imbalance_step`` set the bucket widths. The key does not
    identify the chains' stage/chunk: keep one cache per (stage, chunk) or put them into ``phase``."""

    budget_quantum_bytes: int = 64 << 20
    imbalance_step: float = 0.1
    max_entries: int = 4096
    hits: int = 0
    misses: int = 0
    _entries: "OrderedDict[Key, Order]" = field(default_factory=OrderedDict, repr=False)

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
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative integer, got {budget_bytes!r}")
        bucket = math.ceil(check_imbalance(imbalance) / self.imbalance_step) * self.imbalance_step
        return budget_bytes // self.budget_quantum_bytes, round(bucket, 9), phase

    def get(self, budget_bytes: int, imbalance: float, phase: Hashable, chains: Callable[[], Chains],
            solve: Callable[[Chains], Order]) -> Order:
        """Cached order of the bucket, else ``solve(chains())`` stored under it."""
        key = self.key(budget_bytes, imbalance, phase)
        found = self._entries.get(key)
        if found is not None:
            self.hits += 1
            self._entries.move_to_end(key)
            return found
        self.misses += 1
        order = solve(chains())
        self._entries[key] = order
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return order

    def __len__(self) -> int:
        return len(self._entries)
