"""The runtime's memo caches (§V-B "Runtime Solving"): conservative budget/imbalance buckets, a small LRU map,
and the plan and order caches keyed by (budget bucket, imbalance bucket, phase).

A bucket is conservative: budgets round *down* to a multiple of ``budget_quantum_bytes`` and imbalances *up* to
a multiple of ``imbalance_step``, so whatever was decided for a bucket (a plan solved for the smaller budget on
the graph of the larger imbalance) fits every request in it.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Generic, Hashable, TypeVar

from ..costmodel import OpGraph
from ..costmodel.build import check_imbalance
from ..costmodel.validate import require_int, require_number
from ..fusion import Chains, Order
from ..mitigation import Solution, greedy

V = TypeVar("V")
COVERED = "covered"  # the budget bucket of every budget at or above the unmitigated bytes


@dataclass(frozen=True, kw_only=True)
class Buckets:
    """Budgets round *down* to ``budget_quantum_bytes``, imbalances *up* to ``imbalance_step``."""

    budget_quantum_bytes: int = 64 << 20
    imbalance_step: float = 0.1

    def __post_init__(self) -> None:
        require_int("budget_quantum_bytes", self.budget_quantum_bytes, 1)
        require_number("imbalance_step", self.imbalance_step, 0, low_open=True)

    def budget(self, budget_bytes: int) -> int:
        budget_bytes = require_int("budget_bytes", budget_bytes, 0)
        return budget_bytes // self.budget_quantum_bytes * self.budget_quantum_bytes

    def imbalance(self, imbalance: float) -> float:
        return ceil_bucket(check_imbalance(imbalance), self.imbalance_step)

    def key(self, budget_bytes: int, imbalance: float, phase: Hashable) -> tuple[int, float, Hashable]:
        return self.budget(budget_bytes), self.imbalance(imbalance), phase


def ceil_bucket(imbalance: float, step: float) -> float:
    """``imbalance`` rounded up to a multiple of ``step`` (at least 1.0)."""
    return max(round(math.ceil(imbalance / step - 1e-9) * step, 9), 1.0)


def floor_bucket(imbalance: float, step: float) -> float:
    """``imbalance`` rounded down to a multiple of ``step`` (at least 1.0)."""
    return max(round(math.floor(imbalance / step + 1e-9) * step, 9), 1.0)


@dataclass
class Lru(Generic[V]):
    """A bounded map that evicts the least recently used entry and counts hits and misses."""

    max_entries: int = 4096
    hits: int = 0
    misses: int = 0
    _entries: "OrderedDict[Hashable, V]" = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        require_int("max_entries", self.max_entries, 1)

    def get(self, key: Hashable) -> V | None:
        found = self._entries.get(key)
        if found is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(key)
        return found

    def put(self, key: Hashable, value: V) -> V:
        self._entries[key] = value
        if len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return value

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.hits = self.misses = 0


class BucketCache(Generic[V]):
    """Base of the plan and order caches: an LRU of values keyed by (budget bucket, imbalance bucket, phase)."""

    def __init__(self, *, budget_quantum_bytes: int = 64 << 20, imbalance_step: float = 0.1,
                 max_entries: int = 4096):
        self.buckets = Buckets(budget_quantum_bytes=budget_quantum_bytes, imbalance_step=imbalance_step)
        self._memo: Lru[V] = Lru(max_entries=max_entries)

    @property
    def hits(self) -> int:
        return self._memo.hits

    @property
    def misses(self) -> int:
        return self._memo.misses

    def key(self, budget_bytes: int, imbalance: float, phase: Hashable) -> tuple[int, float, Hashable]:
        return self.buckets.key(budget_bytes, imbalance, phase)

    def __len__(self) -> int:
        return len(self._memo)

    def clear(self) -> None:
        self._memo.clear()


class PlanCache(BucketCache[Solution]):
    """LRU cache of solutions. The key does not identify the graph: keep one cache per (stage, chunk) or put
    them into ``phase``. A hit is safe: the cached plan was solved for the bucket's smaller budget on the graph
    of its larger imbalance."""

    def __init__(self, **options):
        super().__init__(**options)
        self._unmitigated: dict[tuple, int] = {}  # (imbalance bucket, phase) -> unmitigated bytes of its graph

    def get(self, budget_bytes: int, imbalance: float, phase: Hashable,
            build: Callable[[float], OpGraph],
            solve: Callable[[OpGraph, int], Solution] = greedy.solve) -> Solution:
        """Cached solution for the bucket, or ``solve(build(bucket_imbalance), bucket_budget)`` on a miss. A
        budget that covers the bucket graph's unmitigated bytes is never floored (one shared empty plan)."""
        key = self.key(budget_bytes, imbalance, phase)
        unmitigated = self._unmitigated.get(key[1:])
        if unmitigated is not None and budget_bytes >= unmitigated:
            key = (COVERED, *key[1:])
        found = self._memo.get(key)
        if found is not None:
            return found
        graph = build(key[1])
        self._unmitigated[key[1:]] = graph.unmitigated_bytes
        if budget_bytes >= graph.unmitigated_bytes:
            return self._memo.put((COVERED, *key[1:]), solve(graph, graph.unmitigated_bytes))
        solution = solve(graph, key[0])
        if not solution.ok:  # the floored budget fell below M0: solve this request exactly, do not cache it
            return solve(graph, budget_bytes)
        return self._memo.put(key, solution)


class OrderCache(BucketCache[Order]):
    """LRU cache of fused orders: the chains of a scheduling point are fixed by the micro-batch budget, and
    budgets repeat. Keep one cache per (stage, chunk) or put them into ``phase``."""

    def get(self, budget_bytes: int, imbalance: float, phase: Hashable, chains: Callable[[], Chains],
            solve: Callable[[Chains], Order]) -> Order:
        """Cached order of the bucket, else ``solve(chains())`` stored under it."""
        key = self.key(budget_bytes, imbalance, phase)
        found = self._memo.get(key)
        return found if found is not None else self._memo.put(key, solve(chains()))
