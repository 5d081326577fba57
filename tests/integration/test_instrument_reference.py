"""The reference model instrumented from outside (``reference_trainer.instrumented``: its op map on the model's op
modules, nothing of ``bagualu2.exec`` inside the model): its traced graph is a cross-check of the analytic cost
model, op by op, and plans run on it from outside (the other exec tests run it so, against ``build_graph``)."""

from __future__ import annotations

import pytest
import torch

from bagualu2.costmodel import ParallelConfig, build_graph, evaluate, presets
from bagualu2.exec import apply_plan
from reference_trainer.instrumented import instrument_reference, reference_op_map
from reference_trainer.model import OP_MAP, GLMMoEModel

HW = presets.hardware("cpu")


class Layers(torch.nn.Module):
    """The transformer layers of a reference model (what the cost model covers) as a module: paths
    ``layers.<i>...`` (registered first), the model's buffers (RoPE's cos/sin) and parameters its own."""

    def __init__(self, model: GLMMoEModel):
        super().__init__()
        self.layers = model.layers
        self.m = model

    def forward(self, x):
        return self.m.forward_layers(x)


def op_bytes(graph, op) -> int:
    return graph.copies_bytes({(s.tensor, s.dtype) for s in op.saves})


@pytest.fixture(scope="module", params=["tiny-moe", "tiny-dense"])
def traced(request):
    config = presets.model(request.param)[0].replace(seq_length=32)
    torch.manual_seed(0)
    model = Layers(GLMMoEModel(config))
    x = torch.randn(config.micro_batch_size, config.seq_length, config.hidden_size, requires_grad=True)
    instrumented = instrument_reference(model)
    graph = instrumented.trace_graph(x, hardware=HW)
    return config, instrumented, graph, build_graph(config, ParallelConfig(), HW)


def test_traced_graph_equals_build_graph_per_op(traced):
    """Every op of ``build_graph`` is a module of the reference model: the same op names in the same order, and
    each op's saved bytes equal (shared savings, e.g. the routing map, counted once; the experts' savings are one
    storage per expert in the traced graph, one routed tensor in the analytic one)."""
    _, instrumented, graph, analytic = traced
    assert [op.name for op in graph.ops] == [op.name for op in analytic.ops]
    assert [op.kind for op in graph.ops] == [op.kind for op in analytic.ops]
    for op in analytic.ops:
        assert op_bytes(graph, graph.op(op.name)) == op_bytes(analytic, op), op.name
    assert graph.unmitigated_bytes == analytic.unmitigated_bytes
    assert instrumented.trace.unmapped_bytes == 0 and instrumented.trace.num_unmapped_savings == 0
    assert [op.name for op in graph.ops if op.resource.name == "COMM"] == \
        [op.name for op in analytic.ops if op.resource.name == "COMM"]


def test_traced_attention_costs_what_the_analytic_one_does(traced):
    """The attention kernel is a fused one: both graphs count its FLOPs alike and charge its backward, which
    re-computes the scores, 2.5 x them."""
    config, _, graph, analytic = traced
    attention = [op for op in analytic.ops if op.kind == "core_attn"]
    assert attention and config.flash_attention
    for op in attention:
        ours = graph.op(op.name)
        assert (ours.flops, ours.forward_ns, ours.backward_ns) == (op.flops, op.forward_ns, op.backward_ns)


@pytest.mark.slow
def test_plans_from_outside_on_the_traced_and_the_analytic_graph(traced):
    """The same instrumented model runs plans of its traced graph and of ``build_graph``'s: bytes = prediction,
    loss and gradients bitwise equal to the plain run."""
    config, instrumented, graph, analytic = traced
    model = instrumented.model
    x = torch.randn(config.micro_batch_size, config.seq_length, config.hidden_size, requires_grad=True)

    def run(executor):
        model.zero_grad()
        x.grad = None
        if executor is None:
            out, record = model(x), None
        else:
            with executor.micro_batch("mb") as record:
                out = model(x)
        out.pow(2).mean().backward()
        if executor is not None:
            executor.release("mb")
        return record, [x.grad.clone()] + [p.grad.clone() for p in model.parameters() if p.grad is not None]

    _, plain = run(None)
    for target, g in ((instrumented, graph), (analytic, analytic)):
        for budget in (g.floor_bytes, (g.floor_bytes + g.unmitigated_bytes) // 2):
            from bagualu2.mitigation import greedy

            plan = greedy.solve(g, budget).plan
            executor = apply_plan(target, plan) if target is instrumented else apply_plan(g, plan, exclude=[model])
            record, grads = run(executor)
            assert record.unknown_count == 0
            assert record.device_bytes == evaluate(g, plan).activation_bytes, (g.label, budget)
            assert all(torch.equal(a, b) for a, b in zip(plain, grads))


def test_the_op_map_is_restricted_to_what_a_module_holds():
    config = presets.model("tiny-moe")[0].replace(seq_length=16)
    model = GLMMoEModel(config)
    assert reference_op_map(model) == OP_MAP  # dense and MoE layers: every pattern matches
    dense_only = torch.nn.Module()
    dense_only.layers = torch.nn.ModuleDict({"0": model.layers[0]})
    assert set(OP_MAP) - set(reference_op_map(dense_only)) == {
        p for p, label in OP_MAP.items() if label in ("router", "permute", "dispatch", "combine", "unpermute")
        or label.startswith(("expert_", "shared_"))}
