"""The one result type of every mitigation solver."""

from __future__ import annotations

from ..costmodel.validate import require_int

import enum
import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

from ..costmodel import OpGraph, Plan, PlanCost, evaluate
from ..costmodel.evaluate import check_graph


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
    """Full recompute: every mitigable saving RECOMPUTE (keeps only the pinned block inputs)."""
    from ..costmodel import Strategy

    check_graph(graph)
    pinned = {tensor for _, tensor in graph.pinned}
    return Plan.from_decisions({key: Strategy.RECOMPUTE for key in graph.decisions if key[1] not in pinned})


def make_solution(graph: OpGraph, plan: Plan, status: SolveStatus, solver: str, started_s: float, now_s: float,
                  stats: Mapping[str, Any] | None = None, reason: str = "") -> Solution:
    return Solution(status=status, plan=plan, cost=_evaluate(graph, plan), solver=solver,
                    solve_time_s=now_s - started_s, stats=MappingProxyType(dict(stats or {})), reason=reason)


_UNMITIGATED: "weakref.WeakKeyDictionary[OpGraph, PlanCost]" = weakref.WeakKeyDictionary()


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
