"""Shared plumbing of the runtime memo caches and the exact solvers: budget/imbalance buckets, a small LRU map,
solver option checks. (Lives here because every pure package may import the cost model.)"""

from __future__ import annotations

import math
import numbers
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Generic, Hashable, TypeVar

from .build import check_imbalance

V = TypeVar("V")


@dataclass(frozen=True, kw_only=True)
class Buckets:
    """Conservative buckets: budgets round *down* to ``budget_quantum_bytes``, imbalances *up* to
    ``imbalance_step``, so whatever was decided for a bucket is safe for every request in it."""

    budget_quantum_bytes: int = 64 << 20
    imbalance_step: float = 0.1

    def __post_init__(self) -> None:
        if isinstance(self.budget_quantum_bytes, bool) or not isinstance(self.budget_quantum_bytes, int) \
                or self.budget_quantum_bytes < 1:
            raise ValueError(f"budget_quantum_bytes must be an integer >= 1, got {self.budget_quantum_bytes!r}")
        if isinstance(self.imbalance_step, bool) or not isinstance(self.imbalance_step, (int, float)) \
                or not math.isfinite(self.imbalance_step) or not self.imbalance_step > 0:
            raise ValueError(f"imbalance_step must be a finite number > 0, got {self.imbalance_step!r}")

    def budget(self, budget_bytes: int) -> int:
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative integer number of bytes, got {budget_bytes!r}")
        return int(budget_bytes) // self.budget_quantum_bytes * self.budget_quantum_bytes

    def imbalance(self, imbalance: float) -> float:
        bucket = math.ceil(check_imbalance(imbalance) / self.imbalance_step) * self.imbalance_step
        return round(max(bucket, 1.0), 9)

    def key(self, budget_bytes: int, imbalance: float, phase: Hashable) -> tuple[int, float, Hashable]:
        return self.budget(budget_bytes), self.imbalance(imbalance), phase


@dataclass
class Lru(Generic[V]):
    """A bounded map that evicts the least recently used entry and counts hits and misses."""

    max_entries: int = 4096
    hits: int = 0
    misses: int = 0
    _entries: "OrderedDict[Hashable, V]" = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.max_entries, bool) or not isinstance(self.max_entries, int) or self.max_entries < 1:
            raise ValueError(f"max_entries must be an integer >= 1, got {self.max_entries!r}")

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


def check_solver_options(time_limit_s: Any, num_workers: Any, seed: Any) -> None:
    """Options of the CP-SAT solvers: a finite time limit > 0, workers >= 1, a seed >= 0."""
    if not isinstance(time_limit_s, (int, float)) or isinstance(time_limit_s, bool) \
            or not math.isfinite(time_limit_s) or time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be a finite number > 0, got {time_limit_s!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"num_workers must be an integer >= 1, got {num_workers!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
