"""The decision path's records and the typed keys of its tables in the stage's memo (``Stage.memo``).

A :class:`Decision` is what the runtime runs for one chunk-forward; :class:`Outcome` a gate decision made for a
need level, its bytes split as ``fixed + per_token * routed tokens`` (:func:`split_bytes`: exact at any
imbalance); :class:`Row` an imbalance bucket of a canonical chunk; :class:`Seen` a measured imbalance on a chunk
(its row, routed tokens and exact unmitigated bytes); :class:`PreGate` a pre-gate plan and the small integer
that stands for it in keys (a plan's entries are long to hash).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from ..costmodel import OpGraph, Plan, PlanCost
from ..fusion import Order
from .gate import GateAction

NO_PLAN = Plan()


class Decision(NamedTuple):
    """What the runtime runs for one chunk-forward. ``kept_bytes`` is exact at the measured imbalance;
    ``overhead_s`` is the plan's on the imbalance bucket's graph (an upper bound)."""

    plan: Plan
    kept_bytes: int
    overhead_s: float
    downgraded: bool  # the gate changed the plan (re-plan or full downgrade)
    order: Order
    action: GateAction = GateAction.KEEP


class PreGate(NamedTuple):
    """A pre-gate plan and the small integer that stands for it in keys (a plan's entries are long)."""

    plan: Plan
    id: int


NO_PRE = PreGate(NO_PLAN, 0)


# ---- the memo's key types (``Stage.memo``) ------------------------------------------------------------------------
class SeenKey(NamedTuple):
    """A measured imbalance on a chunk."""

    imbalance: float
    chunk: int


class RowKey(NamedTuple):
    """An imbalance bucket of a canonical chunk."""

    bucket: float
    chunk: int


class PreGateKey(NamedTuple):
    """A pre-gate plan: need level (pre-gate grid), planned imbalance, canonical chunk."""

    level: object
    planned: float
    chunk: int


class PreBytesKey(NamedTuple):
    """A pre-gate plan's bytes on an imbalance bucket's graph."""

    pre: int
    bucket: float
    chunk: int


class PreBudgetKey(NamedTuple):
    """The pre-gate plan of an exact budget (what the need grid maps it to)."""

    budget: int
    planned: float
    chunk: int


class LevelKey(NamedTuple):
    """The gate's need level of an exact budget on an imbalance bucket's graph, and the budget decided for."""

    budget: int
    bucket: float
    chunk: int


class ShiftKey(NamedTuple):
    """A plan moved by a layer offset (an aliased chunk's names)."""

    entries: tuple
    offset: int


@dataclass(frozen=True)
class Outcome:
    """A gate decision: the plan, and its bytes as ``fixed + per_token * routed tokens`` (exact at any imbalance;
    ``PlanCost.activation_bytes_at``)."""

    plan: Plan
    action: GateAction
    changed: bool
    overhead_s: float
    fixed_bytes: int
    per_token_bytes: int
    graph: OpGraph         # the bucket's, on which it was decided (its order is solved there)
    activation_bytes: int  # at the bucket's imbalance
    orders: dict = field(default_factory=dict, compare=False, repr=False)  # warmup? -> its point's (memo on)
    shifted: dict = field(default_factory=dict, compare=False, repr=False)  # layer offset -> moved plan (memo on)


@dataclass(frozen=True)
class Row:
    bucket: float
    graph: OpGraph
    unmitigated_bytes: int   # on the bucket's graph ...
    fixed_bytes: int         # ... = fixed + per_token * routed tokens, exact at any imbalance
    per_token_bytes: int


class Seen:
    """A measured imbalance on a chunk: its bucket row, routed tokens, exact unmitigated bytes, the covered
    decisions (steady, warmup; made on first use), the canonical chunk and the layer offset."""

    __slots__ = ("row", "tokens", "unmitigated_bytes", "steady", "warmup", "chunk", "offset")

    def __init__(self, row: Row, tokens: int, chunk: int, offset: int):
        self.row, self.tokens, self.chunk, self.offset = row, tokens, chunk, offset
        self.unmitigated_bytes = row.fixed_bytes + row.per_token_bytes * tokens
        self.steady = self.warmup = None


def split_bytes(graph: OpGraph, cost: PlanCost) -> tuple[int, int]:
    """``cost``'s bytes as ``(fixed, per routed token)``: routed tensors hold ``routed_tokens(r)`` copies."""
    built = graph.routed_tokens(graph.imbalance)
    per_token = cost.routed_bytes // built if built else 0
    return cost.activation_bytes - per_token * built, per_token
