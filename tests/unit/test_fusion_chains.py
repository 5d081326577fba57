"""Chains built from real graphs and plans: contents, compaction at the all-to-all ops, and the order cache."""

import pytest

from bagualu2.costmodel import Plan, Resource, build_graph, evaluate, presets
from bagualu2.costmodel.evaluate import mitigation_ops
from bagualu2.fusion import build_chains, dp, simulate
from bagualu2.runtime import Stage
from bagualu2.mitigation import greedy

HW = presets.hardware("paper-gpu")
MODEL, PARALLEL = presets.model("glm-1041b-a35b")


def test_compaction_splits_forward_and_backward_at_all_to_all():
    graph = build_graph(MODEL, PARALLEL, HW)
    chains = build_chains(graph, None, graph, None, hardware=HW)
    layers = len(graph.layers)
    assert len(chains.forward) == len(chains.backward) == 4 * layers + 1  # compute|a2a|experts|a2a|... per layer
    assert [s.resource for s in chains.forward.stages[:5]] == [Resource.COMPUTE, Resource.COMM, Resource.COMPUTE,
                                                               Resource.COMM, Resource.COMPUTE]
    assert chains.offload is None and chains.recovery is None
    assert chains.forward.duration_ns == graph.forward_ns
    assert chains.backward.duration_ns == graph.backward_ns
    assert len(graph.ops) > 20 and len(chains.forward) < len(graph.ops)


def test_mitigation_ops_become_offload_and_recovery_chains():
    graph = build_graph(MODEL, PARALLEL, HW, imbalance=1.6)
    plan = Plan.of({"L0.expert_act/L0.expert_fc1_out": "OFFLOAD", "L0.expert_fc1/L0.dispatched": "QUANTIZE",
                    "L0.expert_fc2/L0.expert_act_out": "RECOMPUTE"})
    chains = build_chains(graph, plan, graph, plan, hardware=HW, copy_split_ns=10**12)
    cost = evaluate(graph, plan)
    extra = mitigation_ops(graph, plan)
    assert chains.offload.duration_ns == sum(o[3] for o in extra.offloads)
    assert chains.forward.duration_ns == graph.forward_ns + sum(q[2] for q in extra.quantized)
    assert chains.recovery.duration_ns == cost.backward_ns - graph.backward_ns
    assert [s.resource for s in chains.recovery.stages] == [Resource.H2D, Resource.COMPUTE]
    assert chains.recovery.stages[-1].ops[-1] == "L0.expert_act.re"
    split = build_chains(graph, plan, graph, plan, hardware=HW)  # copies cut to the median stage length
    assert len(split.offload) >= len(chains.offload)
    assert split.offload.duration_ns == chains.offload.duration_ns


def test_dp_beats_sequential_on_a_real_point_and_the_stage_memoises_it():
    graph = build_graph(MODEL, PARALLEL, HW, imbalance=2.6)
    budget = (graph.floor_bytes + graph.unmitigated_bytes) // 3
    plan = greedy.solve(graph, budget).plan
    chains = build_chains(graph, plan, graph, plan, hardware=HW)
    order = dp.solve(chains)
    timeline = simulate(order, chains)
    assert timeline.makespan_ns == order.makespan_ns < chains.sequential_ns
    engine = Stage(MODEL, PARALLEL, HW)
    first = engine.order(chains)
    assert first == dp.solve(chains, pipeline_degree=PARALLEL.pp)  # pp = 8
    assert engine.order(build_chains(graph, plan, graph, plan, hardware=HW)) is first  # same durations: a hit
    assert Stage(MODEL, PARALLEL, HW, cache=False).order(chains) == first


def test_build_chains_checks_hardware():
    graph = build_graph(MODEL, PARALLEL, HW)
    with pytest.raises(ValueError, match="hardware"):
        build_chains(graph, None, graph, None, hardware=presets.hardware("h100"))


def test_chains_do_not_depend_on_what_was_built_before_from_the_same_graph():
    """build_chains keeps per-graph parts (forward/backward chains, the empty plan's mitigation ops): any order of
    calls on one graph object gives the chains a fresh graph gives."""
    graph = build_graph(MODEL, PARALLEL, HW, imbalance=1.6)
    quantized = Plan.of({"L0.expert_fc1/L0.dispatched": "QUANTIZE", "L1.qkv/L1.norm1_out": "OFFLOAD"})
    planned = greedy.solve(graph, (graph.floor_bytes + graph.unmitigated_bytes) // 2).plan
    other = build_graph(MODEL, PARALLEL, HW, imbalance=2.6)
    calls = [(graph, None, graph, None), (graph, quantized, graph, quantized), (graph, Plan(), graph, Plan()),
             (graph, planned, graph, planned), (graph, planned, other, quantized), (None, None, graph, planned),
             (graph, quantized, None, None), (graph, None, graph, None)]
    for fg, fp, bg, bp in calls:
        fresh = [build_graph(MODEL, PARALLEL, HW, imbalance=g.imbalance) if g is not None else None for g in (fg, bg)]
        assert build_chains(fg, fp, bg, bp) == build_chains(fresh[0], fp, fresh[1], bp)
    assert build_chains(graph, None, graph, None) == build_chains(graph, Plan(), graph, Plan())
