"""The deferred planner's ``downgrade="paper"`` fast path decides exactly as ``runtime.after_gate`` does."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from conftest import scaled
from hypothesis import strategies as st

from bagualu2.costmodel import Plan, evaluate, presets
from bagualu2.exec import DeferredPlanner
from bagualu2.mitigation import greedy
from bagualu2.runtime import GateAction, after_gate, ceil_bucket

MODEL, PARALLEL = presets.model("glm-188b-a20b")
HW = presets.hardware("paper-gpu")
PLANNER = DeferredPlanner(MODEL, PARALLEL, HW, budget_bytes=0, downgrade="paper", imbalance_step=0.05,
                          budget_quantum_bytes=1 << 20)
BASE = PLANNER.graph(1.0)
PLANS = [greedy.solve(BASE, BASE.floor_bytes + int(f * (BASE.unmitigated_bytes - BASE.floor_bytes))).plan
         for f in (0.0, 0.3, 0.7, 1.0)]
LAYERS = sorted({op.layer for op in BASE.ops if op.kind == "router"})


@settings(max_examples=scaled(40), deadline=None)
@given(st.sampled_from(PLANS), st.sampled_from(LAYERS), st.floats(1.0, 3.0), st.floats(0.2, 1.3))
def test_paper_fast_path_equals_the_runtime_decision(plan, layer, rate, fraction):
    tokens = int(BASE.mean_routed_tokens * rate)
    budget = int(fraction * BASE.unmitigated_bytes)
    got = PLANNER.after_gate(plan, layer, tokens, budget_bytes=budget)
    imbalance = ceil_bucket(max(tokens / BASE.mean_routed_tokens, 1.0), 0.05)
    graph = PLANNER.graph(imbalance)
    want = after_gate(graph, plan, budget - budget % (1 << 20), downgrade="paper", downgrade_layers=(layer,))
    assert (got is None) == (not want.changed)
    if got is not None:
        assert got == want.plan
    assert PLANNER.decisions[-1] == (layer, imbalance, evaluate(graph, plan).activation_bytes, want.changed)


def test_what_no_op_makes_is_neither_standby_nor_provisional():
    """A tensor no op makes that only ops after the router keep (the gate may offload it) is stored after the
    gate: exec holds nothing of it, and no ``None`` producer enters the standby ops."""
    import sys
    from pathlib import Path
    from types import SimpleNamespace

    from bagualu2.exec.provisional import standby_ops

    sys.path.insert(0, str(Path(__file__).parent))
    from test_gate_program_order import cast_graph

    for mode in ("graded", "paper"):
        ops, provisional = standby_ops(cast_graph(), SimpleNamespace(mode=mode))
        assert None not in ops and ops == {"norm", "router"}, mode
        assert "c" not in provisional, mode


@pytest.mark.parametrize("mode", ["graded", "paper"])
def test_a_graph_without_moe_layers_keeps_its_plan_at_the_gate(mode):
    """Nothing after a router to downgrade: an overrun is kept as it is (no change reported), not a DOWNGRADE
    that runs the same plan."""
    from bagualu2.costmodel import build_graph

    model, parallel = presets.model("tiny-dense")
    graph = build_graph(model, parallel, presets.hardware("cpu"))
    decision = after_gate(graph, Plan(), graph.floor_bytes, downgrade=mode)
    assert decision.action is GateAction.KEEP and not decision.changed and decision.plan == Plan()
