"""The greedy's copy window (``GreedyConfig.copy_window_ns``): copies hidden up to the window, priced in full beyond
it; the runtime's ``hidden_copies`` keeps the faster plan of a scheduling point."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from test_solver_properties import _budget, budget_fraction, random_graphs

from bagualu2.costmodel import Plan, evaluate
from bagualu2.mitigation import SolveStatus, check_conflicts, greedy
from bagualu2.mitigation.greedy import GreedyConfig

windows = st.integers(0, 200_000)


def exposed_ns(cost, window_ns: int) -> int:
    return cost.recompute_ns + cost.quantize_ns + max(0, cost.offload_ns - window_ns)


@given(random_graphs(), budget_fraction, windows, st.sampled_from(["improved", "paper"]))
def test_a_window_prices_only_the_exposed_copies_and_still_fits(graph, fraction, window, variant):
    budget = _budget(graph, fraction)
    plain = greedy.solve(graph, budget, config=GreedyConfig(variant=variant))
    assert greedy.solve(graph, budget, config=GreedyConfig(variant=variant, copy_window_ns=0)).plan == plain.plan
    hidden = greedy.solve(graph, budget, config=GreedyConfig(variant=variant, copy_window_ns=window))
    assert hidden.ok == plain.ok
    assert hidden.cost == evaluate(graph, hidden.plan)
    if hidden.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
        assert hidden.cost.activation_bytes <= budget and check_conflicts(graph, hidden.plan) == []
        assert hidden.stats["estimated_overhead_ns"] == exposed_ns(hidden.cost, window)
    if plain.ok:
        assert plain.stats["estimated_overhead_ns"] == exposed_ns(plain.cost, 0)


@given(random_graphs(), budget_fraction, windows)
def test_the_re_plan_after_a_gate_takes_the_window_too(graph, fraction, window):
    from bagualu2.mitigation.space import decision_space

    budget = _budget(graph, fraction)
    tensors = [c.tensor for c in decision_space(graph).choices]
    free = tensors[len(tensors) // 2:]
    solution = greedy.solve(graph, budget, fixed=Plan(), free=free, config=GreedyConfig(copy_window_ns=window))
    assert solution.cost == evaluate(graph, solution.plan)
    if solution.ok:
        assert solution.cost.activation_bytes <= budget
        assert solution.stats["estimated_overhead_ns"] == exposed_ns(solution.cost, window)
