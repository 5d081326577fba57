"""Deferred planning after the MoE gate (§V-A): downgrade a micro-batch's MoE module to full recompute.

When the gate reveals more routed tokens than the micro-batch's budget allows, the caller rebuilds the graph at
the measured imbalance and asks :func:`downgrade_plan` for a plan that recomputes every tensor the MoE module
(router, permute, dispatch, experts, combine, unpermute, shared expert) keeps. Its input, kept by the second
norm, stays, so the module restarts from it in backward. The attention part keeps the plan it already had.
"""

from __future__ import annotations

from ..costmodel import OpGraph, Plan, Strategy, evaluate
from ..costmodel.graph import MOE_KINDS
from .assigner import downgrade_needed


def downgrade_plan(graph: OpGraph, plan: Plan | None = None) -> Plan:
    """``plan`` with every saving of every MoE-module op of ``graph`` set to RECOMPUTE."""
    entries = dict(plan.entries) if plan is not None else {}
    for op, saving in graph.savings:
        if op.kind in MOE_KINDS and (op.name, saving.tensor) not in graph.pinned:
            entries[f"{op.name}/{saving.tensor}"] = Strategy.RECOMPUTE
    return Plan(tuple(entries.items()))


def plan_after_gate(graph: OpGraph, plan: Plan | None, budget_bytes: int) -> tuple[Plan, bool]:
    """The plan to run once the gate has routed this micro-batch (``graph`` built at the measured imbalance).

    Returns ``(plan, downgraded)``: ``plan`` unchanged if its bytes fit ``budget_bytes``, else the MoE-module
    downgrade of it.
    """
    kept = evaluate(graph, plan).activation_bytes
    if not downgrade_needed(kept, budget_bytes):
        return plan if plan is not None else Plan(), False
    return downgrade_plan(graph, plan), True
