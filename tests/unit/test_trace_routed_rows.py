"""What a traced graph counts as routed rows and as activations.

* A cast or copy of a weight the experts make beside their routed rows is not routed, even when its size happens
  to be a multiple of the routed copies: it keeps its traced size when the graph is resized.
* A gate reporting more copies than any routed tensor has elements (it counts something else) is refused at the
  trace; a count no tensor is a multiple of (experts padded to a capacity) leaves them unrouted.
* A parameter, or a view of one, is never an activation, wherever its storage lives (FSDP gathers a sharded
  parameter into a parameter of a storage of its own for the forward and backward).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from bagualu2.costmodel import presets
from bagualu2.costmodel.rescale import at_imbalance
from bagualu2.exec import ActivationTracker, GateReport, instrument
from bagualu2.exec.tracker import is_parameter

HW = presets.hardware("cpu")
TOKENS, TOP_K, DIM = 4, 2, 4
COPIES = TOKENS * TOP_K  # 8 routed rows


class _Router(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, 4)

    def forward(self, x):
        return self.proj(x), torch.arange(COPIES).remainder(4).view(TOKENS, TOP_K)


class _Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, 16))  # 64 elements: a multiple of the 8 routed rows

    def forward(self, x):
        rows = x.repeat_interleave(TOP_K, dim=0)            # one row per routed copy
        copy = self.w.clone()                               # a weight copy (4 x 16), saved by the matmul
        return torch.tanh(rows @ copy).view(TOKENS, TOP_K, 16).sum(1)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.router, self.experts = _Router(), _Experts()

    def forward(self, x):
        _, _ = self.router(x)
        return self.experts(x)


def _gate(router, inputs, output):
    return GateReport(COPIES, sent=COPIES)


def test_a_weight_copy_beside_the_routed_rows_is_not_routed():
    model = nn.ModuleDict({"layer": _Layer()})
    instrumented = instrument(model["layer"], {"router": "router", "experts": "dispatch"}, gate=_gate)
    graph = instrumented.trace_graph(torch.randn(TOKENS, DIM, requires_grad=True), hardware=HW)
    experts = next(op for op in graph.ops if op.kind == "dispatch")
    sizes = {saving.tensor: graph.tensors[saving.tensor].numel for saving in experts.saves}
    routed = {name for name in sizes if graph.tensors[name].routed}
    assert 64 in sizes.values() and COPIES * DIM in sizes.values()
    assert {sizes[name] for name in routed} >= {COPIES * DIM, COPIES * 16}  # the rows and the tanh output
    weight_copy = next(name for name in sizes if name not in routed and sizes[name] == 64)
    doubled = at_imbalance(graph, 2.0)
    assert doubled.tensors[weight_copy].numel == 64  # the weight copy keeps its size
    assert all(doubled.tensors[name].numel == 2 * sizes[name] for name in routed)


@pytest.mark.parametrize("received", [10**6, 2**70])
def test_a_gate_count_larger_than_any_routed_tensor_is_refused(received):
    model = nn.ModuleDict({"layer": _Layer()})
    instrumented = instrument(model["layer"], {"router": "router", "experts": "dispatch"},
                              gate=lambda router, inputs, output: GateReport(received, sent=COPIES))
    with pytest.raises(ValueError) as excinfo:
        instrumented.trace_graph(torch.randn(TOKENS, DIM, requires_grad=True), hardware=HW)
    message = str(excinfo.value)
    assert "\n" not in message and f"experts received {received} routed token copies" in message
    assert "more than the 128 elements of the largest tensor they keep" in message


def test_a_gate_count_that_only_fits_no_tensor_leaves_it_unrouted():
    """Experts padded to a capacity hold as many rows whatever the routing: a count no tensor is a multiple of
    (but no larger than they are) makes none of them routed; the graph keeps their traced sizes."""
    model = nn.ModuleDict({"layer": _Layer()})
    instrumented = instrument(model["layer"], {"router": "router", "experts": "dispatch"},
                              gate=lambda router, inputs, output: GateReport(COPIES + 1, sent=COPIES))
    graph = instrumented.trace_graph(torch.randn(TOKENS, DIM, requires_grad=True), hardware=HW)
    assert not any(spec.routed for spec in graph.tensors.values())


def test_a_parameter_or_a_view_of_one_is_not_an_activation():
    gathered = nn.Parameter(torch.randn(8, 8))  # a parameter of no module the tracker was told of
    assert is_parameter(gathered) and is_parameter(gathered.t()) and not is_parameter(gathered * 1.0)
    tracker = ActivationTracker()
    x = torch.randn(4, 8, requires_grad=True)
    with tracker.micro_batch("mb"):
        y = x @ gathered.t()   # saves x and a view of the parameter
        z = (y * 2.0).sum()
    assert tracker.kept_bytes("mb") == x.untyped_storage().nbytes()  # x only: not the parameter view
    z.backward()
