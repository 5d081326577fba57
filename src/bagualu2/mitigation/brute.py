"""Brute force over every per-saving strategy assignment, for tiny graphs (tests only).

It enumerates strategies per ``(op, tensor)`` saving — not per tensor — and keeps the conflict-free plans
(``check_conflicts``) that fit the budget, so it checks the other solvers' reduction to per-tensor choices too.
"""

from __future__ import annotations

import itertools
import time

from ..costmodel import OpGraph, Plan, Strategy, evaluate
from ..costmodel.validate import require_int
from .conflicts import check_conflicts
from .solution import Solution, SolveStatus, check_budget, check_graph, infeasible, make_solution

MAX_DECISIONS = 10


def solve(graph: OpGraph, budget_bytes: int, *, max_decisions: int = MAX_DECISIONS) -> Solution:
    started = time.perf_counter()
    check_graph(graph)
    budget_bytes = check_budget(budget_bytes)
    max_decisions = require_int("max_decisions", max_decisions, 0)
    decisions = graph.decisions
    if len(decisions) > max_decisions:
        raise ValueError(f"brute force handles at most max_decisions={max_decisions} savings, "
                         f"the graph has {len(decisions)}")
    if budget_bytes < graph.floor_bytes:
        return infeasible(graph, budget_bytes, "brute", started, time.perf_counter())
    options = []
    for op_name, tensor in decisions:
        saving = next(s for s in graph.op(op_name).saves if s.tensor == tensor)
        allowed = [Strategy.KEEP, Strategy.RECOMPUTE, Strategy.OFFLOAD]
        if graph.quantizable(saving):
            allowed.append(Strategy.QUANTIZE)
        options.append(allowed)
    best: tuple[int, int, Plan] | None = None
    for combo in itertools.product(*options):
        plan = Plan.from_decisions(dict(zip(decisions, combo)))
        cost = evaluate(graph, plan)
        if cost.activation_bytes > budget_bytes:
            continue
        key = (cost.overhead_ns, len(plan))
        if best is not None and key >= best[:2]:
            continue
        if check_conflicts(graph, plan):
            continue
        best = (*key, plan)
    if best is None:
        return make_solution(graph, Plan(), SolveStatus.INFEASIBLE, "brute", started, time.perf_counter(),
                             reason="no conflict-free plan fits the budget")
    return make_solution(graph, best[2], SolveStatus.OPTIMAL, "brute", started, time.perf_counter())
