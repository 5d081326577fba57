"""The decision path's speed-ups decide exactly as before: memoised pure functions return what a fresh call
returns, the one-chain DP shortcut is the recurrence's order, and a replay is reproducible within a process."""

from __future__ import annotations

import random

import pytest
from bagualu2.costmodel import Strategy, build_graph, evaluate, presets
from bagualu2.costmodel.evaluate import evaluate_resolved, mitigation_ops, resolve
from bagualu2.fusion import Chain, Chains, Stage, build_chains, dp, simulate
from bagualu2.mitigation import greedy
from bagualu2.mitigation.space import decision_space
from bagualu2.runtime import DecisionPath, downgrade_plan, gate_free_tensors, replay_iteration, spike_trace

MODEL, PARALLEL = presets.model("glm-188b-a20b")
HW = presets.hardware("paper-gpu")


def _plans(graph):
    steps = (0, 1, 2, 4)
    return [greedy.solve(graph, graph.floor_bytes + (graph.unmitigated_bytes - graph.floor_bytes) * s // 4).plan
            for s in steps]


def test_memoised_mitigation_ops_and_downgrade_match_fresh_graphs():
    graph = build_graph(MODEL, PARALLEL, HW, imbalance=1.6)
    for plan in _plans(graph):
        chains = build_chains(graph, plan, graph, plan, hardware=HW)
        again = build_chains(graph, plan, graph, plan, hardware=HW)  # served from the memo
        fresh_graph = build_graph(MODEL, PARALLEL, HW, imbalance=1.6)
        fresh = build_chains(fresh_graph, plan, fresh_graph, plan, hardware=HW)
        assert chains == again == fresh
        assert mitigation_ops(graph, plan) == mitigation_ops(fresh_graph, plan)
        assert downgrade_plan(graph, plan) == downgrade_plan(graph, plan) == downgrade_plan(fresh_graph, plan)
        assert evaluate(graph, plan) == evaluate_resolved(fresh_graph, resolve(fresh_graph, plan))


def _first_candidates(graph, fixed, free, window_ns):
    """The first candidates of the partial solve's start (from the solver's cache), after a solve to the floor. The
    copies made so far ride along in each of them but are read only under a copy window: left out without one."""
    config = greedy.GreedyConfig(copy_window_ns=window_ns)
    greedy.solve(graph, graph.floor_bytes, fixed=fixed, free=free, config=config)
    space = decision_space(graph)
    found = greedy._INITIAL[space][greedy._start(space, graph, fixed, free, window_ns).start_key]
    return found if window_ns else [entry[:7] + entry[8:] for entry in found]


def test_partial_solves_sharing_first_candidates_match_fresh_graphs():
    """The re-plans of one free set under many plans in force share the free tensors' first candidates (cached by
    what the recompute walks see of the fixed plan): each gets what a fresh graph builds for it, and decides the
    same."""
    rng = random.Random(5)
    graph = build_graph(MODEL, PARALLEL, HW, imbalance=1.6)
    choices = decision_space(graph).choices
    layers = sorted({op.layer for op in graph.ops if op.kind == "router"})
    free_sets = [gate_free_tensors(graph, layers[1:])] + [
        frozenset(choice.tensor for choice in rng.sample(choices, 6)) for _ in range(3)]
    for trial in range(60):
        fixed = decision_space(graph).plan({choice.tensor: rng.choice(choice.strategies)
                                            for choice in rng.sample(choices, rng.randrange(len(choices)))})
        free, window_ns = free_sets[trial % len(free_sets)], (0, 2_000_000)[trial // len(free_sets) % 2]
        fresh_graph = build_graph(MODEL, PARALLEL, HW, imbalance=1.6)
        assert _first_candidates(graph, fixed, free, window_ns) == _first_candidates(fresh_graph, fixed, free,
                                                                                       window_ns)
        budget = (graph.floor_bytes + graph.unmitigated_bytes) // 2
        shared, fresh = (greedy.solve(g, budget, fixed=fixed, free=free) for g in (graph, fresh_graph))
        assert (shared.status, shared.plan, shared.cost) == (fresh.status, fresh.plan, fresh.cost)
        if window_ns:
            continue
        # another plan in force that differs only where no recompute walk from the free tensors looks (copies and
        # casts, out of their reach, of tensors the plan does not recompute): it reuses the first candidates just
        # cached, and they are still its own
        reach, _ = greedy._walk_reach(decision_space(graph), frozenset(free))
        strategies = greedy.tensor_strategies(graph, fixed)
        outside = [c for c in choices if c.tensor not in free and c.tensor not in reach
                   and strategies.get(c.tensor) is not Strategy.RECOMPUTE
                   and {Strategy.OFFLOAD, Strategy.QUANTIZE} & set(c.strategies)]
        moved = {c.tensor: rng.choice([x for x in c.strategies if x in (Strategy.OFFLOAD, Strategy.QUANTIZE)])
                 for c in rng.sample(outside, min(4, len(outside)))}
        other = decision_space(graph).plan({**strategies, **moved})
        space = decision_space(graph)
        assert (greedy._start(space, graph, other, free, 0).start_key
                == greedy._start(space, graph, fixed, free, 0).start_key)
        fresh_graph = build_graph(MODEL, PARALLEL, HW, imbalance=1.6)
        assert _first_candidates(graph, other, free, 0) == _first_candidates(fresh_graph, other, free, 0)
        shared, fresh = (greedy.solve(g, budget, fixed=other, free=free) for g in (graph, fresh_graph))
        assert (shared.status, shared.plan, shared.cost) == (fresh.status, fresh.plan, fresh.cost)


def test_one_chain_dp_order_is_one_stage_per_group():
    stages = tuple(Stage(f"F{i}", resource, duration) for i, (resource, duration) in
                   enumerate([("compute", 5), ("comm", 3), ("compute", 7)]))
    chains = Chains(forward=Chain("F", stages))
    order = dp.solve(chains)
    assert str(order) == "F0|F1|F2" and order.makespan_ns == 15 and order.solver == "dp"
    assert simulate(order, chains).makespan_ns == order.makespan_ns
    recovery = Chains(recovery=Chain("R", tuple(Stage(f"R{i}", "h2d", 4) for i in range(2))))
    assert str(dp.solve(recovery)) == "R0|R1" and dp.solve(recovery).makespan_ns == 8


@pytest.mark.slow
def test_replays_are_reproducible_within_a_process():
    trace = spike_trace(4 * PARALLEL.num_microbatches, spike_rate=0.1, max_imbalance=2.6, base_jitter=0.1, seed=3)

    def decisions():
        path = DecisionPath(MODEL, PARALLEL, HW)
        rows = []
        for it in range(4):
            window = trace[it * PARALLEL.num_microbatches:(it + 1) * PARALLEL.num_microbatches]
            replay = replay_iteration(MODEL, PARALLEL, HW, window, path=path)
            rows += [(d.plan, d.kept_bytes, d.overhead_s, d.action, d.fused_makespan_s) for d in replay.decisions]
        return rows, path.hits, path.misses

    assert decisions() == decisions()


def test_the_solvers_memos_let_a_graph_go():
    """The greedy keeps its starts and first candidates per decision space in weak memos: once nothing else holds
    the graph, its space goes too (a memo value that held the space kept every space ever built alive)."""
    import gc
    import weakref

    graph = build_graph(MODEL, PARALLEL, HW, imbalance=1.3)
    space = decision_space(graph)
    fixed = space.plan({choice.tensor: choice.strategies[0] for choice in space.choices[:5]})
    greedy.solve(graph, (graph.floor_bytes + graph.unmitigated_bytes) // 2, fixed=fixed,
                 free=gate_free_tensors(graph))
    gone = weakref.ref(space)
    del graph, space
    gc.collect()
    assert gone() is None
