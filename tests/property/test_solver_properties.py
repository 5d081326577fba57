import pytest
"""Solvers against each other and against brute force on random graphs with shared, mixed-precision tensors."""

import dataclasses

from conftest import scaled
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from bagualu2.costmodel import Op, OpGraph, Plan, Resource, Saving, Strategy, TensorSpec, evaluate, presets
from bagualu2.mitigation import SolveStatus, brute, check_conflicts, exact, greedy
from bagualu2.mitigation.greedy import GreedyConfig

HW = presets.hardware("paper-gpu")
KINDS = ("norm", "qkv", "core_attn", "mlp_fc1", "mlp_act", "expert_fc1")


@st.composite
def random_graphs(draw, max_savings=5):
    tensors = {"in": TensorSpec("in", 8 * draw(st.integers(1, 512)), "bf16", None)}
    ops, available = [], ["in"]
    num_ops = draw(st.integers(2, 5))
    shared = None
    for i in range(num_ops):
        name = f"op{i}"
        inputs = draw(st.lists(st.sampled_from(available), min_size=1, max_size=2, unique=True))
        if shared is not None and shared not in inputs and draw(st.booleans()):
            inputs.append(shared)  # a tensor with 2-3 consumers
        saves = []
        for source in inputs:
            if draw(st.integers(0, 3)):
                dtype = draw(st.sampled_from([tensors[source].dtype, "fp32"]))  # mixed-precision consumers
                saves.append(Saving(source, dtype))
        if draw(st.booleans()):  # an internal tensor (softmax output, mask) only this op keeps
            internal = f"s{i}"
            dtype = draw(st.sampled_from(["bf16", "bool"]))
            tensors[internal] = TensorSpec(internal, 8 * draw(st.integers(1, 512)), dtype, name)
            saves.append(Saving(internal, dtype))
        out = f"t{i}"
        tensors[out] = TensorSpec(out, 8 * draw(st.integers(1, 512)), "bf16", name)
        forward_ns = draw(st.integers(0, 20_000))
        ops.append(Op(name, draw(st.sampled_from(KINDS)), 0, Resource.COMPUTE, tuple(inputs), (out,),
                      tuple(saves), 0, 0, forward_ns, 2 * forward_ns))
        available.append(out)
        if shared is None and i == 0:
            shared = out
    pinned = frozenset()
    first_saves = [s.tensor for s in ops[0].saves]
    if "in" in first_saves and draw(st.booleans()):
        pinned = frozenset({("op0", "in")})
    graph = OpGraph(ops=tuple(ops), tensors=tensors, hardware=HW, pinned=pinned)
    assume(1 <= len(graph.decisions) <= max_savings)
    return graph


budget_fraction = st.integers(0, 100)


def _budget(graph, fraction):
    lo, hi = graph.floor_bytes, graph.unmitigated_bytes
    return lo + (hi - lo) * fraction // 100


@given(random_graphs(), budget_fraction)
def test_solutions_fit_and_are_conflict_free(graph, fraction):
    budget = _budget(graph, fraction)
    fast = greedy.solve(graph, budget)
    paper = greedy.solve(graph, budget, config=GreedyConfig(variant="paper"))
    best = exact.solve(graph, budget, time_limit_s=20, seed=0)
    for solution in (fast, paper, best):
        assert Plan.from_str(repr(solution.plan)) == solution.plan
        assert solution.cost == evaluate(graph, solution.plan)
        if solution.status in (SolveStatus.OPTIMAL, SolveStatus.FEASIBLE):
            assert check_conflicts(graph, solution.plan) == []
            assert solution.cost.activation_bytes <= budget
    if fast.ok:
        assert best.ok and best.cost.overhead_ns <= fast.cost.overhead_ns
    if best.status is SolveStatus.OPTIMAL:
        assert best.stats["objective_ns"] == best.cost.overhead_ns


@pytest.mark.slow
@given(random_graphs(), budget_fraction)
def test_exact_equals_brute_force(graph, fraction):
    budget = _budget(graph, fraction)
    best = exact.solve(graph, budget, time_limit_s=20, seed=0)
    reference = brute.solve(graph, budget)
    assert best.ok == reference.ok
    if reference.ok:
        assert best.status is SolveStatus.OPTIMAL
        assert best.cost.overhead_ns == reference.cost.overhead_ns


def _layered(num_layers, pinned_inputs, traced_names, sizes, times, first_times, internal,
             second_dtype="bf16") -> OpGraph:
    """Layers of f: x -> a (saves x) and g: a -> the next block input (saves a, with ``internal`` its own s), layer
    0 taking ``first_times``, layer 1 making its a in ``second_dtype`` (saved as bf16: its FP8 cast costs differ); block
    inputs pinned (as the builder pins them) or not, named ``L{l}.x`` or after the op that makes them
    (``L{l-1}.g.out``, as a trace names them)."""
    tensors = {"L0.x": TensorSpec("L0.x", sizes[0], "bf16", None)}
    ops, pinned = [], set()
    for layer in range(num_layers):
        x = "L0.x" if layer == 0 else f"L{layer - 1}.g.out" if traced_names else f"L{layer}.x"
        a, out = f"L{layer}.a", f"L{layer}.g.out" if traced_names else f"L{layer + 1}.x"
        tensors[a] = TensorSpec(a, sizes[1], second_dtype if layer == 1 else "bf16", f"L{layer}.f")
        tensors[out] = TensorSpec(out, sizes[0], "bf16", f"L{layer}.g")
        saves = [Saving(a, "bf16")]
        if internal:
            tensors[f"L{layer}.s"] = TensorSpec(f"L{layer}.s", sizes[2], "bf16", f"L{layer}.g")
            saves.append(Saving(f"L{layer}.s", "bf16"))
        f_ns, g_ns = first_times if layer == 0 else times
        ops += [Op(f"L{layer}.f", "norm", layer, Resource.COMPUTE, (x,), (a,), (Saving(x, "bf16"),), 0, 0, f_ns,
                   2 * f_ns),
                Op(f"L{layer}.g", "mlp_fc1", layer, Resource.COMPUTE, (a,), (out,), tuple(saves), 0, 0, g_ns,
                   2 * g_ns)]
        if pinned_inputs:
            pinned.add((f"L{layer}.f", x))
    return OpGraph(ops=tuple(ops), tensors=tensors, hardware=HW, pinned=frozenset(pinned))


@st.composite
def layered_graphs(draw):
    times = [draw(st.integers(0, 2000)) for _ in range(2)]
    graph = _layered(draw(st.integers(2, 3)), draw(st.booleans()), draw(st.booleans()),
                     [8 * draw(st.integers(1, 64)) for _ in range(3)], times,
                     [draw(st.sampled_from([t, 2 * t + 1])) for t in times], draw(st.booleans()),
                     draw(st.sampled_from(["bf16", "fp32"])))
    assume(1 <= len(graph.decisions) <= 7)
    return graph


@settings(max_examples=scaled(120), deadline=None)
@given(layered_graphs(), budget_fraction, st.booleans())
@example(_layered(2, False, False, [64, 64, 128], [1000, 10], [1000, 10], True), 70, False)  # cut off by the order
@example(_layered(3, False, True, [64, 64, 64], [1000, 10], [1000, 1000], False), 40, True)  # the hint's renaming
@example(_layered(2, True, False, [1 << 20, 1 << 20, 8], [10**9, 1000], [10**9, 1000], False, "fp32"), 75, False)
def test_exact_equals_brute_force_on_layered_graphs(graph, fraction, hint):
    """Identical layers get their kept bytes ordered (symmetry breaking) only where no decision crosses a layer:
    with unpinned block inputs the layers share them, and the order would cut the optimum off."""
    budget = _budget(graph, fraction)
    best = exact.solve(graph, budget, time_limit_s=20, seed=0, hint=hint)
    reference = brute.solve(graph, budget)
    assert best.ok == reference.ok
    if reference.ok:
        assert best.status is SolveStatus.OPTIMAL and best.cost.overhead_ns == reference.cost.overhead_ns
        assert best.cost.activation_bytes <= budget


@pytest.mark.slow
@given(random_graphs(), budget_fraction, budget_fraction)
def test_more_budget_never_costs_more(graph, a, b):
    low, high = sorted((_budget(graph, a), _budget(graph, b)))
    first = exact.solve(graph, low, time_limit_s=20, seed=0)
    second = exact.solve(graph, high, time_limit_s=20, seed=0)
    if first.ok:
        assert second.ok and second.cost.overhead_ns <= first.cost.overhead_ns


@pytest.mark.slow
@given(random_graphs(max_savings=8))
def test_floor_is_the_feasibility_edge(graph):
    for solve in (greedy.solve, exact.solve):
        assert solve(graph, graph.floor_bytes).ok or _unregenerable(graph)
    if graph.floor_bytes == 0:
        return  # nothing is pinned: every budget is feasible
    for solve in (greedy.solve, exact.solve, brute.solve):
        assert solve(graph, graph.floor_bytes - 1).status is SolveStatus.INFEASIBLE


def _unregenerable(graph) -> bool:
    """The floor needs every unpinned tensor dropped; a graph input nobody pins cannot be regenerated."""
    pinned = {t for _, t in graph.pinned}
    return any(spec.producer is None and name not in pinned and graph.consumers(name)
               for name, spec in graph.tensors.items())


@pytest.mark.slow
@given(random_graphs(), budget_fraction, st.data())
def test_partial_greedy_keeps_the_fixed_part_and_is_never_better_than_brute_force(graph, fraction, data):
    """``greedy.solve(fixed=, free=)`` (the runtime's re-plan after the gate) against an enumeration of the free
    tensors' strategies with the rest fixed."""
    import itertools

    from bagualu2.mitigation.greedy import tensor_strategies
    from bagualu2.mitigation.space import decision_space

    space = decision_space(graph)
    tensors = [c.tensor for c in space.choices]
    free = set(data.draw(st.lists(st.sampled_from(tensors), unique=True), label="free")) if tensors else set()
    fixed_choice = {c.tensor: data.draw(st.sampled_from([c.strategies[1], c.strategies[0]]), label=c.tensor)
                    for c in space.choices if c.tensor not in free and data.draw(st.booleans())}
    fixed = space.plan(fixed_choice)
    assume(not evaluate(graph, fixed).unavailable)  # a fixed part that can be regenerated (as the runtime's are)
    budget = _budget(graph, fraction)
    partial = greedy.solve(graph, budget, fixed=fixed, free=free)
    assert partial.cost == evaluate(graph, partial.plan)
    got = tensor_strategies(graph, partial.plan)
    assert {t: s for t, s in got.items() if t not in free} == fixed_choice  # the fixed part stays as it was
    best = None
    movable = [c for c in space.choices if c.tensor in free]
    for combo in itertools.product(*[(None, *c.strategies) for c in movable]):
        chosen = dict(fixed_choice)
        chosen.update({c.tensor: s for c, s in zip(movable, combo) if s is not None})
        cost = evaluate(graph, space.plan(chosen))
        if cost.activation_bytes <= budget and not cost.unavailable and (best is None or cost.overhead_ns < best):
            best = cost.overhead_ns
    if best is not None:
        assert partial.ok and partial.cost.activation_bytes <= budget and partial.cost.overhead_ns >= best
    if partial.ok:
        assert partial.cost.activation_bytes <= budget and check_conflicts(graph, partial.plan) == []
    full = greedy.solve(graph, budget)
    assert greedy.solve(graph, budget, free=tensors).plan == full.plan  # everything free = the full solve


@given(random_graphs(), budget_fraction)
def test_a_graph_without_fp8_gets_exact_plans_only(graph, fraction):
    """``quantize=False``: no solver stores a tensor in FP8, the exact solver is brute force over the other three
    strategies, and every solution fits."""
    exact_only = dataclasses.replace(graph, quantize=False)
    budget = _budget(exact_only, fraction)
    solutions = [greedy.solve(exact_only, budget), exact.solve(exact_only, budget), brute.solve(exact_only, budget)]
    for solution in solutions:
        assert solution.ok
        assert Strategy.QUANTIZE not in {strategy for _, strategy in solution.plan.entries}
        assert evaluate(exact_only, solution.plan).activation_bytes <= budget
    assert solutions[1].cost.overhead_ns == solutions[2].cost.overhead_ns
