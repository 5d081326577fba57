"""AdaPipe's greedy (``bagualu2.sim.policies.adapipe_plan``) against its definition: at every step score every
kept tensor again and recompute the best, until the chunk fits. The policy re-scores only the tensors of the
layers the last choice touched; the plans must be the same."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import scaled
from hypothesis import given, settings
from hypothesis import strategies as st

from bagualu2.costmodel import Plan, Strategy, build_graph, evaluate, presets
from bagualu2.sim.policies import NO_PLAN, adapipe_plan, full_recompute

HW = presets.hardware("paper-gpu")
LAYOUTS = [("glm-188b-a20b", {}), ("tiny-moe", {}), ("tiny-dense", {}), ("glm-188b-a20b", {"pp": 8, "vp": 1})]


def by_definition(graph, target_bytes: int) -> Plan:
    """Every kept tensor scored at every step (bytes freed per added recompute-ns; the first of equals)."""
    pinned = {tensor for _, tensor in graph.pinned}
    left: dict[str, list[str]] = {}
    for op, saving in graph.savings:
        if saving.tensor not in pinned:
            left.setdefault(saving.tensor, []).append(f"{op.name}/{saving.tensor}")
    plan, cost = NO_PLAN, evaluate(graph, NO_PLAN)
    while cost.activation_bytes > target_bytes:
        best = None
        for tensor, keys in left.items():
            candidate = Plan(plan.entries + tuple((key, Strategy.RECOMPUTE) for key in keys))
            found = evaluate(graph, candidate)
            freed = cost.activation_bytes - found.activation_bytes
            if found.unavailable or freed <= 0:
                continue
            score = freed / max(found.recompute_ns - cost.recompute_ns, 1)
            if best is None or score > best[0]:
                best = (score, tensor, candidate, found)
        if best is None:
            return full_recompute(graph)
        _, tensor, plan, cost = best
        del left[tensor]
    return plan


def graph_of(layout: int, stage: int, imbalance: float):
    name, changes = LAYOUTS[layout]
    model, parallel = presets.model(name)
    parallel = dataclasses.replace(parallel, **changes)
    imbalance = min(imbalance, parallel.ep)  # at most ep: all the load on one rank
    return build_graph(model, parallel, HW, imbalance=imbalance, stage=stage % parallel.pp)


@pytest.mark.slow
@settings(max_examples=scaled(25), deadline=None)
@given(st.integers(0, len(LAYOUTS) - 1), st.integers(0, 7), st.floats(1.0, 2.6), st.floats(0.0, 1.05))
def test_adapipe_equals_its_definition(layout, stage, imbalance, fraction):
    graph = graph_of(layout, stage, imbalance)
    target = int(graph.floor_bytes + fraction * (graph.unmitigated_bytes - graph.floor_bytes))
    assert adapipe_plan(graph, target) == by_definition(graph, target)


def test_adapipe_fits_or_recomputes_everything():
    graph = graph_of(0, 0, 1.2)
    for fraction in (0.0, 0.3, 0.7, 1.0):
        target = int(graph.floor_bytes + fraction * (graph.unmitigated_bytes - graph.floor_bytes))
        plan = adapipe_plan(graph, target)
        cost = evaluate(graph, plan)
        assert cost.activation_bytes <= target or plan == full_recompute(graph)
        assert all(strategy is Strategy.RECOMPUTE for _, strategy in plan.entries)
    assert adapipe_plan(graph, graph.unmitigated_bytes) == NO_PLAN
