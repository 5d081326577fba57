"""The keys of the decision path's caches: the need grid of a decision and the planned imbalance of a chunk.

* :class:`NeedGrid` — a decision's *need* is ``unmitigated bytes - budget``; its level rounds the need *up* on a
  geometric grid of ratio ``1 + step`` starting at ``quantum`` bytes, or — when that gives up less — the budget
  *down* on a grid of ratio ``1 + budget_step`` (default the same) anchored at the stage's ``M_max``, so a decision
  made for a level frees at least what every request of that level needs and gives up less than ``step`` times
  the need (at most one ``quantum`` for a smaller need) or ``budget_step`` times the budget: finely for small
  needs, coarsely for the large, rare ones of spikes, never much of a tight budget, and nothing of a budget of the
  whole ``M_max``.
* :func:`chunk_aliases` — virtual chunks whose graphs are the same up to layer numbering share one set of caches.
* :class:`PlannedImbalance` — the imbalance a chunk's pre-gate plan is made for: the smallest of the last
  ``window`` gate measurements, floored to the imbalance bucket grid (a low estimate: what is mitigated before the
  gate cannot be undone, the MoE module can still be re-planned after it), or a constant.
"""

from __future__ import annotations

import math
import re
from collections import deque

from ..costmodel import OpGraph, Plan
from ..costmodel.validate import require_int, require_number
from .buckets import floor_bucket


BUDGET_KEYS = 1 << 62  # the budget grid's keys are j - BUDGET_KEYS: negative, rising with the need
MIN_STEP = 1e-6  # the finest need grid: ratio 1 + step stays above 1 in floating point


class NeedGrid:
    """Need levels: ``level(unmitigated, floor, budget) -> (key, budget the decision is made for)``.

    Two grids: the need rounded up from ``quantum`` (key ``k >= 0``: the need ``quantum * ratio**k``, ratio
    ``1 + step``) and the budget rounded down on the points ``anchor_bytes / budget_ratio**j`` (any integer ``j``;
    key ``j - BUDGET_KEYS < 0``; ``budget_ratio = 1 + budget_step``, default ``step``). A request takes the one
    whose decided budget is larger, so it gives up less than ``step`` times its need (a need below ``quantum``: at
    most ``quantum``) or ``budget_step`` times its budget, and nothing of a budget equal to the anchor. Within each
    grid a larger key is a larger need (what the stand-ins rely on); keys of the two grids never mix. The anchor is
    fixed per stage engine (its ``M_max``): the engine's memo holds levels, so every path over one engine must map
    a budget to the same level."""

    def __init__(self, quantum: int, step: float, *, anchor_bytes: int, name: str = "need_step",
                 budget_step: float | None = None):
        self.quantum = require_int("budget_quantum_bytes", quantum, 1)
        self.step = require_number(name, step, MIN_STEP, 1)  # below it, 1 + step rounds to 1
        self.anchor = require_int("anchor_bytes", anchor_bytes, 1)
        self.ratio = 1.0 + self.step
        self._log = math.log(self.ratio)  # the grid's own ratio, as rounded
        if budget_step is not None:
            budget_step = require_number("budget_step", budget_step, MIN_STEP, 1)
        self.budget_step = self.step if budget_step is None else budget_step
        self.budget_ratio = 1.0 + self.budget_step
        self._budget_log = math.log(self.budget_ratio)

    def level(self, unmitigated_bytes: int, floor_bytes: int, budget_bytes: int) -> tuple:
        """The key of a request and the budget its decision is made for; a decided budget below ``floor_bytes``
        (M0) is never shared: the key is then ``("exact", budget)``."""
        quantum, ratio = self.quantum, self.ratio
        need = unmitigated_bytes - budget_bytes
        level = 0 if need <= quantum else math.ceil(math.log(need / quantum) / self._log)
        rounded = math.ceil(quantum * ratio ** level)
        if rounded < need:  # floating point at a grid point
            level += 1
            rounded = math.ceil(quantum * ratio ** level)
        decided = unmitigated_bytes - rounded
        if budget_bytes > 0 and decided < budget_bytes:
            ratio = self.budget_ratio
            j = math.floor(math.log(self.anchor / budget_bytes) / self._budget_log)
            while math.floor(self.anchor / ratio ** (j - 1)) <= budget_bytes:  # floating point at a grid point
                j -= 1
            while math.floor(self.anchor / ratio ** j) > budget_bytes:
                j += 1
            kept = math.floor(self.anchor / ratio ** j)
            if kept > decided:
                level, decided = j - BUDGET_KEYS, kept
        if decided < floor_bytes:
            return ("exact", budget_bytes), budget_bytes
        return level, decided


class PlannedImbalance:
    """Per chunk, the floored minimum of the last ``window`` measured imbalances (``initial`` before any: 1.0,
    balanced, by default), or a constant."""

    def __init__(self, window: int, step: float, constant: float | None = None, initial: float = 1.0,
                 least: float = 1.0):
        self.window = require_int("window", window, 1)
        self.step = step
        self.constant = None if constant is None else floor_bucket(constant, step)
        self.least = floor_bucket(least, step)  # never planned below it (the load the operator expects)
        self.initial = max(floor_bucket(initial, step), self.least)
        # chunk -> [the last `window` measured imbalances, their minimum, its floored bucket]
        self._slots: dict[int, list] = {}

    def seen(self) -> dict[int, tuple[float, ...]]:
        """The measurements in each chunk's window, oldest first."""
        return {chunk: tuple(slot[0]) for chunk, slot in self._slots.items()}

    def get(self, chunk: int) -> float:
        if self.constant is not None:
            return self.constant
        slot = self._slots.get(chunk)
        return self.initial if slot is None else slot[2]

    def observe(self, chunk: int, imbalance: float) -> float:
        """Remember a gate's measurement; returns the planned imbalance *before* it (amortised O(1): the minimum
        is recomputed only when it leaves the window)."""
        slot = self._slots.get(chunk)
        if slot is None:
            slot = self._slots[chunk] = [deque(maxlen=self.window), math.inf, self.initial]
        seen, lowest = slot[0], slot[1]
        planned = slot[2] if self.constant is None else self.constant
        evicted = seen[0] if len(seen) == seen.maxlen else None
        seen.append(imbalance)
        if imbalance < lowest:
            lowest = imbalance
        elif evicted == lowest and imbalance != lowest:
            lowest = min(seen)
            if lowest == slot[1]:
                return planned
        else:
            return planned
        slot[1], slot[2] = lowest, max(floor_bucket(lowest, self.step), self.least)
        return planned


_LAYER = re.compile(r"^L(\d+)\.")


def _shift(name: str, offset: int) -> str:
    return _LAYER.sub(lambda m: f"L{int(m.group(1)) + offset}.", name, count=1)


def shift_plan(plan: Plan, offset: int) -> Plan:
    """``plan`` with every ``L{i}.`` op and tensor name moved by ``offset`` layers (kind policies unchanged)."""
    if not offset or not plan.entries:
        return plan
    return Plan(tuple((key if "/" not in key else "/".join(_shift(part, offset) for part in key.split("/", 1)),
                       strategy) for key, strategy in plan.entries))


def _signature(graph: OpGraph, offset: int) -> tuple:
    """Everything a decision reads of ``graph``, with names moved by ``offset`` layers."""
    ops = tuple((_shift(op.name, offset), op.kind, op.resource, tuple(_shift(t, offset) for t in op.inputs),
                 tuple(_shift(t, offset) for t in op.outputs),
                 tuple((_shift(s.tensor, offset), s.dtype) for s in op.saves), op.flops, op.moved_bytes,
                 op.forward_ns, op.backward_ns) for op in graph.ops)
    tensors = tuple(sorted((_shift(t.name, offset), t.numel, t.dtype, t.producer and _shift(t.producer, offset),
                            t.routed) for t in graph.tensors.values()))
    pinned = tuple(sorted((_shift(op, offset), _shift(t, offset)) for op, t in graph.pinned))
    return ops, tensors, pinned, graph.activation_dtype, graph.mean_routed_tokens


def chunk_aliases(graphs: dict[int, OpGraph]) -> dict[int, tuple[int, int]]:
    """``{chunk: (canonical chunk, layer offset)}``: a chunk whose graph is an earlier chunk's with every layer
    moved by the same offset decides exactly like it (same bytes, times and order), so it shares its caches and
    only its plans' names are moved."""
    aliases: dict[int, tuple[int, int]] = {}
    for chunk in sorted(graphs):
        graph = graphs[chunk]
        for canonical in sorted(c for c, (base, _) in aliases.items() if base == c):
            offset = graph.layers[0] - graphs[canonical].layers[0]
            if _signature(graphs[canonical], offset) == _signature(graph, 0):
                aliases[chunk] = (canonical, offset)
                break
        else:
            aliases[chunk] = (chunk, 0)
    return aliases
