"""The reference model instrumented from outside (no change to the model: an op map on its modules): its traced
graph is a cross-check of the analytic cost model. (Running plans on it from outside needs the model without its
own ``run_op`` calls, whose op scopes and replays would compete with the hooks: issue #14, item 4, not done.)

Where the reference model's modules are the cost model's ops (norms, attention, projections, experts, dense and
shared MLPs) the traced per-op saved bytes equal ``build_graph``'s; its MoE block is one module holding
``router``, ``permute`` and ``unpermute`` (function calls inside it), whose savings it owns together (the routing
map they share counted once); in total the traced graph keeps exactly ``build_graph``'s unmitigated bytes.
"""

from __future__ import annotations

import pytest
import torch

from bagualu2.costmodel import ParallelConfig, build_graph, presets
from bagualu2.exec import instrument
from reference_trainer.model import GLMMoEModel

HW = presets.hardware("cpu")
OP_MAP = {"m.layers.*.norm1": "norm1", "m.layers.*.norm2": "norm2", "m.layers.*.attention": "core_attn",
          "m.layers.*.attention.qkv": "qkv", "m.layers.*.attention.out": "attn_out",
          "m.layers.0.mlp": "mlp_act", "m.layers.0.mlp.fc1": "mlp_fc1", "m.layers.0.mlp.fc2": "mlp_fc2",
          "m.layers.[1-9].mlp": "router", "m.layers.[1-9].mlp.experts.[0-9]": "expert_act",
          "m.layers.[1-9].mlp.experts.*.fc1": "expert_fc1", "m.layers.[1-9].mlp.experts.*.fc2": "expert_fc2",
          "m.layers.[1-9].mlp.shared": "shared_act", "m.layers.[1-9].mlp.shared.fc1": "shared_fc1",
          "m.layers.[1-9].mlp.shared.fc2": "shared_fc2"}
MOE_BLOCK = ("router", "permute", "unpermute")


class Layers(torch.nn.Module):
    """The transformer layers of a reference model (what the cost model covers) as a module."""

    def __init__(self, model: GLMMoEModel):
        super().__init__()
        self.m = model

    def forward(self, x):
        return self.m.forward_layers(x)


def op_bytes(graph, op) -> int:
    return graph.copies_bytes({(s.tensor, s.dtype) for s in op.saves})


@pytest.fixture(scope="module")
def traced():
    config = presets.model("tiny-moe")[0].replace(seq_length=32)
    torch.manual_seed(0)
    model = Layers(GLMMoEModel(config))
    x = torch.randn(config.micro_batch_size, config.seq_length, config.hidden_size, requires_grad=True)
    instrumented = instrument(model, OP_MAP)
    graph = instrumented.trace_graph(x, hardware=HW)
    return model, x, instrumented, graph, build_graph(config, ParallelConfig(), HW)


def test_traced_graph_cross_checks_build_graph(traced):
    _, _, instrumented, graph, analytic = traced
    assert graph.unmitigated_bytes == analytic.unmitigated_bytes
    assert instrumented.trace.unmapped_bytes == 0
    for op in analytic.ops:
        if op.kind in MOE_BLOCK or not op.saves:
            continue
        assert op_bytes(graph, graph.op(op.name)) == op_bytes(analytic, op), op.name
    for layer in {op.layer for op in analytic.ops if op.kind == "router"}:
        block = {(s.tensor, s.dtype) for op in analytic.ops if op.layer == layer and op.kind in MOE_BLOCK
                 for s in op.saves}
        assert op_bytes(graph, graph.op(f"L{layer}.router")) == analytic.copies_bytes(block)
