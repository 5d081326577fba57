"""Offload-prefix plans: a base plan plus OFFLOAD of the first tensors it still keeps, in graph order.

    prefix_plan(graph, base, count)        # base + OFFLOAD of every saving of the first ``count`` kept tensors
    fit_prefix(graph, base, budget_bytes)  # the shortest prefix that fits, as a Solution (INFEASIBLE if none)

A family of candidate plans beside Algorithm 2's greedy. The greedy prices each tensor on its own and, with copy
time to spare, may send tensors through the copy engines that are nearly free to recompute; a prefix plan
recomputes at most the cheap element-wise ops (``ELEMENTWISE``) and offloads whole tensors from the front of the
chunk, whose reloads have the longest to hide behind. Megatron-Kwai's configurations (a checkpointing level and an
offloaded share) are members of it. The runtime keeps whichever candidate's scheduling point is shorter.
Block inputs (the graph's pinned savings) are never offloaded here: they are what the pipeline passes on.
"""

from __future__ import annotations

import time

from ..costmodel.evaluate import evaluate, resolve
from ..costmodel.graph import OpGraph
from ..costmodel.plan import Plan
from ..costmodel.strategy import Strategy
from ..costmodel.validate import require_int
from .solution import SolveStatus, Solution, check_budget, check_graph, make_solution

# compute-memory balanced checkpointing: recompute the element-wise ops, whose re-run costs a pass over memory
ELEMENTWISE = Plan.uniform({"norm": Strategy.RECOMPUTE, "expert_act": Strategy.RECOMPUTE,
                            "shared_act": Strategy.RECOMPUTE, "mlp_act": Strategy.RECOMPUTE})
BASES = (Plan(), ELEMENTWISE)


def tensor_savings(graph: OpGraph) -> dict[str, list[str]]:
    """Mitigable tensors (block inputs excluded) in graph order, with the ``op/tensor`` keys of their savings."""
    pinned = {tensor for _, tensor in graph.pinned}
    by_tensor: dict[str, list[str]] = {}
    for op, saving in graph.savings:
        if saving.tensor not in pinned:
            by_tensor.setdefault(saving.tensor, []).append(f"{op.name}/{saving.tensor}")
    return by_tensor


def _checked(graph, base) -> tuple[OpGraph, Plan]:
    """``(graph, base)``: an OpGraph and a plan (its text form read); one ``ValueError`` otherwise."""
    check_graph(graph)
    try:
        base = Plan.coerce(base)
    except ValueError as exc:
        raise ValueError(f"base: {exc}") from None
    return graph, Plan() if base is None else base


def kept_tensors(graph: OpGraph, base: Plan) -> list[tuple[str, ...]]:
    """The ``op/tensor`` keys of the savings of each tensor ``base`` keeps entirely, in graph order (block inputs
    left out)."""
    strategies = resolve(graph, base)
    return [tuple(keys) for keys in tensor_savings(graph).values()
            if all(strategies[tuple(key.split("/", 1))] is Strategy.KEEP for key in keys)]


def prefix_plan(graph: OpGraph, base: Plan, count: int, kept: list[tuple[str, ...]] | None = None) -> Plan:
    """``base`` plus OFFLOAD of every saving of the first ``count`` tensors it keeps (``kept``: those, if known)."""
    graph, base = _checked(graph, base)
    count = require_int("count", count, 0)
    kept = kept_tensors(graph, base) if kept is None else kept
    entries = dict(base.entries)  # an explicit KEEP of an offloaded saving gives way
    entries.update((key, Strategy.OFFLOAD) for keys in kept[:count] for key in keys)
    return Plan(tuple(entries.items()))


def fit_prefix(graph: OpGraph, base: Plan, budget_bytes: int) -> Solution:
    """The prefix plan of ``base`` with the fewest offloaded tensors that keeps at most ``budget_bytes`` (a
    bisection: offloading one more tensor never keeps more); INFEASIBLE when even the whole prefix does not fit, or
    when ``base`` recomputes a tensor that no re-run can make (``PlanCost.unavailable``)."""
    started = time.perf_counter()
    graph, base = _checked(graph, base)
    budget_bytes = check_budget(budget_bytes)
    kept = kept_tensors(graph, base)

    def fits(count: int) -> bool:
        return evaluate(graph, prefix_plan(graph, base, count, kept)).activation_bytes <= budget_bytes

    name = "offload-prefix"
    unavailable = evaluate(graph, base).unavailable
    if unavailable:  # the base recomputes a tensor no re-run can make: no member of the family can run
        return make_solution(graph, base, SolveStatus.INFEASIBLE, name, started, time.perf_counter(),
                             reason=f"the base plan cannot regenerate {unavailable[0]}")
    if not fits(len(kept)):
        return make_solution(graph, prefix_plan(graph, base, len(kept), kept), SolveStatus.INFEASIBLE, name,
                             started, time.perf_counter(), reason="the whole prefix does not fit")
    low, high = 0, len(kept)  # fits(high); find the least such count
    while low < high:
        middle = (low + high) // 2
        if fits(middle):
            high = middle
        else:
            low = middle + 1
    status = SolveStatus.OPTIMAL if high == 0 and not base.entries else SolveStatus.FEASIBLE
    return make_solution(graph, prefix_plan(graph, base, high, kept), status, name, started, time.perf_counter(),
                         {"offloaded": high})
