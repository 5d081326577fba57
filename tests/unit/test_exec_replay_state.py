"""A re-run in backward (RECOMPUTE) leaves the module's buffers as the plain run leaves them: a module that counts
what it sees in a buffer (a MoE module's load counter) counts once, and the gradients are the plain run's."""

from __future__ import annotations

import torch
from torch import nn

from bagualu2.costmodel import Plan, Strategy, presets
from bagualu2.exec import apply_plan, instrument, on_backward


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.seen += x.shape[0]
        return torch.tanh(self.fc(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mix = Counting()

    def forward(self, x):
        return x + self.mix(self.norm(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _plain(model, x):
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()], [b.clone() for b in model.buffers()]


def test_a_recomputed_module_counts_once():
    torch.manual_seed(0)
    model, x = Model(), torch.randn(6, 8, requires_grad=True)
    instrumented = instrument(model, {"layers.*.norm": "norm1", "layers.*.mix": "mlp_fc1"})
    before = [b.clone() for b in model.buffers()]
    graph = instrumented.trace_graph(x, hardware=presets.hardware("cpu"))
    with torch.no_grad():
        for buffer, value in zip(model.buffers(), before):
            buffer.copy_(value)
    plain_grads, plain_buffers = _plain(model, x)
    with torch.no_grad():
        for buffer, value in zip(model.buffers(), before):
            buffer.copy_(value)
    own = {(op.name, s.tensor) for op, s in graph.savings
           if op.kind == "mlp_fc1" and graph.tensors[s.tensor].producer == op.name}
    assert own  # the tanh output each mix op saves and makes itself
    plan = Plan.from_decisions({key: Strategy.RECOMPUTE for key in own})
    executor = apply_plan(instrumented, plan, verify=True)
    model.zero_grad(set_to_none=True)
    released = []
    with executor.micro_batch("m") as record:
        out = model(on_backward(x, lambda: released.append(True)))
    assert record.rerun  # the mix ops re-run in backward
    out.square().sum().backward()
    executor.release("m")
    assert released == [True]  # on_backward reported the end of the backward once
    assert all(torch.equal(a, b) for a, b in zip([p.grad for p in model.parameters()], plain_grads))
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), plain_buffers))


def test_a_re_run_in_backward_computes_under_the_forwards_autocast():
    """The forward runs under CPU autocast (bf16), the backward outside it, as training loops do: a RECOMPUTE
    re-run computes in bf16 again, so the gradients are the plain run's bit for bit."""
    torch.manual_seed(0)
    model, x = Model(), torch.randn(6, 8, requires_grad=True)
    instrumented = instrument(model, {"layers.*.norm": "norm1", "layers.*.mix": "mlp_fc1"})
    before = [b.clone() for b in model.buffers()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        graph = instrumented.trace_graph(x, hardware=presets.hardware("cpu"))

    def reset():
        with torch.no_grad():
            for buffer, value in zip(model.buffers(), before):
                buffer.copy_(value)
        model.zero_grad(set_to_none=True)

    reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    out.float().square().sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    reset()
    own = {(op.name, s.tensor) for op, s in graph.savings
           if op.kind == "mlp_fc1" and graph.tensors[s.tensor].producer == op.name}
    executor = apply_plan(instrumented, Plan.from_decisions({key: Strategy.RECOMPUTE for key in own}), verify=True)
    with executor.micro_batch("m") as record:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
    assert record.rerun
    out.float().square().sum().backward()
    executor.release("m")
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), plain))
