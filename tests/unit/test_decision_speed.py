"""The decision path's speed-ups decide exactly as before: memoised pure functions return what a fresh call
returns, the one-chain DP shortcut is the recurrence's order, and a replay is reproducible within a process."""

from __future__ import annotations

import pytest
from bagualu2.costmodel import build_graph, evaluate, presets
from bagualu2.costmodel.evaluate import evaluate_resolved, mitigation_ops, resolve
from bagualu2.fusion import Chain, Chains, Stage, build_chains, dp, simulate
from bagualu2.mitigation import greedy
from bagualu2.runtime import DecisionPath, downgrade_plan, replay_iteration, spike_trace

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
