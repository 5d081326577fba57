"""Bring your own model: a stock-module MoE decoder (``tests/byom_model.py``, no bagualu2 inside) instrumented
from outside with an op map, its graph traced from the model itself, plans executed on it.

* the traced graph's unmitigated bytes equal what autograd saves in a plain forward (the tracker), exactly;
* greedy plans at 5 budgets, kind and explicit RECOMPUTE plans and a full recompute: measured device and host
  bytes = ``evaluate(traced graph, plan)`` exactly, loss and every gradient bitwise equal to the plain run;
  QUANTIZE plans within ``QUANT_REL_TOL`` (relative Frobenius error of all gradients together);
* softmax and sigmoid routers, FP32 and BF16, and a model with parts outside the op map (counted as unmapped,
  kept, never mitigated).
"""

from __future__ import annotations

import pytest
import torch

from bagualu2.costmodel import Strategy, evaluate, presets
from bagualu2.exec import ActivationTracker, apply_plan, instrument
from bagualu2.mitigation import exact, greedy
from byom_model import OP_MAP, StockConfig, StockLM, make, op_map

HW = presets.hardware("cpu")
QUANT_REL_TOL = 0.1
CASES = {"fp32-softmax": (StockConfig(), torch.float32),
         "bf16-sigmoid": (StockConfig(router="sigmoid"), torch.bfloat16),
         "fp32-sigmoid-noshared": (StockConfig(router="sigmoid", shared_expert=False, num_experts=8), torch.float32)}
_TRACED: dict = {}


def traced(case: str):
    """``(model, x, instrumented, graph, plain (loss, grads))`` of a case, traced once."""
    if case not in _TRACED:
        config, dtype = CASES[case]
        model, x = make(config, dtype=dtype)
        instrumented = instrument(model, op_map(config))
        graph = instrumented.trace_graph(x, hardware=HW)
        _TRACED[case] = (model, x, instrumented, graph, None)
        _TRACED[case] = (model, x, instrumented, graph, run(case, None)[1:])
    return _TRACED[case]


def run(case: str, plan):
    """One forward + backward under ``plan``: ``(record, loss, gradients of the parameters and the input)``."""
    model, x, instrumented, _, _ = _TRACED[case]
    model.zero_grad(set_to_none=True)
    x.grad = None
    executor = apply_plan(instrumented, plan)
    with executor.micro_batch("mb0") as record:
        out = model(x)
    loss = out.float().pow(2).mean()
    loss.backward()
    executor.release("mb0")
    return record, loss.detach(), [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def check(case: str, plan) -> None:
    _, _, _, graph, (loss0, grads0) = traced(case)
    cost = evaluate(graph, plan)
    record, loss, grads = run(case, plan)
    assert record.unknown_count == 0
    assert record.device_bytes == cost.activation_bytes, (record.device_bytes, cost.activation_bytes)
    assert record.host_bytes == cost.host_bytes, (record.host_bytes, cost.host_bytes)
    assert torch.equal(loss, loss0)  # the forward is untouched
    if Strategy.QUANTIZE in set(record.applied.values()):
        # relative Frobenius error of all gradients together (an expert's gradient can be ~1e-9 where the
        # others are ~1e-3: its own relative error says nothing); measured max 0.063
        flat0 = torch.cat([g.float().flatten() for g in grads0])
        flat1 = torch.cat([g.float().flatten() for g in grads])
        assert ((flat1 - flat0).norm() / flat0.norm()).item() < QUANT_REL_TOL
    else:
        assert all(torch.equal(a, b) for a, b in zip(grads0, grads))


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_traced_graph_is_what_autograd_saves(case):
    model, x, instrumented, graph, _ = traced(case)
    tracker = ActivationTracker(exclude=[model])
    with tracker.micro_batch("plain"):
        model(x)
    assert graph.unmitigated_bytes == tracker.kept_bytes("plain") == instrumented.trace.saved_bytes
    assert instrumented.trace.unmapped_bytes == 0
    kinds = {op.kind for op in graph.ops}
    assert {"norm", "qkv", "core_attn", "attn_out", "router", "expert_fc1", "expert_act", "expert_fc2"} <= kinds
    # every expert that received tokens is part of its layer's ops; routed tensors are marked
    assert any(spec.routed for spec in graph.tensors.values())
    assert graph.op("L1.router").flops > 0 and graph.op("L0.core_attn").flops > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_plans_at_five_budgets(case):
    _, _, _, graph, _ = traced(case)
    for fraction in (0.15, 0.35, 0.55, 0.75, 0.95):
        solution = greedy.solve(graph, int(graph.unmitigated_bytes * fraction))
        assert solution.plan.entries
        check(case, solution.plan)


def test_exact_solver_and_fusion_chains_run_on_the_traced_graph():
    from bagualu2.fusion import build_chains

    _, _, _, graph, _ = traced("fp32-softmax")
    solution = exact.solve(graph, int(graph.unmitigated_bytes * 0.5), time_limit_s=10)
    assert solution.cost == evaluate(graph, solution.plan)
    assert solution.cost.activation_bytes <= int(graph.unmitigated_bytes * 0.5)
    check("fp32-softmax", solution.plan)
    chains = build_chains(graph, solution.plan, graph, solution.plan)
    assert chains.get("F") is not None


RECOMPUTE_PLANS = ["core_attn=RECOMPUTE", "norm=RECOMPUTE", "expert_act=RECOMPUTE,mlp_act=RECOMPUTE",
                   "norm=OFFLOAD,core_attn=RECOMPUTE", "expert_fc1=QUANTIZE,core_attn=RECOMPUTE",
                   "qkv=OFFLOAD,router=QUANTIZE"]


@pytest.mark.parametrize("case", ["fp32-softmax", "bf16-sigmoid"])
@pytest.mark.parametrize("plan", RECOMPUTE_PLANS)
def test_kind_plans(case, plan):
    model, _, instrumented, graph, _ = traced(case)
    if evaluate(graph, plan).unavailable:  # e.g. BF16 RMSNorm saves an FP32 copy of its input, not the input
        with pytest.raises(ValueError, match="no re-run of a mapped module makes"):
            apply_plan(instrumented, plan)
        return
    check(case, plan)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_recompute_everything_recomputable(case):
    _, _, _, graph, _ = traced(case)
    entries = []
    for tensor in dict.fromkeys(t for _, t in graph.decisions):
        mine = ",".join(f"{op}/{t}=RECOMPUTE" for op, t in graph.decisions if t == tensor)
        # recomputable: a mapped module made it and re-running it needs no graph input nothing stores (whether a
        # graph input is stored does not depend on the other RECOMPUTE choices: the union stays available)
        if graph.tensors[tensor].producer is not None and not evaluate(graph, mine).unavailable:
            entries.append(mine)
    plan = ",".join(entries)
    cost = evaluate(graph, plan)
    assert not cost.unavailable and cost.num_recomputed_ops > 0
    check(case, plan)


@pytest.mark.slow
def test_unmapped_parts_are_counted_and_kept():
    config = StockConfig()
    torch.manual_seed(0)
    model = StockLM(config)
    tokens = torch.randint(0, config.vocab, (2, config.seq))
    op_map = {f"decoder.{pattern}": label for pattern, label in OP_MAP.items() if pattern != "norm"}
    instrumented = instrument(model, op_map)
    def loss(logits):
        return logits.float().logsumexp(-1).mean()

    graph = instrumented.trace_graph(tokens, hardware=HW, loss=loss)
    trace = instrumented.trace
    assert trace.unmapped_bytes > 0 and trace.num_unmapped_savings > 0  # final norm, output layer and the loss
    tracker = ActivationTracker(exclude=[model])
    with tracker.micro_batch("plain"):
        loss(model(tokens))
    # in the graph as the pinned savings of one op: counted by evaluate, kept by every plan
    assert graph.unmitigated_bytes == tracker.kept_bytes("plain") == trace.saved_bytes
    unmapped = graph.op("unmapped")
    assert {("unmapped", s.tensor) for s in unmapped.saves} == set(graph.pinned)
    assert graph.copies_bytes({(s.tensor, s.dtype) for s in unmapped.saves}) >= trace.unmapped_bytes
    plan = greedy.solve(graph, graph.unmitigated_bytes // 2).plan
    executor = apply_plan(instrumented, plan)
    with executor.micro_batch("mb0") as record:
        value = loss(model(tokens))  # the traced loss, inside the micro-batch: its savings are predicted too
    assert record.device_bytes == evaluate(graph, plan).activation_bytes
    assert record.unknown_bytes == trace.unmapped_bytes  # kept as they are
    value.backward()
    executor.release("mb0")


def test_timed_trace_measures_every_op():
    model, x = make()
    instrumented = instrument(model, OP_MAP)
    graph = instrumented.trace_graph(x, hardware=HW, timed=True)
    assert all(op.forward_ns > 0 for op in graph.ops)
    assert sum(op.backward_ns for op in graph.ops) > 0
    assert graph.unmitigated_bytes == traced("fp32-softmax")[3].unmitigated_bytes


@pytest.mark.slow
def test_only_the_attention_kernels_flops_run_at_the_attention_efficiency():
    """A traced op's time charges its fused attention kernel's FLOPs at ``attention_efficiency`` and the rest (its
    matrix products) at ``matmul_efficiency``: lowering the first slows core attention alone."""
    import dataclasses

    model, x, instrumented, graph, _ = traced("fp32-softmax")
    slow = instrumented.trace_graph(x, hardware=dataclasses.replace(HW, attention_efficiency=0.05))
    for op, same in zip(graph.ops, slow.ops):
        if op.kind == "core_attn":
            assert same.forward_ns > 2 * op.forward_ns and same.backward_ns > 2 * op.backward_ns, op.name
        else:
            assert (same.forward_ns, same.backward_ns) == (op.forward_ns, op.backward_ns), op.name
    assert any(op.kind == "core_attn" for op in graph.ops)
