"""Deferred planning after the MoE gate, in the running model (§V-A).

The plan of a micro-batch is chosen before its forward, for the imbalance expected then. After each MoE router
the model calls :func:`bagualu2.exec.after_gate` with the routed copies this rank's experts will receive; the
executor asks its :class:`DeferredPlanner` whether the plan in force still fits the micro-batch's budget at the
imbalance that routing realised. If not, the rest of that MoE module runs under full recompute: every later
saving of a tensor the module makes after its router (permute, dispatch, experts, combine, shared expert) becomes
RECOMPUTE, so backward restarts the module from its input and the routing (both exist already and stay).

The prediction is ``costmodel.evaluate`` of the plan in force on the chunk's graph built at the realised
imbalance of this layer, i.e. assuming every MoE layer of the chunk routes like this one (exact when they do;
an over-estimate for the layers before a spike, which keep what they stored).
"""

from __future__ import annotations

from bagualu2.budget import downgrade_needed, downgrade_plan
from bagualu2.costmodel import Hardware, ModelConfig, OpGraph, ParallelConfig, Plan, build_graph, evaluate


def downgrade_module(graph: OpGraph, plan: Plan | None, layer: int) -> Plan:
    """``plan`` with MoE layer ``layer`` downgraded after its gate (``budget.downgrade_plan`` of that layer):
    every saving of a tensor the module makes after its router set to RECOMPUTE; what exists when the gate is known
    (the module's input, the router's outputs) stays as planned, so backward restarts the module from it."""
    return downgrade_plan(graph, plan, layers=(layer,))


class DeferredPlanner:
    """After-gate decisions for micro-batches of one chunk with a budget of ``budget_bytes`` each."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, *, budget_bytes: int,
                 stage: int = 0, chunk: int = 0):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise ValueError(f"budget_bytes must be a non-negative integer, got {budget_bytes!r}")
        self.model, self.parallel, self.hardware = model, parallel, hardware
        self.budget_bytes, self.stage, self.chunk = budget_bytes, stage, chunk
        self._graphs: dict[float, OpGraph] = {}
        self.decisions: list[tuple[int, float, int, bool]] = []  # (layer, imbalance, predicted bytes, downgraded)

    def graph(self, imbalance: float = 1.0) -> OpGraph:
        found = self._graphs.get(imbalance)
        if found is None:
            found = self._graphs[imbalance] = build_graph(self.model, self.parallel, self.hardware,
                                                          imbalance=imbalance, stage=self.stage, chunk=self.chunk)
        return found

    def imbalance(self, layer: int, received_tokens: int) -> float:
        """Realised imbalance: routed copies received over the mean (``T*K`` per rank), at least 1."""
        if isinstance(received_tokens, bool) or not isinstance(received_tokens, int) or received_tokens < 0:
            raise ValueError(f"received_tokens must be a non-negative integer, got {received_tokens!r}")
        mean = self.graph().tensors[f"L{layer}.permuted"].numel // self.model.hidden_size
        return max(received_tokens / mean, 1.0)

    def after_gate(self, plan: Plan, layer: int, received_tokens: int) -> Plan | None:
        """The downgraded plan if ``plan`` does not fit the budget at the realised imbalance, else None."""
        imbalance = self.imbalance(layer, received_tokens)
        predicted = evaluate(self.graph(imbalance), plan).activation_bytes
        downgrade = downgrade_needed(predicted, self.budget_bytes)
        self.decisions.append((layer, imbalance, predicted, downgrade))
        return self.downgrade(plan, layer) if downgrade else None

    def downgrade(self, plan: Plan, layer: int) -> Plan:
        return downgrade_module(self.graph(), plan, layer)
