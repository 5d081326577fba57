"""Deferred planning after the MoE gate, in the running model (§V-A): ``exec`` asks ``bagualu2.runtime`` what to
do; it does not decide itself.

The plan of a micro-batch is chosen before its forward, for the imbalance expected then. After each MoE router
the model calls :func:`bagualu2.exec.after_gate` with the routed copies this rank's experts will receive; the
executor asks its :class:`DeferredPlanner`, which builds the chunk's graph at the realised imbalance and calls
:func:`bagualu2.runtime.after_gate` with the tensors this MoE module makes after its router (and those of the
later layers) still free: keep, graded re-plan of that part, or the full MoE-module downgrade
(``downgrade="paper"``: keep or downgrade only). What exists when the gate is known (the module's input, the
router's outputs, earlier layers) stays as planned.

The prediction is ``costmodel.evaluate`` on the chunk's graph built at the realised imbalance of this layer, i.e.
assuming every MoE layer of the chunk routes like this one (exact when they do; an over-estimate for the layers
before a spike, which keep what they stored). A model known only by its traced graph (a transformers model through
``integrations.hf``, a model of your own through ``exec.instrument`` with a gate) gets the same decision from
:meth:`DeferredPlanner.for_graph`: its graph at the realised imbalance is the traced graph with its routed tensors
resized (``costmodel.rescale``).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from bagualu2.costmodel import Hardware, ModelConfig, OpGraph, ParallelConfig, Plan
from bagualu2.costmodel.validate import require_int, require_number
from bagualu2.runtime import Stage, TracedStage, after_gate, ceil_bucket, check_downgrade, downgrade_plan

MAX_DECISIONS = 4096  # a long run's planner keeps only its latest gate decisions


class GateKey(NamedTuple):
    """A gate decision of a running chunk: the plan in force, the gate's layer, the imbalance bucket, the
    (quantised) budget, the chunk and the mode."""

    entries: tuple
    layer: int
    imbalance: float
    budget: int
    chunk: int
    mode: str


class DeferredPlanner:
    """After-gate decisions for micro-batches of one chunk with a budget of ``budget_bytes`` each. ``engine``: the
    stage's :class:`~bagualu2.runtime.Stage` (its graphs, costs and memo; default: a new one). A model known only
    by its traced graph: :meth:`for_graph`."""

    def __init__(self, model: ModelConfig | None, parallel: ParallelConfig | None, hardware: Hardware, *,
                 budget_bytes: int, stage: int = 0, chunk: int = 0, downgrade: str = "graded",
                 imbalance_step: float = 0.02, budget_quantum_bytes: int | None = None,
                 engine: Stage | TracedStage | None = None):
        self.budget_bytes = require_int("budget_bytes", budget_bytes, 0)
        self.mode = check_downgrade(downgrade)
        self.imbalance_step = require_number("imbalance_step", imbalance_step, 0, 10, low_open=True)
        self.model, self.parallel, self.hardware = model, parallel, hardware
        if isinstance(engine, TracedStage):
            if model is not None or parallel is not None or hardware is not engine.hardware:
                raise ValueError("a DeferredPlanner on a traced graph takes no model or parallel config: use "
                                 "DeferredPlanner.for_graph(graph, budget_bytes=...)")
        elif engine is None:
            if not isinstance(model, ModelConfig) or not isinstance(parallel, ParallelConfig):
                raise ValueError("DeferredPlanner needs a ModelConfig and a ParallelConfig (or, for a traced graph, "
                                 "DeferredPlanner.for_graph(graph, budget_bytes=...)), got "
                                 f"{type(model).__name__} and {type(parallel).__name__}")
            engine = Stage(model, parallel, hardware, stage=stage)
        elif not isinstance(engine, Stage) or (engine.model, engine.parallel, engine.hardware, engine.stage) != (
                model, parallel, hardware, stage):
            raise ValueError("engine must be a runtime Stage of the same model, parallel config, hardware and stage")
        self.engine = engine
        engine.check_chunk(chunk)
        self.stage, self.chunk = stage, chunk
        # decisions memoised by (plan, layer, imbalance bucket, budget); with ``budget_quantum_bytes`` the budget
        # is floored to that grid first (a decision for the floored budget fits the real one; more hits)
        self.quantum_bytes = 1 if budget_quantum_bytes is None else require_int("budget_quantum_bytes",
                                                                                  budget_quantum_bytes, 1)
        self._decided = engine.memo.table(GateKey)
        # (layer, imbalance, predicted bytes of the plan in force, plan changed)
        self.decisions: deque[tuple[int, float, int, bool]] = deque(maxlen=MAX_DECISIONS)  # the latest only

    @classmethod
    def for_graph(cls, graph: OpGraph, *, budget_bytes: int, downgrade: str = "graded",
                  imbalance_step: float = 0.02, budget_quantum_bytes: int | None = None,
                  engine: TracedStage | None = None) -> "DeferredPlanner":
        """A planner for a model known by its traced graph (``InstrumentedModel.trace_graph``, its routers
        reporting to the gate): the graph at the realised imbalance is the traced one with its routed tensors
        resized (:class:`~bagualu2.runtime.TracedStage`). ``ValueError`` for a graph with no routed token
        counts."""
        if engine is None:
            engine = TracedStage(graph)
        elif not isinstance(engine, TracedStage) or engine.traced is not graph:
            raise ValueError("engine must be the TracedStage of this graph")
        return cls(None, None, graph.hardware, budget_bytes=budget_bytes, downgrade=downgrade,
                   imbalance_step=imbalance_step, budget_quantum_bytes=budget_quantum_bytes, engine=engine)

    def graph(self, imbalance: float = 1.0) -> OpGraph:
        return self.engine.graph(self.chunk, imbalance)

    def imbalance(self, layer: int, received_tokens: int) -> float:
        """Realised imbalance: routed copies received over the mean (``T*K`` per rank), at least 1 (and at most
        ``min(ep, num_experts / top_k)``, ``costmodel.imbalance_limit``: more than routing can send is refused)."""
        received_tokens = require_int("received_tokens", received_tokens, 0, 1 << 62)
        mean, most = self.graph().mean_routed_tokens, self.engine.max_imbalance
        if not mean:
            raise ValueError("the model has no routed tokens (a dense model): there is no gate to decide after")
        if most is not None and received_tokens > most * mean * (1 + 1e-12):  # the float limit may round down
            raise ValueError(f"received_tokens must be at most min(ep, num_experts / top_k) x the mean routed copies "
                             f"({most:.4g} x {mean}: the most routing sends one rank), got {received_tokens}")
        return max(received_tokens / mean, 1.0)

    def after_gate(self, plan: Plan, layer: int, received_tokens: int, *,
                   budget_bytes: int | None = None) -> Plan | None:
        """The plan to switch to after layer ``layer``'s gate, or None to keep ``plan``: the one after-gate
        decision, ``runtime.after_gate``, in this planner's mode. The graph is built at the realised imbalance
        rounded *up* to ``imbalance_step`` (the runtime's buckets: a conservative decision, and a bounded number
        of graphs however continuous the measurements). ``budget_bytes`` overrides the planner's budget for this
        micro-batch."""
        plan = _plan(plan)
        layer = require_int("layer", layer, 0)
        imbalance = ceil_bucket(self.imbalance(layer, received_tokens), self.imbalance_step,
                                self.engine.max_imbalance)
        budget = self.budget_bytes if budget_bytes is None else require_int("budget_bytes", budget_bytes, 0)
        budget -= budget % self.quantum_bytes
        key = GateKey(plan.entries, layer, imbalance, budget, self.chunk, self.mode)
        found = self._decided.get(key)
        if found is None:
            engine, chunk = self.engine, self.chunk
            graph = self.graph(imbalance)
            later = sorted({op.layer for op in graph.ops if op.kind == "router" and op.layer >= layer})
            decision = after_gate(graph, plan, budget, downgrade=self.mode, layers=later,
                                  downgrade_layers=(layer,),
                                  cost=lambda candidate: engine.cost(candidate, imbalance, chunk))
            found = self._decided[key] = (decision.plan if decision.changed else None,
                                          engine.cost(plan, imbalance, chunk).activation_bytes)
        self.decisions.append((layer, imbalance, found[1], found[0] is not None))
        return found[0]

    def downgrade(self, plan: Plan, layer: int) -> Plan:
        """The full downgrade of ``layer`` (what every EP rank runs when any rank had to change its plan)."""
        return downgrade_plan(self.graph(), _plan(plan), layers=(require_int("layer", layer, 0),))


def _plan(plan) -> Plan:
    """A plan in force: a :class:`Plan` or its text form (``ValueError`` otherwise)."""
    plan = Plan.coerce(plan)
    if plan is None:
        raise ValueError("plan must be a Plan or its text form, got None")
    return plan
