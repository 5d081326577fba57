"""Offload-prefix plans (``bagualu2.mitigation.prefix``) against brute force over every prefix length, on random
graphs and on a Table II chunk, and Megatron-Kwai's search over the same family (the runtime's use of them:
``tests/unit/test_hidden_copies.py``)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bagualu2.costmodel import OpGraph, ParallelConfig, Plan, Strategy, build_graph, evaluate, presets, resolve
from bagualu2.mitigation import SolveStatus, check_conflicts, prefix
from test_solver_properties import random_graphs

MODEL = presets.model("tiny-moe")[0]
GRAPH = build_graph(MODEL, ParallelConfig(), presets.hardware("paper-gpu"))


def _check(graph, base, budget):
    if evaluate(graph, base).unavailable:  # the base cannot run at all: no member of its family can
        assert prefix.fit_prefix(graph, base, budget).status is SolveStatus.INFEASIBLE
        return
    kept = prefix.kept_tensors(graph, base)
    sizes = [evaluate(graph, prefix.prefix_plan(graph, base, n, kept)).activation_bytes for n in range(len(kept) + 1)]
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))  # one more offloaded tensor never keeps more
    solution = prefix.fit_prefix(graph, base, budget)
    fitting = [n for n, size in enumerate(sizes) if size <= budget]
    if not fitting:
        assert solution.status is SolveStatus.INFEASIBLE
        return
    assert solution.ok and solution.stats["offloaded"] == fitting[0]  # the shortest prefix that fits
    assert solution.cost.activation_bytes == sizes[fitting[0]] <= budget
    assert check_conflicts(graph, solution.plan) == []
    strategies = resolve(graph, solution.plan)
    pinned = set(graph.pinned)
    assert all(strategies[key] is Strategy.KEEP for key in pinned)  # block inputs are never offloaded
    base_strategies = resolve(graph, base)
    assert all(strategies[key] in (base_strategies[key], Strategy.OFFLOAD) for key in strategies)


def test_a_base_that_keeps_savings_explicitly():
    """An explicit KEEP in the base gives way to the OFFLOAD of its tensor (one strategy per saving)."""
    key = next(f"{op.name}/{saving.tensor}" for op, saving in GRAPH.savings if (op.name, saving.tensor)
               not in GRAPH.pinned)
    base = Plan.of({key: Strategy.KEEP})
    _check(GRAPH, base, GRAPH.floor_bytes + (GRAPH.unmitigated_bytes - GRAPH.floor_bytes) // 2)
    assert prefix.prefix_plan(GRAPH, base, 1) == prefix.prefix_plan(GRAPH, Plan(), 1)


@settings(deadline=None)
@given(random_graphs(), st.floats(0.0, 1.2), st.booleans())
def test_fit_prefix_is_the_shortest_prefix_that_fits_random_graphs(graph, fraction, elementwise):
    base = Plan.uniform({"mlp_act": Strategy.RECOMPUTE}) if elementwise else Plan()
    _check(graph, base, int(fraction * graph.unmitigated_bytes))


@pytest.mark.parametrize("base", prefix.BASES, ids=["none", "elementwise"])
@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.6, 0.9, 1.0])
def test_fit_prefix_on_a_moe_chunk(base, fraction):
    _check(GRAPH, base, int(GRAPH.floor_bytes + fraction * (GRAPH.unmitigated_bytes - GRAPH.floor_bytes)))


def test_kwai_searches_the_same_family():
    """Megatron-Kwai's configurations are prefix plans of the two bases (alpha ascending)."""
    from bagualu2.sim.policies import KWAI_BASE, KWAI_STEPS, Kwai

    assert KWAI_BASE == prefix.ELEMENTWISE
    configurations = list(Kwai.configurations(GRAPH))
    assert len(configurations) == 2 * (KWAI_STEPS + 1)
    for level, alpha, plan in configurations:
        base = Plan() if level == "none" else prefix.ELEMENTWISE
        kept = prefix.kept_tensors(GRAPH, base)
        count = -(-round(alpha * KWAI_STEPS) * len(kept) // KWAI_STEPS)
        assert plan == prefix.prefix_plan(GRAPH, base, count)


def test_a_base_that_cannot_be_recomputed_is_infeasible():
    """A base that recomputes a tensor no re-run makes (a graph input, here not pinned) yields no plan, whatever
    the budget."""
    graph = OpGraph(GRAPH.ops, GRAPH.tensors, GRAPH.hardware, pinned=frozenset(), imbalance=GRAPH.imbalance,
                    activation_dtype=GRAPH.activation_dtype, mean_routed_tokens=GRAPH.mean_routed_tokens)
    base = Plan.of({"L0.norm1/L0.x": Strategy.RECOMPUTE})
    assert evaluate(graph, base).unavailable
    solution = prefix.fit_prefix(graph, base, graph.unmitigated_bytes)
    assert solution.status is SolveStatus.INFEASIBLE and "cannot regenerate" in solution.reason
