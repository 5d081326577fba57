"""The keys of the decision path's caches: the need grid of a decision and the planned imbalance of a chunk.

* :class:`NeedGrid` — a decision's *need* is ``unmitigated bytes - budget``; its level rounds it *up* on a
  geometric grid of ratio ``1 + step`` starting at ``quantum`` bytes, so a decision made for a level frees at least
  what every request of that level needs: finely for small needs, coarsely for the large, rare ones of spikes.
* :class:`PlannedImbalance` — the imbalance a chunk's pre-gate plan is made for: the smallest of the last
  ``window`` gate measurements, floored to the imbalance bucket grid (a low estimate: what is mitigated before the
  gate cannot be undone, the MoE module can still be re-planned after it), or a constant.
"""

from __future__ import annotations

import math
from collections import deque

from ..costmodel.validate import require_int, require_number
from .buckets import floor_bucket


class NeedGrid:
    """Need levels: ``level(unmitigated, floor, budget) -> (key, budget the decision is made for)``."""

    def __init__(self, quantum: int, step: float):
        self.quantum = require_int("budget_quantum_bytes", quantum, 1)
        self.step = require_number("need_step", step, 0, 1, low_open=True)
        self.ratio = 1.0 + self.step
        self._log = math.log1p(self.step)

    def level(self, unmitigated_bytes: int, floor_bytes: int, budget_bytes: int) -> tuple:
        """The key of a request and the budget its decision is made for (``unmitigated - rounded need``); a grid
        point below ``floor_bytes`` (M0) is never shared: the key is then ``("exact", budget)``."""
        need = unmitigated_bytes - budget_bytes
        quantum = self.quantum
        level = 0 if need <= quantum else math.ceil(math.log(need / quantum) / self._log)
        rounded = math.ceil(quantum * self.ratio ** level)
        if rounded < need:  # floating point at a grid point
            level += 1
            rounded = math.ceil(quantum * self.ratio ** level)
        decided = unmitigated_bytes - rounded
        if decided < floor_bytes:
            return ("exact", budget_bytes), budget_bytes
        return level, decided


class PlannedImbalance:
    """Per chunk, the floored minimum of the last ``window`` measured imbalances (1.0 before any), or a constant."""

    def __init__(self, window: int, step: float, constant: float | None = None):
        self.window = require_int("window", window, 1)
        self.step = step
        self.constant = None if constant is None else floor_bucket(constant, step)
        self._seen: dict[int, deque] = {}      # chunk -> the last `window` measured imbalances
        self._lowest: dict[int, float] = {}    # chunk -> min of the window
        self._planned: dict[int, float] = {}   # chunk -> its floored bucket

    def get(self, chunk: int) -> float:
        return self.constant if self.constant is not None else self._planned.get(chunk, 1.0)

    def observe(self, chunk: int, imbalance: float) -> None:
        """Remember a gate's measurement (amortised O(1): the minimum is recomputed only when it leaves)."""
        seen = self._seen.get(chunk)
        if seen is None:
            seen = self._seen[chunk] = deque(maxlen=self.window)
            self._lowest[chunk] = math.inf
        evicted = seen[0] if len(seen) == self.window else None
        seen.append(imbalance)
        lowest = self._lowest[chunk]
        if imbalance < lowest:
            lowest = imbalance
        elif evicted == lowest and imbalance != lowest:
            lowest = min(seen)
            if lowest == self._lowest[chunk]:
                return
        else:
            return
        self._lowest[chunk] = lowest
        self._planned[chunk] = floor_bucket(lowest, self.step)
