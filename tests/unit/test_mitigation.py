"""Mitigation solvers, conflict checker, plan cache and deferred planning on the paper's presets."""

import pytest

from bagualu2.costmodel import Plan, Strategy, build_graph, evaluate, presets
from bagualu2.mitigation import SolveStatus, check_conflicts, exact, greedy
from bagualu2.runtime import after_gate, downgrade_plan
from bagualu2.mitigation.greedy import GreedyConfig

HW = presets.hardware("paper-gpu")


def _graph(name="glm-1041b-a35b", imbalance=1.0):
    model, parallel = presets.model(name)
    return build_graph(model, parallel, HW, imbalance=imbalance)


def _budgets(graph, n=6):
    lo, hi = graph.floor_bytes, graph.unmitigated_bytes
    return [lo + (hi - lo) * i // (n - 1) for i in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["glm-188b-a20b", "glm-1041b-a35b"])
@pytest.mark.parametrize("imbalance", [1.0, 2.6])
def test_solvers_fit_budget_conflict_free_and_exact_not_worse(name, imbalance):
    graph = _graph(name, imbalance)
    for budget in _budgets(graph):
        fast = greedy.solve(graph, budget)
        paper = greedy.solve(graph, budget, config=GreedyConfig(variant="paper"))
        best = exact.solve(graph, budget, time_limit_s=20, num_workers=1, seed=0)
        for solution in (fast, paper, best):
            assert solution.ok, solution.reason
            assert solution.cost == evaluate(graph, solution.plan)
            assert solution.cost.activation_bytes <= budget
            assert check_conflicts(graph, solution.plan) == []
            assert Plan.from_str(repr(solution.plan)) == solution.plan
        assert best.cost.overhead_ns <= fast.cost.overhead_ns
        if best.status is SolveStatus.OPTIMAL:
            assert best.stats["objective_ns"] == best.cost.overhead_ns


def test_nothing_to_do_is_optimal_and_empty():
    graph = _graph()
    for solve in (greedy.solve, exact.solve):
        solution = solve(graph, graph.unmitigated_bytes)
        assert solution.status is SolveStatus.OPTIMAL
        assert solution.cost.overhead_ns == 0 and solution.cost.activation_bytes == graph.unmitigated_bytes


@pytest.mark.parametrize("solve", [greedy.solve, exact.solve])
def test_below_floor_is_infeasible_value_with_reason(solve):
    graph = _graph()
    solution = solve(graph, graph.floor_bytes - 1)
    assert solution.status is SolveStatus.INFEASIBLE and not solution.ok
    assert str(graph.floor_bytes) in solution.reason
    at_floor = solve(graph, graph.floor_bytes)
    assert at_floor.ok and at_floor.cost.activation_bytes == graph.floor_bytes


@pytest.mark.parametrize("budget", [-1, 1.5e9, "1000", True, None])
@pytest.mark.parametrize("solve", [greedy.solve, exact.solve])
def test_bad_budgets_raise(solve, budget):
    with pytest.raises(ValueError, match="budget_bytes"):
        solve(_graph(), budget)


def test_bad_solver_options_raise():
    graph = _graph()
    with pytest.raises(ValueError, match="variant"):
        GreedyConfig(variant="fast")
    for kwargs, field in [({"time_limit_s": 0}, "time_limit_s"), ({"num_workers": 0}, "num_workers"),
                          ({"seed": -1}, "seed")]:
        with pytest.raises(ValueError, match=field):
            exact.solve(graph, graph.unmitigated_bytes, **kwargs)


def test_conflict_checker_names_op_and_tensor_for_every_rule():
    graph = _graph()
    plan = Plan.of({
        "L0.attn_out/L0.attn_out_in": "OFFLOAD",         # core_attn keeps it: multi-device
        "L0.shared_fc1/L0.norm2_out": "QUANTIZE",        # router keeps FP32: multi-precision
        "L0.router/L0.norm2_out": "KEEP",
        "L0.norm1/L0.x": "OFFLOAD",                      # pinned block input: invalid entry
        "L0.permute/L0.routing_map": "QUANTIZE",         # int32 indices: invalid entry
    })
    violations = check_conflicts(graph, plan)
    rules = {(v.rule, v.op, v.tensor) for v in violations}
    assert ("multi-device", "L0.attn_out", "L0.attn_out_in") in rules
    assert ("multi-precision", "L0.shared_fc1", "L0.norm2_out") in rules
    assert ("invalid-entry", "L0.norm1", "L0.x") in rules
    assert ("invalid-entry", "L0.permute", "L0.routing_map") in rules
    assert all(str(v).startswith(v.rule) for v in violations)
    assert check_conflicts(graph, None) == [] and check_conflicts(graph, Plan()) == []


def test_recompute_unavailable_rule():
    graph = _graph()
    # recomputing norm1's output is fine (the block input is kept) ...
    assert check_conflicts(graph, Plan.of({"L0.qkv/L0.norm1_out": "R"})) == []
    # ... but a graph whose input is not kept cannot regenerate from it
    from bagualu2.costmodel import OpGraph
    unpinned = OpGraph(ops=graph.ops, tensors=graph.tensors, hardware=graph.hardware)
    violations = check_conflicts(unpinned, Plan.of({"L0.norm1/L0.x": "R", "L0.qkv/L0.norm1_out": "R"}))
    assert [v.rule for v in violations] == ["recompute-unavailable"]
    assert violations[0].tensor == "L0.x"
    solution = greedy.solve(unpinned, unpinned.unmitigated_bytes // 2)
    assert check_conflicts(unpinned, solution.plan) == []


def test_deferred_downgrade_fits_a_spike():
    model, parallel = presets.model("glm-1041b-a35b")
    planned_for = build_graph(model, parallel, HW, imbalance=1.0)
    budget = planned_for.unmitigated_bytes * 9 // 10
    plan = greedy.solve(planned_for, budget).plan
    spiked = build_graph(model, parallel, HW, imbalance=2.6)
    kept = evaluate(spiked, plan).activation_bytes
    assert kept > budget  # the spike would not fit
    down = downgrade_plan(spiked, plan)
    assert evaluate(spiked, down).activation_bytes <= budget
    assert check_conflicts(spiked, down) == []
    again = after_gate(spiked, plan, budget, downgrade="paper")
    assert again.changed and again.plan == down
    same = after_gate(planned_for, plan, budget, downgrade="paper")
    assert not same.changed and same.plan == plan
    changed = {k: s for k, s in down.explicit().items() if plan.explicit().get(k) != s}
    assert changed and set(changed.values()) == {Strategy.RECOMPUTE}
    assert {spiked.op(op).kind for op, _ in changed} <= {"expert_fc1", "expert_act", "expert_fc2", "unpermute",
                                                          "shared_act", "shared_fc2"}
    # what exists at the gate stays as planned: the router's savings, the routing weights unpermute keeps
    made_before = {(op, t) for (op, t) in spiked.decisions if spiked.tensors[t].producer is not None
                   and spiked.op(spiked.tensors[t].producer).kind in ("router", "norm")}
    assert all(down.explicit().get(k) == plan.explicit().get(k) for k in made_before)
    one = downgrade_plan(spiked, plan, layers=(spiked.layers[0],))
    assert all(spiked.op(k[0]).layer == spiked.layers[0] for k in set(one.explicit()) - set(plan.explicit()))
    with pytest.raises(ValueError, match="not a MoE layer"):
        downgrade_plan(spiked, plan, layers=(10_000,))


def test_exact_keeps_the_greedy_seed_when_time_runs_out():
    graph = _graph("glm-188b-a20b", 1.6)
    budget = (graph.floor_bytes + graph.unmitigated_bytes) // 2
    solution = exact.solve(graph, budget, time_limit_s=1e-6)
    assert solution.ok and solution.cost.activation_bytes <= budget
    assert solution.cost.overhead_ns <= greedy.solve(graph, budget).cost.overhead_ns
    huge = exact.solve(graph, 10**30)
    assert huge.status is SolveStatus.OPTIMAL and huge.cost.overhead_ns == 0
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="time_limit_s"):
            exact.solve(graph, budget, time_limit_s=bad)


def test_public_functions_reject_wrong_types_with_value_error():
    graph = _graph()
    assert evaluate(graph, "core_attn=R") == evaluate(graph, Plan.uniform({"core_attn": "R"}))
    for call in (lambda: evaluate(graph, 3), lambda: Plan.uniform({"qkv": 3}), lambda: presets.model(["x"]),
                 lambda: presets.hardware({})):
        with pytest.raises(ValueError):
            call()
