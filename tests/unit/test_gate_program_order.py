"""What the gate may change follows program order, not op kinds: a graph (as traced from a model) whose shared
expert runs before the router. The shared expert has stored its tensors when the gate fires, so neither they nor
the norm output it stored are free; a downgrade that would re-run an op whose outputs nothing can regenerate is
no option."""

from __future__ import annotations

import pytest

from bagualu2.costmodel import Op, OpGraph, Plan, Resource, Saving, Strategy, TensorSpec, evaluate, presets
from bagualu2.runtime import (GateAction, after_gate, after_router_tensors, downgrade_plan, gate_free_tensors,
                              unmade_after_router)
from bagualu2.runtime.gate import copy_windows

HW = presets.hardware("cpu")


def _op(name, kind, inputs, outputs, saves):
    return Op(name, kind, 0, Resource.COMPUTE, tuple(inputs), tuple(outputs),
              tuple(Saving(t, "fp32") for t in saves), 1000, 1000, 1000, 2000)


def graph(*, router_regenerable: bool = True) -> OpGraph:
    """norm -> shared expert (before the router) -> router -> experts; ``x`` the pinned block input."""
    ops = (
        _op("norm", "norm", ["x"], ["h"], ["x"]),
        _op("shared_fc1", "shared_fc1", ["h"], ["s"], ["h"]),
        _op("router", "router", ["h"], ["w"], ["h"]),
        _op("dispatch", "dispatch", ["h", "w"], ["rows"], []),
        _op("expert_fc1", "expert_fc1", ["rows"], ["e"], ["rows"]),
        _op("expert_act", "expert_act", ["e"], ["a"], ["e"]),
    )
    tensors = {name: TensorSpec(name, 64, "fp32", producer, routed)
               for name, producer, routed in (("x", None, False), ("h", "norm", False), ("s", "shared_fc1", False),
                                              ("w", "router" if router_regenerable else None, False),
                                              ("rows", "dispatch", True), ("e", "expert_fc1", True),
                                              ("a", "expert_act", True))}
    return OpGraph(ops=ops, tensors=tensors, hardware=HW, pinned=frozenset({("norm", "x")}), activation_dtype="fp32",
                   mean_routed_tokens=4)


def test_ops_before_the_router_are_not_free():
    g = graph()
    assert after_router_tensors(g) == {"rows", "e", "a"}  # not the shared expert's s: it ran before the router
    assert "h" not in gate_free_tensors(g)  # the shared expert stored the norm output before the gate
    assert gate_free_tensors(g) == {"rows", "e", "a", "w"}


def test_a_downgrade_nothing_can_regenerate_is_no_option():
    g = graph(router_regenerable=False)  # the router's output is a graph input (a random router, traced)
    full = downgrade_plan(g)
    assert evaluate(g, full).unavailable  # the re-run dispatch would need w, which nothing stores or makes
    tight = evaluate(g, full).activation_bytes
    for mode in ("paper", "graded"):
        decision = after_gate(g, Plan(), tight, downgrade=mode)
        assert not decision.cost.unavailable
        assert decision.action in (GateAction.KEEP, GateAction.REPLAN)
    assert after_gate(g, Plan(), tight, downgrade="paper").plan == Plan()  # kept: an overrun the caller records


def test_keep_fits_is_the_callers_exact_answer_for_the_plan_in_force():
    g = graph()
    unmitigated = evaluate(g, Plan()).activation_bytes
    tight = unmitigated - 1  # the plan in force overruns this budget by one byte
    for mode in ("paper", "graded"):
        assert after_gate(g, Plan(), tight, downgrade=mode).action is not GateAction.KEEP
        kept = after_gate(g, Plan(), tight, downgrade=mode, keep_fits=True)  # it fits the caller's own budget
        assert kept.action is GateAction.KEEP and kept.plan == Plan()
        refused = after_gate(g, Plan(), unmitigated, downgrade=mode, keep_fits=False)
        assert refused.action is not GateAction.KEEP
    with pytest.raises(ValueError, match="keep_fits must be true, false or None"):
        after_gate(g, Plan(), tight, keep_fits=1)


def test_copies_are_priced_in_full_then_free_up_to_the_window_and_up_to_half_of_it():
    assert copy_windows(0) == (0,) and copy_windows(1) == (0, 1) and copy_windows(9) == (0, 9, 4)


def cast_graph() -> OpGraph:
    """router -> experts whose GEMM keeps only its own cast of the rows (``c``: no op makes it, as traced from fp32
    grouped GEMMs), and a norm before the router that keeps a graph input ``y`` no op makes either."""
    ops = (
        _op("norm", "norm", ["x", "y"], ["h"], ["x", "y"]),
        _op("router", "router", ["h"], ["w"], ["h"]),
        _op("dispatch", "dispatch", ["h", "w"], ["rows"], []),
        _op("expert_fc1", "expert_fc1", ["rows", "c"], ["e"], ["c"]),
        _op("expert_act", "expert_act", ["e"], ["a"], ["e"]),
    )
    tensors = {name: TensorSpec(name, 256 if name == "c" else 64, "fp32", producer, routed)
               for name, producer, routed in (("x", None, False), ("y", None, False), ("h", "norm", False),
                                              ("w", "router", False), ("rows", "dispatch", True),
                                              ("c", None, True), ("e", "expert_fc1", True), ("a", "expert_act", True))}
    return OpGraph(ops=ops, tensors=tensors, hardware=HW, pinned=frozenset({("norm", "x")}), activation_dtype="fp32",
                   mean_routed_tokens=4)


def test_what_only_ops_after_the_router_keep_and_no_op_makes_can_still_be_offloaded():
    g = cast_graph()
    assert unmade_after_router(g) == {"c"}  # not y: the norm, before the router, stored it already
    assert "c" in gate_free_tensors(g) and "y" not in gate_free_tensors(g)
    full = downgrade_plan(g)
    assert full.explicit()[("expert_fc1", "c")] is Strategy.OFFLOAD  # nothing can recompute it
    assert full.explicit()[("expert_act", "e")] is Strategy.RECOMPUTE
    assert not evaluate(g, full).unavailable
    keep = evaluate(g, Plan())
    c_bytes = g.tensors["c"].nbytes
    # only offloading c fits (c is 4x each other tensor): the gate must find it, graded and paper
    budget = keep.activation_bytes - c_bytes
    for mode in ("graded", "paper"):
        decision = after_gate(g, Plan(), budget, downgrade=mode)
        assert decision.cost.activation_bytes <= budget, mode
        assert decision.plan.explicit()[("expert_fc1", "c")] is Strategy.OFFLOAD, mode


def test_what_a_pinned_saving_keeps_is_not_offloaded():
    g = cast_graph()
    pinned = OpGraph(ops=g.ops, tensors=g.tensors, hardware=HW, pinned=g.pinned | {("expert_fc1", "c")},
                     activation_dtype="fp32", mean_routed_tokens=4)
    assert unmade_after_router(pinned) == frozenset()
    assert ("expert_fc1", "c") not in downgrade_plan(pinned).explicit()
