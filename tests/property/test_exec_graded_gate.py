"""Random pre-gate plans and budgets under graded deferred planning, on the running reference model: whatever the
gates decide (keep, re-plan the MoE module — including what the norm and the router saved before the gate — or
the full downgrade), the bytes kept are ``evaluate`` of the plan in force and, without QUANTIZE, the loss and the
gradients are bitwise those of the plain run; nothing is left unsettled."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from conftest import scaled
from hypothesis import strategies as st

from bagualu2.costmodel import ParallelConfig, Plan, Strategy, build_graph, evaluate, presets
from bagualu2.exec import DeferredPlanner
from bagualu2.mitigation.space import decision_space
from exec_run import run_plan

CONFIG = presets.model("tiny-moe")[0].replace(seq_length=16)
HARDWARE = presets.hardware("cpu")
GRAPH = build_graph(CONFIG, ParallelConfig(), HARDWARE)
SPACE = decision_space(GRAPH)


def _run(plan, deferred=None):
    record, loss, grads, _ = run_plan(CONFIG, GRAPH, plan, deferred=deferred)
    return record, loss, list(grads.values())


PLAIN = _run(None)


@st.composite
def cases(draw):
    chosen = {}
    for choice in SPACE.choices:  # one strategy per tensor (the solvers' conflict-free space)
        options = [Strategy.KEEP, *choice.strategies]
        strategy = draw(st.sampled_from(options))
        if strategy is not Strategy.KEEP:
            chosen[choice.tensor] = strategy
    share = draw(st.floats(0.0, 1.0))
    return SPACE.plan(chosen), GRAPH.floor_bytes + int((GRAPH.unmitigated_bytes - GRAPH.floor_bytes) * share)


@pytest.mark.slow
@settings(max_examples=scaled(10))
@given(cases())
def test_graded_gates_keep_exact_bytes_and_bitwise_gradients(case):
    plan, budget = case
    planner = DeferredPlanner(CONFIG, ParallelConfig(), HARDWARE, budget_bytes=budget)
    record, loss, grads = _run(plan, planner)
    assert record.device_bytes == evaluate(GRAPH, record.plan).activation_bytes
    assert not record.provisional and not record.standby and record.unknown_count == 0
    if not any(s is Strategy.QUANTIZE for _, s in record.plan.entries):
        _, loss0, grads0 = PLAIN
        assert torch.equal(loss, loss0)
        assert all(torch.equal(a, b) for a, b in zip(grads0, grads))


@pytest.mark.slow
def test_a_plan_of_kind_policies_falls_back_to_the_full_downgrade():
    """A plan that is not one strategy per tensor cannot be re-planned part by part: the gate keeps or downgrades."""
    plan = Plan.from_str("expert_act=RECOMPUTE,shared_fc1=OFFLOAD")
    planner = DeferredPlanner(CONFIG, ParallelConfig(), HARDWARE, budget_bytes=GRAPH.floor_bytes)
    record, _, grads = _run(plan, planner)
    assert record.device_bytes == evaluate(GRAPH, record.plan).activation_bytes
    assert all(torch.equal(a, b) for a, b in zip(PLAIN[2], grads))
