"""Deferred planning on traced graphs, in one process: transformers MoE models (tiny random configs) and a model
of our own, instrumented from outside.

* a traced graph carries the routed token copies each MoE layer received (``mean_routed_tokens``,
  ``layer_routed_tokens``) and its routed tensors are one row per copy, so ``at_imbalance`` resizes it;
* ``DeferredPlanner.for_graph`` decides after every gate on the graph at the realised imbalance: with a budget
  the plan in force overruns, the gate re-plans (graded) or downgrades (paper); the bytes kept are exactly what
  the cost model says of the final plan, within the budget, and the loss and gradients are the plain run's,
  bitwise, every re-run verified;
* a storage saved by two ops, the first of which autograd frees early, stays readable by a later re-run (the
  executor notes every kept alias of a storage, not only the first).

Under expert parallelism (a biased router sending one rank every copy) the same is checked across two ranks by
``test_hf_gate_ep.py``.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bagualu2.costmodel import Plan, evaluate, presets  # noqa: E402
from bagualu2.costmodel.rescale import at_imbalance  # noqa: E402
from bagualu2.exec import DeferredPlanner, GateReport, apply_plan, instrument  # noqa: E402
from bagualu2.runtime import TracedStage, downgrade_plan  # noqa: E402
from hf_models import FAMILIES  # noqa: E402

HW = presets.hardware("cpu")
NAMED = ("qwen3_moe", "deepseek_v3", "mixtral")
QUANTIZE_LOSS_RTOL, QUANTIZE_GRAD_COS = 0.02, 0.98  # as tests/integration/test_hf.py


@functools.lru_cache(maxsize=None)
def _traced(family: str):
    pytest.importorskip("transformers")
    from bagualu2.integrations import hf
    from hf_models import tiny

    torch.set_num_threads(1)
    model, ids = tiny(family)
    instrumented = hf.instrument(model)
    graph = instrumented.trace_graph(input_ids=ids, labels=ids, hardware=HW, loss=lambda out: out.loss)
    return model, ids, instrumented, graph


def _step(model, ids, instrumented=None, plan=None, planner=None):
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    if instrumented is None:
        loss = model(input_ids=ids, labels=ids).loss
        record = None
    else:
        executor = apply_plan(instrumented, plan, deferred=planner, verify=True)
        with executor.micro_batch("mb") as record:
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if instrumented is not None:
        executor.release("mb")
    grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, record


@pytest.mark.slow
@pytest.mark.parametrize("family", NAMED)
def test_a_traced_graph_carries_its_routed_counts_and_rescales(family):
    model, ids, _, graph = _traced(family)
    tokens = ids.numel() * model.config.num_experts_per_tok
    assert graph.mean_routed_tokens == tokens
    moe_layers = {op.layer for op in graph.ops if op.kind == "router"}
    assert dict(graph.layer_routed_tokens) == {layer: tokens for layer in moe_layers}
    routed = [n for n, s in graph.tensors.items() if s.routed]
    assert routed and all(graph.tensors[n].numel % tokens == 0 for n in routed)
    assert {graph.tensor_layers[n] for n in routed} == moe_layers
    doubled = at_imbalance(graph, 2.0)
    for name in routed:
        assert doubled.tensors[name].numel == 2 * graph.tensors[name].numel
    assert doubled.unmitigated_bytes - graph.unmitigated_bytes == graph.routed_bytes
    assert at_imbalance(graph, 1.0).unmitigated_bytes == graph.unmitigated_bytes


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ["graded", "paper"])
def test_the_gate_replans_a_traced_model_within_budget_exactly(family, mode):
    """Every family: a budget the plan in force (keep all) overruns and re-planning the MoE modules can meet; the
    gate changes the plan, the bytes kept are evaluate's of the final plan, within budget; loss and gradients
    bitwise (within the FP8 tolerances when the re-plan quantises). With ``downgrade="paper"`` a family whose
    router draws random numbers in training (phimoe) cannot re-run the module: the plan in force stays."""
    model, ids, instrumented, graph = _traced(family)
    loss0, grads0, _ = _step(model, ids)
    full = evaluate(graph, downgrade_plan(graph))
    budget = full.activation_bytes + (graph.unmitigated_bytes - full.activation_bytes) // 3
    planner = DeferredPlanner.for_graph(graph, budget_bytes=budget, downgrade=mode)
    loss, grads, record = _step(model, ids, instrumented, Plan(), planner)
    assert record.device_bytes == evaluate(graph, record.plan).activation_bytes
    assert [d[1] for d in planner.decisions] == [1.0] * len(planner.decisions)  # one process: no imbalance
    if mode == "paper" and full.unavailable:
        assert record.downgraded == [] and record.plan == Plan()
    else:
        assert record.downgraded and set(record.downgraded) <= set(graph.layer_routed_tokens)
        assert record.device_bytes <= budget
    if any(strategy.value == "QUANTIZE" for _, strategy in record.plan.entries):
        assert abs(float(loss - loss0)) <= QUANTIZE_LOSS_RTOL * abs(float(loss0))
        flat, flat0 = torch.cat([g.flatten() for g in grads]), torch.cat([g.flatten() for g in grads0])
        assert torch.nn.functional.cosine_similarity(flat, flat0, dim=0) >= QUANTIZE_GRAD_COS
    else:
        assert torch.equal(loss, loss0) and all(torch.equal(a, b) for a, b in zip(grads, grads0))


@pytest.mark.slow
def test_a_plan_that_fits_is_kept():
    model, ids, instrumented, graph = _traced("qwen3_moe")
    planner = DeferredPlanner.for_graph(graph, budget_bytes=graph.unmitigated_bytes)
    _, _, record = _step(model, ids, instrumented, Plan(), planner)
    assert record.downgraded == [] and record.device_bytes == graph.unmitigated_bytes


def test_for_graph_refuses_a_graph_without_routed_counts_and_a_foreign_engine():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(8)
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(self.norm(x))

    instrumented = instrument(Tiny(), {"norm": "norm1", "fc": "mlp_fc1"})
    graph = instrumented.trace_graph(torch.randn(4, 8, requires_grad=True), hardware=HW)
    with pytest.raises(ValueError, match="no routed token counts"):
        DeferredPlanner.for_graph(graph, budget_bytes=1)
    with pytest.raises(ValueError, match="OpGraph"):
        TracedStage("graph")


def test_a_stored_storage_stays_readable_while_any_of_its_kept_aliases_lives():
    """Every saving of a storage packs an alias of its own; autograd frees them one by one (a node whose outputs
    are dropped, such as a ``topk`` whose values nobody reads, goes first), so the record must not hang on the
    first alias only: under expert parallelism the router's indices were lost that way before a re-run of the
    experts read them."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from bagualu2.exec.recompute import Stored

    storage = torch.arange(6)
    first, second = storage.detach(), storage.view(2, 3).detach()
    stored = Stored(0, StorageWeakRef(storage.untyped_storage()), 48, storage.dtype, storage.device)
    stored.keep(first)
    stored.keep(second)
    del first
    assert stored.kept is second
    stored.hold()  # a reader: held strongly from now on
    del second
    assert torch.equal(stored.kept.reshape(-1), torch.arange(6))
    stored.unhold()
    assert stored.kept is None  # the last reader is done: autograd owns it again (nothing else holds it here)


class _Routed(torch.nn.Module):
    """A norm, a router (a linear layer and its top-2) and one expert on the rows it picks, ``calls`` times over."""

    def __init__(self, calls: int = 1):
        super().__init__()
        self.calls = calls
        self.norm = torch.nn.LayerNorm(8)
        self.router = torch.nn.Linear(8, 4)
        self.expert = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())

    def forward(self, x):
        h = self.norm(x)
        for _ in range(self.calls):
            index = torch.topk(self.router(h), 2, dim=-1)[1]
            h = h + self.expert(h[index.reshape(-1) % h.shape[0]]).reshape(h.shape[0], 2, 8).sum(1)
        return h


def _routed_graph(calls: int, received):
    instrumented = instrument(_Routed(calls), {"norm": "norm2", "router": "router", "expert": "expert_fc1"},
                              gate=lambda router, inputs, output: received(output))
    return instrumented.trace_graph(torch.randn(6, 8, requires_grad=True), hardware=HW)


def test_a_layer_whose_router_runs_twice_gets_no_counts():
    """The gate at run time reports one router call: a trace with two in one layer gives the graph no counts
    (one call's count is no measure of the layer's tensors), and the deferred planner refuses it."""
    graph = _routed_graph(2, lambda output: output.shape[0] * 2)
    assert graph.mean_routed_tokens == 0 and not graph.layer_routed_tokens
    with pytest.raises(ValueError, match="each MoE layer's router once"):
        DeferredPlanner.for_graph(graph, budget_bytes=graph.unmitigated_bytes)


def test_a_layer_that_received_nothing_in_the_trace_is_refused_when_the_planner_is_made():
    # this rank's experts received no copy in the traced batch; its router sent 12
    graph = _routed_graph(1, lambda output: GateReport(0, sent=output.shape[0] * 2))
    assert graph.mean_routed_tokens == 12
    assert graph.layer_routed_tokens == {0: 0}
    with pytest.raises(ValueError, match="layer 0 .* received no routed token copies"):
        DeferredPlanner.for_graph(graph, budget_bytes=graph.unmitigated_bytes)
    cost = evaluate(graph)
    assert cost.routed_bytes  # the expert's output, routed
    with pytest.raises(ValueError, match="holds no routed token copies"):
        cost.activation_bytes_received(graph, {0: 12})
