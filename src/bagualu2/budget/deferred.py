"""Deferred planning after the MoE gate (§V-A): downgrade a micro-batch's MoE module to full recompute.

When the gate reveals more routed tokens than the micro-batch's budget allows, the caller rebuilds the graph at
the measured imbalance and asks :func:`downgrade_plan` for a plan that recomputes every tensor the MoE module makes
after its router (permute, dispatch, experts, combine, unpermute, shared expert). What exists when the gate is
known stays as planned: the module's input (kept by the second norm and the router) and the router's outputs
and savings (routing weights, routing map, scores) — the ops that made them have already run, so backward could
not re-run them; the module restarts from them. The attention part keeps the plan it already had. This is what
``bagualu2.exec`` executes (``exec.deferred``), so the bytes the evaluator charges are the bytes a run keeps.
"""

from __future__ import annotations

import weakref

from ..costmodel import OpGraph, Plan, Strategy, evaluate
from ..costmodel.graph import MOE_KINDS
from .assigner import downgrade_needed


def downgrade_plan(graph: OpGraph, plan: Plan | None = None, *, layers=None) -> Plan:
    """``plan`` with the MoE modules of ``layers`` (default: all) downgraded after their gate: every saving of a
    tensor made by a MoE op after the router set to RECOMPUTE. ``ValueError`` for a layer with no MoE module."""
    entries = dict(plan.entries) if plan is not None else {}
    if layers is None:
        keys = _moe_savings(graph)
    else:
        wanted = set(layers)
        moe_layers = {op.layer for op in graph.ops if op.kind == "router"}
        for layer in sorted(wanted - moe_layers):
            raise ValueError(f"layer {layer} is not a MoE layer of this graph ({graph.label})")
        keys = tuple(k for k in _moe_savings(graph) if graph.op(k.partition("/")[0]).layer in wanted)
    for key in keys:
        entries[key] = Strategy.RECOMPUTE
    return Plan(tuple(entries.items()))


_MOE_SAVINGS: "weakref.WeakKeyDictionary[OpGraph, tuple[str, ...]]" = weakref.WeakKeyDictionary()


def _moe_savings(graph: OpGraph) -> tuple[str, ...]:
    """Plan keys of the savings of tensors that MoE ops after the router make, not pinned, in graph order (cached
    per graph object)."""
    found = _MOE_SAVINGS.get(graph)
    if found is None:
        after_gate = {op.name for op in graph.ops if op.kind in MOE_KINDS and op.kind != "router"}
        found = _MOE_SAVINGS[graph] = tuple(
            f"{op.name}/{saving.tensor}" for op, saving in graph.savings
            if op.name in after_gate and graph.tensors[saving.tensor].producer in after_gate
            and (op.name, saving.tensor) not in graph.pinned)
    return found


def plan_after_gate(graph: OpGraph, plan: Plan | None, budget_bytes: int) -> tuple[Plan, bool]:
    """The plan to run once the gate has routed this micro-batch (``graph`` built at the measured imbalance).

    Returns ``(plan, downgraded)``: ``plan`` unchanged if its bytes fit ``budget_bytes``, else the MoE-module
    downgrade of it.
    """
    kept = evaluate(graph, plan).activation_bytes
    if not downgrade_needed(kept, budget_bytes):
        return plan if plan is not None else Plan(), False
    return downgrade_plan(graph, plan), True
