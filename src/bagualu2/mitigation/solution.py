"""The one result type of every mitigation solver."""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from ..costmodel import OpGraph, Plan, PlanCost, evaluate
from ..costmodel.evaluate import check_graph
from ..costmodel.validate import require_int


class SolveStatus(enum.Enum):
    OPTIMAL = "OPTIMAL"        # proven optimal (or nothing to mitigate)
    FEASIBLE = "FEASIBLE"      # fits the budget, optimality not proven
    INFEASIBLE = "INFEASIBLE"  # even the floor (M0) exceeds the budget
    TIMEOUT = "TIMEOUT"        # the time limit ran out before any plan was found


@dataclass(frozen=True)
class Solution:
    """Decisions of a solver plus their cost, always computed by ``costmodel.evaluate``.

    When no plan fits, ``reason`` says why and ``plan`` is the best effort: the full-recompute floor plan
    (budget below M0, CP-SAT timeout), what the greedy reached, or the empty plan (brute force).
    """

    status: SolveStatus
    plan: Plan
    cost: PlanCost
    solver: str
    solve_time_s: float
    stats: Mapping[str, Any] = field(default_factory=dict)
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE)


def check_budget(budget_bytes: Any) -> int:
    """Budgets are non-negative integers of bytes; anything else is a ``ValueError``."""
    return require_int("budget_bytes", budget_bytes, 0)


def floor_plan(graph: OpGraph) -> Plan:
    """Full recompute: every mitigable saving RECOMPUTE (keeps only the pinned block inputs), but OFFLOAD where no
    re-run can make the tensor (``PlanCost.unavailable``: a traced graph's tensors made outside every op), so the
    plan runs and keeps M0 on the device."""
    from ..costmodel import Strategy

    check_graph(graph)
    found = _FLOORS.get(graph)
    if found is not None:
        return found
    pinned = {tensor for _, tensor in graph.pinned}
    decisions = {key: Strategy.RECOMPUTE for key in graph.decisions if key[1] not in pinned}
    plan = Plan.from_decisions(decisions)
    for _ in range(len(decisions)):  # each round offloads at least one more tensor, or stops
        unavailable = set(_evaluate(graph, plan).unavailable)
        moved = [key for key, strategy in decisions.items() if key[1] in unavailable and strategy is Strategy.RECOMPUTE]
        if not moved:
            break
        decisions.update(dict.fromkeys(moved, Strategy.OFFLOAD))
        plan = Plan.from_decisions(decisions)
    _FLOORS[graph] = plan
    return plan


def make_solution(graph: OpGraph, plan: Plan, status: SolveStatus, solver: str, started_s: float, now_s: float,
                  stats: Mapping[str, Any] | None = None, reason: str = "") -> Solution:
    return Solution(status=status, plan=plan, cost=_evaluate(graph, plan), solver=solver,
                    solve_time_s=now_s - started_s, stats=MappingProxyType(dict(stats or {})), reason=reason)


_UNMITIGATED: "weakref.WeakKeyDictionary[OpGraph, PlanCost]" = weakref.WeakKeyDictionary()
_FLOORS: "weakref.WeakKeyDictionary[OpGraph, Plan]" = weakref.WeakKeyDictionary()  # floor_plan per graph object


def _evaluate(graph: OpGraph, plan: Plan) -> PlanCost:
    """``evaluate(graph, plan)``; the cost of the empty plan (every budget above the unmitigated bytes) is
    cached per graph object."""
    if plan.entries:
        return evaluate(graph, plan)
    found = _UNMITIGATED.get(graph)
    if found is None:
        found = _UNMITIGATED[graph] = evaluate(graph, plan)
    return found


def infeasible(graph: OpGraph, budget_bytes: int, solver: str, started_s: float, now_s: float) -> Solution:
    return make_solution(graph, floor_plan(graph), SolveStatus.INFEASIBLE, solver, started_s, now_s,
                         reason=f"budget {budget_bytes} bytes is below the floor M0 = {graph.floor_bytes} bytes "
                                "(full recompute keeps only block inputs)")
