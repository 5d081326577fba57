"""The pieces the distributed trainer added below it, against their references:

* ``PlanCost.activation_bytes_received`` (per-layer routed tokens) equals ``evaluate`` on a graph rebuilt at that
  imbalance whenever every layer received the same count, and is additive over layers otherwise;
* ``DecisionPath.pre_gate`` is the plan ``forward`` commits before its gate, and ``state_dict`` round trips the
  remembered gates (same planned imbalance, same plans);
* ``PointOrders`` gives the DP's order of the chains it builds (memoised: the same object again), sequential at
  pipeline degree <= 2;
* ``DualBatchExecutor`` over two executors (two chunks of a stage) with a forward that records its own
  micro-batch (``FORWARD_GATE``) and per-micro-batch plans gives sequential execution's gradients bitwise.
"""

from __future__ import annotations

import pytest
import dataclasses

import torch
from hypothesis import given, settings
from conftest import scaled
from hypothesis import strategies as st

from bagualu2.costmodel import ParallelConfig, Plan, build_graph, evaluate, presets
from bagualu2.exec import PlanExecutor
from bagualu2.exec.dual import DualBatchExecutor
from bagualu2.fusion import baselines, build_chains, dp
from bagualu2.runtime import DecisionPath, PointOrders, Stage
from reference_trainer.instrumented import instrument_reference
from reference_trainer.model import GLMMoEModel

MODEL = presets.model("tiny-moe")[0].replace(num_layers=4, num_dense_layers=0, seq_length=32)
HW = presets.hardware("cpu")
EP2 = ParallelConfig(dp=2, ep=2, pp=2, num_microbatches=4)


@given(r=st.floats(1.0, 2.0), plan=st.sampled_from(["none", "expert_fc1=RECOMPUTE", "expert_act=OFFLOAD",
                                                     "expert_fc1=QUANTIZE,core_attn=RECOMPUTE"]))
def test_received_bytes_match_a_rebuilt_graph(r, plan):
    graph = build_graph(MODEL, EP2, HW, imbalance=1.0)
    rebuilt = build_graph(MODEL, EP2, HW, imbalance=r)
    parsed = Plan.from_str(plan)
    tokens = rebuilt.routed_tokens(r)
    cost = evaluate(graph, parsed)
    layers = sorted(cost.routed_bytes_by_layer) or [0]
    assert cost.activation_bytes_received(graph, {layer: tokens for layer in layers}) == \
        evaluate(rebuilt, parsed).activation_bytes
    if len(cost.routed_bytes_by_layer) == 2:  # one layer spiking: the other keeps what it was built with
        first, second = sorted(cost.routed_bytes_by_layer)
        built = graph.routed_tokens(1.0)
        only_first = cost.activation_bytes_received(graph, {first: tokens})
        assert only_first - cost.activation_bytes == cost.routed_bytes_by_layer[first] // built * (tokens - built)


@settings(max_examples=scaled(20))
@given(fraction=st.floats(0.3, 1.0), gates=st.lists(st.floats(1.0, 2.0), min_size=1, max_size=20))
def test_pre_gate_is_what_forward_commits_and_state_round_trips(fraction, gates):
    path = DecisionPath(MODEL, EP2, HW, stage=0)
    unmitigated = path.graph(0, 1.0).unmitigated_bytes
    for value in gates:
        path.observe(0, value)
    budget = int(fraction * unmitigated)
    restored = DecisionPath(MODEL, EP2, HW, stage=0)
    restored.load_state_dict(path.state_dict())
    assert restored.planned(0) == path.planned(0)
    assert restored.pre_gate(budget, 0) == path.pre_gate(budget, 0)
    plan = path.pre_gate(budget, 0)
    if budget >= unmitigated:
        assert plan == Plan()
    assert path.pre_gate(budget, 0, planned=1.0) == DecisionPath(MODEL, EP2, HW, stage=0).pre_gate(budget, 0)


def test_point_orders_match_the_dp_and_are_memoised():
    graph = build_graph(MODEL, EP2, HW, imbalance=1.2)
    plan = Plan.from_str("expert_act=OFFLOAD,core_attn=RECOMPUTE")
    deep = PointOrders(Stage(MODEL, dataclasses.replace(EP2, pp=4, num_microbatches=8), HW))
    shallow = PointOrders(Stage(MODEL, dataclasses.replace(EP2, pp=2, num_microbatches=8), HW))
    chains = deep.chains(forward=(graph, plan), backward=(graph, plan), offload=(graph, plan),
                         recovery=(graph, plan))
    assert chains.offload is not None and chains.recovery is not None
    assert deep.chains(forward=(graph, plan), backward=(graph, plan), offload=(graph, plan),
                       recovery=(graph, plan)) == chains == build_chains(graph, plan, graph, plan, hardware=HW)
    assert deep.order(chains) == dp.solve(chains, pipeline_degree=4)
    assert deep.order(chains) is deep.order(chains)
    # pp=2: F_(y+1) beside B_y, so O would copy B's micro-batch: F and B by the DP, their own copies beside them
    assert shallow.engine.point_relation == 1
    assert shallow.order(chains) == dp.solve(chains, pipeline_degree=1)
    assert shallow.order(chains).makespan_ns < baselines.sequential(chains).makespan_ns
    paired = PointOrders(Stage(MODEL, dataclasses.replace(EP2, pp=2, num_microbatches=8, paired=True), HW))
    assert paired.engine.point_relation == 2  # F_(y+2) beside B_y: O and R copy one micro-batch, at the edges
    assert paired.order(chains) == dp.solve(chains, pipeline_degree=2)
    warm = deep.chains(forward=(graph, plan), offload=(graph, plan))
    assert warm.backward is None and warm.recovery is None and warm.offload is not None


def _two_chunk_model():
    torch.manual_seed(0)
    model = GLMMoEModel(MODEL)
    instrument_reference(model)
    return model


PLANS = (Plan.from_str("expert_act=OFFLOAD,L0.core_attn/L0.attn_lse=RECOMPUTE"),
         Plan.from_str("L3.qkv/L3.norm1_out=OFFLOAD,expert_fc1=RECOMPUTE"))
ONE = ParallelConfig(pp=2, num_microbatches=4)
GRAPHS = [build_graph(MODEL, ONE, HW, stage=0, chunk=0), build_graph(MODEL, ONE, HW, stage=1, chunk=0)]


def _run(fused: bool):
    model = _two_chunk_model()
    generator = torch.Generator().manual_seed(3)
    inputs = [torch.randn(MODEL.micro_batch_size, MODEL.seq_length, MODEL.hidden_size, generator=generator)
              for _ in range(3)]
    executors = [PlanExecutor(g, None, exclude=[model]) for g in GRAPHS]  # "chunks": layers 0-1 and 2-3
    dual = DualBatchExecutor(*executors)
    if not fused:
        for each in executors:
            each.stage_hooks = each.defer_offloads = False
    outs = {}

    def forward(name, index, plan):
        with executors[0].micro_batch(f"a{name}", plan=plan):
            h = model.forward_layers(inputs[index], range(0, 2))
        with executors[1].micro_batch(f"b{name}", plan=PLANS[1]):
            outs[name] = model.forward_layers(h, range(2, 4))
        return outs[name]

    forward("0", 0, PLANS[0])
    forward("1", 1, Plan())
    if fused:
        for each, name in ((executors[0], "a0"), (executors[1], "b0"), (executors[0], "a1"), (executors[1], "b1")):
            each.offload_now(name)
        orders = PointOrders(Stage(MODEL, ParallelConfig(pp=4, num_microbatches=8), HW))
        chains = orders.chains(forward=(GRAPHS[0], PLANS[0]), backward=(GRAPHS[1], PLANS[1]))
        order = orders.order(chains)

        def backward():
            outs["0"].pow(2).mean().backward()

        def run_forward():  # records its own micro-batch on the first executor (FORWARD_GATE)
            with executors[0].micro_batch("a2", plan=PLANS[0]):
                return model.forward_layers(inputs[2], range(0, 2))

        result = dual.run(order, chains, forward=run_forward, backward=("b0", backward))
        h2 = result.forward
        assert result.forward_ops and result.backward_ops
    else:
        outs["0"].pow(2).mean().backward()
        with executors[0].micro_batch("a2", plan=PLANS[0]):
            h2 = model.forward_layers(inputs[2], range(0, 2))
    for name in ("a0", "b0"):
        (executors[0] if name[0] == "a" else executors[1]).release(name)
    with executors[1].micro_batch("b2", plan=PLANS[1]):
        outs["2"] = model.forward_layers(h2, range(2, 4))
    for name in ("1", "2"):
        outs[name].pow(2).mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow
def test_dual_batch_over_two_executors_is_bitwise_sequential():
    reference, fused = _run(False), _run(True)
    assert reference.keys() == fused.keys()
    assert all(torch.equal(reference[n], fused[n]) for n in reference)
