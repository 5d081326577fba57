"""Conflict checker for composed mitigation strategies (paper §V-A, "Heterogeneous Mitigation Conflicts").

Rules, each reported as a :class:`Violation` naming the op and the tensor:

``invalid-entry``
    A plan entry that cannot apply to the graph: an op that does not save that tensor, a pinned block input
    given anything but KEEP, or QUANTIZE of a saving that is not a floating tensor in the activation precision
    (masks, indices, the router's FP32 copy).
``multi-device``
    The consumers of one tensor disagree on its placement: device (KEEP, QUANTIZE), host (OFFLOAD) or
    regenerated (RECOMPUTE). The device copy a consumer keeps persists, so offloading or recomputing the tensor
    at another consumer frees nothing (e.g. the core-attention output offloaded at core attention but kept
    by the out-projection).
``multi-precision``
    One consumer stores the tensor as FP8 while another stores it in its own precision: two copies coexist
    (e.g. the MoE-layer input quantised for the shared expert while the router keeps its FP32 copy).
``recompute-unavailable``
    A recomputed tensor cannot be regenerated at backward: its producer chain reaches a graph input that no
    consumer stores (a recomputed op's inputs must be available).

The checker returns every violation; an empty list means the plan is conflict-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..costmodel import OpGraph, Plan, Strategy, evaluate, resolve
from ..costmodel.evaluate import evaluate_resolved
from .solution import check_graph

PLACEMENT = {Strategy.KEEP: "device", Strategy.QUANTIZE: "device", Strategy.OFFLOAD: "host",
             Strategy.RECOMPUTE: "regenerated"}
RULES = ("invalid-entry", "multi-device", "multi-precision", "recompute-unavailable")


@dataclass(frozen=True, slots=True)
class Violation:
    rule: str
    op: str
    tensor: str
    message: str

    def __str__(self) -> str:
        return f"{self.rule}: {self.op}/{self.tensor}: {self.message}"


def check_conflicts(graph: OpGraph, plan: Plan | None) -> list[Violation]:
    """All violations of ``plan`` on ``graph`` (see the module docstring for the rules)."""
    check_graph(graph)
    violations: list[Violation] = []
    strategies = {(op.name, s.tensor): Strategy.KEEP for op, s in graph.savings}
    plan = Plan.coerce(plan)
    if plan is not None:
        for key, strategy in plan.entries:
            single = Plan(((key, strategy),))
            try:
                evaluate(graph, single)
            except ValueError as exc:
                op, _, tensor = key.partition("/")
                violations.append(Violation("invalid-entry", op, tensor or "*", str(exc)))
        valid = Plan(tuple(e for e in plan.entries
                           if not any(v.rule == "invalid-entry" and _key(v) == e[0] for v in violations)))
        strategies = resolve(graph, valid)
    violations.extend(tensor_conflicts(graph, strategies))
    cost = evaluate_resolved(graph, strategies)
    for tensor in cost.unavailable:
        op = next((op.name for op in graph.ops if tensor in op.inputs), "?")
        violations.append(Violation("recompute-unavailable", op, tensor,
                                    f"re-running {op} needs graph input {tensor}, which no consumer stores"))
    return violations


def _key(violation: Violation) -> str:
    return violation.op if violation.tensor == "*" else f"{violation.op}/{violation.tensor}"


def tensor_conflicts(graph: OpGraph, strategies: dict[tuple[str, str], Strategy]) -> list[Violation]:
    """The ``multi-device`` and ``multi-precision`` violations of resolved per-saving strategies."""
    by_tensor: dict[str, list[tuple[str, Strategy]]] = {}
    for op, saving in graph.savings:
        by_tensor.setdefault(saving.tensor, []).append((op.name, strategies[(op.name, saving.tensor)]))
    violations = []
    for tensor, users in by_tensor.items():
        if len(users) < 2:
            continue
        placements = {PLACEMENT[s] for _, s in users}
        if len(placements) > 1:
            op = next(op for op, s in users if s is not Strategy.KEEP)
            violations.append(Violation(
                "multi-device", op, tensor,
                "consumers disagree on placement: " + ", ".join(f"{o}={s.value}" for o, s in users)))
        stored = {s for _, s in users if s is not Strategy.RECOMPUTE}
        if Strategy.QUANTIZE in stored and len(stored) > 1:
            op = next(op for op, s in users if s is Strategy.QUANTIZE)
            violations.append(Violation(
                "multi-precision", op, tensor,
                "stored as FP8 at one consumer and in full precision at another: "
                + ", ".join(f"{o}={s.value}" for o, s in users)))
    return violations
