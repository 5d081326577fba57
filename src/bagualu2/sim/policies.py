"""The simulator's policies, each per pipeline stage: ``forward(chunk, imbalance, phase,
budget, limit) -> Choice``. Every plan's bytes come from ``costmodel.evaluate`` and its time from the one
execution model (:mod:`.execution`), in the overlap the policy's real system has (``native``: ``megatron`` for
Megatron-Core and the systems built on it, ``fused`` for bagualu2's fused dual-batch order).

* ``flexible``     bagualu2: Algorithm 1's budget and the runtime :class:`~bagualu2.runtime.DecisionPath` (pre-gate
                   plan, after-gate keep / absorb / graded re-plan / downgrade); ``fused`` execution.
Plans fixed before training are made at ``plan_imbalance`` (default 1.0, balanced load; simulate's
``plan_imbalance=`` changes it, e.g. 1.2 to provision for the ordinary iterations and fail on spikes only).

* ``static-under`` one plan per chunk fixed before training for balanced load: ``greedy.solve(graph at r=1,
                   M_max // in-flight count)``; fits at r=1, overruns on spikes (OOM -> restart -> static-over).
* ``static-over``  the paper's over-provisioning: full recompute (:func:`full_recompute`: every saving but the
                   block inputs RECOMPUTE), whose bytes do not depend on the routing.
* ``kwai``         Megatron-Kwai (on Megatron-Core, its offload copies beside compute): its configuration search,
                   the faster of two checkpointing levels that fits M_max // in-flight at r=1 — none, or RECOMPUTE
                   of norms and activation functions (its compute-memory balanced checkpointing) — each plus
                   OFFLOAD of the first ``ceil(alpha * n)`` of the n tensors it still keeps (every saving of each,
                   graph order, block inputs excluded), alpha the smallest of 0, 0.05, ..., 1 that fits (the
                   balanced level with alpha = 1 if none does). A chunk that fits unmitigated runs nothing.
* ``adapipe``      AdaPipe's adaptive recomputation, fixed before training at r=1, RECOMPUTE only: repeatedly
                   recompute the kept tensor (all its savings) with the most bytes freed per added recompute-ns
                   (``evaluate``) until the chunk fits M_max // in-flight; full recompute if it never does.
* ``ideal``        no mitigation and unbounded memory: never an OOM; ``fused`` execution (the upper bound of
                   throughput).
* ``oracle``       knows each micro-batch's imbalance before planning: ``greedy.solve`` on the graph at that exact
                   imbalance with Algorithm 1's budget (no deferred decision), or — per stage and iteration —
                   flexible's decisions where the iteration runs faster (it knows all flexible knows); ``fused``
                   execution.
                   Simulator only.

The ablation levels of the paper's Fig. 11 (``ABLATION``), each adding one of bagualu2's components:

* ``L1``  layer-level policy: full recompute of the fewest whole layers of each chunk (Megatron's
          ``--recompute-granularity full --recompute-method block --recompute-num-layers k``, k per chunk where
          Megatron sets one for every stage) that fits the target, fixed before training.
* ``L2``  + fine-grained composable mitigation, still static: the greedy per-operator plan fixed before training
          (the same plan as ``static-under``).
* ``L3``  + dynamic per-micro-batch mitigation: flexible's decisions on Megatron-Core's execution.
* ``L4``  + fused dual-batch execution: ``flexible``.

``FALLBACKS``: what the operator restarts with after an OOM (the paper: static-under -> static-over; the other
plans fixed before training do the same). ``flexible``, ``oracle`` and ``static-over`` have none: their OOMs are
counted but the run goes on (a configuration where they happen cannot train at all).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from ..costmodel import Hardware, OpGraph, Plan, Strategy, evaluate
from ..mitigation import greedy, prefix
from .execution import check_overlap, execution_of, interference_of
from .stage import Choice, StageContext

POLICIES = ("flexible", "static-under", "static-over", "kwai", "adapipe", "ideal", "oracle")
ABLATION = ("L1", "L2", "L3", "L4")
FALLBACKS = {"static-under": "static-over", "kwai": "static-over", "adapipe": "static-over",
             "L1": "static-over", "L2": "static-over"}
KWAI_BASE = prefix.ELEMENTWISE  # Megatron-Kwai's compute-memory balanced checkpointing
KWAI_STEPS = 20  # alpha in 0, 1/20, ..., 1
NO_PLAN = Plan()


def check_policy(name: str) -> str:
    """``name`` if it is a policy or an ablation level, else a one-line ``ValueError``."""
    if name not in POLICIES and name not in ABLATION:
        raise ValueError(f"policy must be one of {', '.join(POLICIES + ABLATION)}, got {name!r}")
    return name


class StagePolicy:
    """A policy on one stage. ``bounded``: an in-flight peak above M_max is an OOM; ``budgeted``: forwards get
    Algorithm 1's budget (and, in warmup, its absorption limit); ``native``: the execution its real system has
    (:mod:`.execution`), which ``overlap`` may turn off."""

    name = ""
    bounded = True
    budgeted = False
    native = "megatron"

    def __init__(self, ctx: StageContext, *, overlap: str = "real"):
        self.ctx = ctx
        parallel = ctx.parallel
        self.execution = execution_of(self.native, check_overlap(overlap),
                                      virtual_stages=parallel.vp > 1 or parallel.pp == 1)
        self.share = interference_of(overlap)
        self._runs: dict[tuple, tuple[Plan, Choice]] = {}  # (chunk, imbalance, id(plan)) -> (plan, its Choice)

    def run(self, chunk: int, imbalance: float, plan: Plan) -> Choice:
        """``plan`` on ``chunk`` at ``imbalance`` under this policy's execution (remembered per plan object: the
        plans a policy runs are few and reused, and hashing a long plan at every forward costs more)."""
        key = (chunk, imbalance, id(plan))
        found = self._runs.get(key)
        if found is not None and found[0] is plan:
            return found[1]
        choice = self.ctx.choice(chunk, imbalance, plan, execution=self.execution, share=self.share)
        self._runs[key] = (plan, choice)
        return choice

    def forward(self, chunk: int, imbalance: float, phase: str, budget: int = 0, limit: int | None = None
                ) -> Choice:
        raise NotImplementedError

    def alternatives(self) -> tuple["StagePolicy", ...]:
        """The ways this policy may run a stage's iteration (the oracle's two): the simulator takes each stage's
        fastest, or one way on every stage, whichever iteration is the shortest."""
        return (self,)

    def state(self) -> tuple:
        """What the simulator's memo keys an iteration by besides its rates: nothing for a fixed plan; for a
        decision path whether it has measured a gate (a path's first iteration plans for the expected load, the
        later ones for what the gates measured; among those, the first result per rate vector stands for the
        others, whose first gates start from another iteration's measurements)."""
        return ()


class Static(StagePolicy):
    """One plan per chunk, made before training at r=1; ``plan(chunk)`` says which."""

    def __init__(self, ctx: StageContext, *, plan_imbalance: float = 1.0, overlap: str = "real"):
        super().__init__(ctx, overlap=overlap)
        self.plan_imbalance = plan_imbalance
        self.plans = tuple(self.plan(chunk) for chunk in range(ctx.parallel.vp))

    def design_graph(self, chunk: int) -> OpGraph:
        """The graph the plan is made on: at ``plan_imbalance`` (default 1, balanced load)."""
        return self.ctx.graph(chunk, self.plan_imbalance)

    def plan(self, chunk: int) -> Plan:
        raise NotImplementedError

    def forward(self, chunk, imbalance, phase, budget=0, limit=None):
        return self.run(chunk, imbalance, self.plans[chunk])


class StaticUnder(Static):
    name = "static-under"

    def plan(self, chunk):
        return greedy.solve(self.design_graph(chunk), self.ctx.per_chunk_bytes).plan  # infeasible: the floor


class StaticOver(Static):
    name = "static-over"

    def plan(self, chunk):
        return full_recompute(self.design_graph(chunk))


def full_recompute(graph: OpGraph) -> Plan:
    """Full-layer recompute (Megatron's ``--recompute-granularity full``): RECOMPUTE of every saving but the block
    inputs the recomputation restarts from. Where that cannot run (an op nothing can re-run) or keeps more than the
    floor, the greedy plan down to the floor."""
    pinned = graph.pinned
    plan = Plan(tuple((f"{op.name}/{saving.tensor}", Strategy.RECOMPUTE) for op, saving in graph.savings
                      if (op.name, saving.tensor) not in pinned))
    cost = evaluate(graph, plan)
    if cost.unavailable or cost.activation_bytes > graph.floor_bytes:
        return greedy.solve(graph, graph.floor_bytes).plan
    return plan


class Ideal(Static):
    name = "ideal"
    bounded = False
    native = "fused"

    def plan(self, chunk):
        return NO_PLAN


class KwaiKey(NamedTuple):
    """What Megatron-Kwai's search for one chunk depends on."""

    chunk: int
    imbalance: float
    target_bytes: int
    plan_hardware: Hardware
    execution: str
    share: float


class Kwai(Static):
    """Megatron-Kwai's configuration search: the faster of its checkpointing levels that fits. Its ATC'24
    artifact's tuned runs pick a checkpointing level, "no" or "ours" (its compute-memory balanced checkpointing),
    and an offloaded share alpha from 0 to 1 per run, so a chunk that fits unmitigated runs nothing. Here: per level
    (none; ``KWAI_BASE``) the smallest alpha in 0, 1/KWAI_STEPS, ..., 1 that fits the target at ``plan_imbalance``
    (OFFLOAD of the first ``ceil(alpha * n)`` of the n tensors the level keeps); of the levels that fit, the one
    with the shorter forward + backward under the policy's execution (a tie: no checkpointing); if neither fits,
    ``KWAI_BASE`` with alpha = 1. ``levels[chunk]`` and ``alphas[chunk]`` say what was chosen."""

    name = "kwai"

    def __init__(self, ctx: StageContext, **options):
        self.alphas: dict[int, float] = {}  # chunk -> the offloaded fraction chosen
        self.levels: dict[int, str] = {}  # chunk -> "none" or "balanced" (the checkpointing chosen)
        super().__init__(ctx, **options)

    @staticmethod
    def configurations(graph: OpGraph):
        """``(level, alpha, plan)`` of every configuration the search considers: per level, alpha ascending."""
        for level, base in (("none", NO_PLAN), ("balanced", KWAI_BASE)):
            kept = prefix.kept_tensors(graph, base)
            for step in range(KWAI_STEPS + 1):
                count = math.ceil(step * len(kept) / KWAI_STEPS)
                yield level, step / KWAI_STEPS, prefix.prefix_plan(graph, base, count, kept)

    def plan(self, chunk):
        graph = self.design_graph(chunk)
        key = KwaiKey(chunk, graph.imbalance, self.ctx.per_chunk_bytes, self.ctx.plan_hardware, self.execution,
                      self.share)
        memo = self.ctx.timing.memo.table(KwaiKey)  # the search is a pure function of the key: a restart re-uses it
        found = memo.get(key)
        if found is None:
            found = memo[key] = self.search(chunk, graph)
        self.levels[chunk], self.alphas[chunk], plan = found
        return plan

    def search(self, chunk: int, graph: OpGraph) -> tuple[str, float, Plan]:
        """``(level, alpha, plan)`` of ``chunk``: per level the smallest alpha that fits, then the faster level."""
        fitting: dict[str, tuple[str, float, Plan]] = {}
        for level, alpha, plan in self.configurations(graph):
            if level not in fitting and (self.ctx.cost(chunk, graph.imbalance, plan).activation_bytes
                                         <= self.ctx.per_chunk_bytes):
                fitting[level] = (level, alpha, plan)
        if not fitting:
            return level, alpha, plan  # the last configuration: balanced, everything else offloaded

        def seconds(level: str) -> float:
            choice = self.run(chunk, graph.imbalance, fitting[level][2])
            return choice.forward_s + choice.backward_s

        return fitting[min(fitting, key=seconds)]  # min keeps the first of equals: no checkpointing


class AdaPipe(Static):
    """AdaPipe's adaptive recomputation, RECOMPUTE only: repeatedly recompute the kept tensor with the most bytes
    freed per added recompute-ns until the chunk fits (:func:`adapipe_plan`)."""

    name = "adapipe"

    def plan(self, chunk):
        return adapipe_plan(self.design_graph(chunk), self.ctx.per_chunk_bytes)


def adapipe_plan(graph: OpGraph, target_bytes: int) -> Plan:
    """The greedy of ``adapipe``: RECOMPUTE (every saving of) the kept tensor with the most bytes freed per added
    recompute-ns (``evaluate``; the first of equals in graph order) until ``activation_bytes <= target_bytes``;
    full recompute if nothing left frees bytes.

    A tensor's score changes only when a tensor of one of its layers is chosen: in the graphs of ``build_graph``
    a layer's re-runs stop at its block input, which every plan keeps, so bytes and recompute time add up over
    layers (a graph with other cross-layer edges is outside this argument). Only those candidates are
    evaluated again after each choice (the same plan as scoring every candidate at every step, in a fraction of
    the ``evaluate`` calls)."""
    plan, cost = NO_PLAN, evaluate(graph, NO_PLAN)
    left = prefix.tensor_savings(graph)
    layers = {tensor: _layers_of(graph, tensor, keys) for tensor, keys in left.items()}
    scores: dict[str, float | None] = {}  # None: recomputing it frees nothing (or cannot run)

    def recomputed(tensor: str) -> Plan:
        return Plan(plan.entries + tuple((key, Strategy.RECOMPUTE) for key in left[tensor]))

    while cost.activation_bytes > target_bytes:
        best = None
        for tensor in left:
            if tensor not in scores:
                found = evaluate(graph, recomputed(tensor))
                freed = cost.activation_bytes - found.activation_bytes
                scores[tensor] = (None if found.unavailable or freed <= 0
                                  else freed / max(found.recompute_ns - cost.recompute_ns, 1))
            score = scores[tensor]
            if score is not None and (best is None or score > best[0]):
                best = (score, tensor)
        if best is None:  # nothing left frees bytes: full recompute
            return full_recompute(graph)
        chosen = best[1]
        plan = recomputed(chosen)
        cost = evaluate(graph, plan)
        del left[chosen], scores[chosen]
        for tensor in left:  # only the chosen tensor's layers changed
            if layers[tensor] & layers[chosen]:
                scores.pop(tensor, None)
    return plan


def _layers_of(graph: OpGraph, tensor: str, keys: list[str]) -> frozenset[int]:
    """The layers of ``tensor``'s producer and of the ops that save it."""
    spec = graph.tensors[tensor]
    layers = {graph.op(key.split("/", 1)[0]).layer for key in keys}
    if spec.producer is not None:
        layers.add(graph.op(spec.producer).layer)
    return frozenset(layers)


class LayerLevel(Static):
    """L1: full recompute of the first k layers of the chunk, k the fewest that fit the target at r=1."""

    name = "L1"

    def plan(self, chunk):
        graph = self.design_graph(chunk)
        by_layer: dict[int, list[str]] = {}
        pinned = graph.pinned
        for op, saving in graph.savings:
            if (op.name, saving.tensor) not in pinned:
                by_layer.setdefault(op.layer, []).append(f"{op.name}/{saving.tensor}")
        entries: tuple = ()
        plan = NO_PLAN
        for layer in sorted(by_layer):
            if self.ctx.cost(chunk, graph.imbalance, plan).activation_bytes <= self.ctx.per_chunk_bytes:
                break
            entries += tuple((key, Strategy.RECOMPUTE) for key in by_layer[layer])
            plan = Plan(entries)
        return plan


class FineStatic(StaticUnder):
    """L2: the greedy per-operator plan, fixed before training (static-under's plan)."""

    name = "L2"


class Flexible(StagePolicy):
    """The decision path (``ctx.path``); its pre-gate plans are made for at least ``plan_imbalance``, the load the
    fixed plans are made for (``DecisionPath.expect(..., at_least=True)``: the gates may raise it, never lower it)."""

    name = "flexible"
    budgeted = True
    native = "fused"
    hidden_copies: bool | None = None  # the path's pricing of copies: the simulation's (None), or this

    def __init__(self, ctx, *, plan_imbalance: float = 1.0, overlap: str = "real"):
        super().__init__(ctx, overlap=overlap)
        self.path = ctx.path if self.hidden_copies is None else ctx.path_with(hidden_copies=self.hidden_copies)
        self.path.expect(plan_imbalance, at_least=True)

    def forward(self, chunk, imbalance, phase, budget=0, limit=None):
        decision = self.path.forward(budget, imbalance, phase, chunk, limit_bytes=limit)
        return self.run(chunk, imbalance, decision.plan)._replace(kept_bytes=decision.kept_bytes)

    def state(self) -> tuple:
        return (self.path.warm,)


class Unfused(Flexible):
    """L3: flexible's per-micro-batch decisions on Megatron-Core's execution, without the dual-batch overlap;
    copies priced in full (Algorithm 2's pricing: what the fused order would hide is not its own to count on)."""

    name = "L3"
    native = "megatron"
    hidden_copies = False


class FlexibleL4(Flexible):
    name = "L4"


class OracleExact(StagePolicy):
    """Greedy on the graph at the micro-batch's true imbalance for the budget (no deferred decision)."""

    name = "oracle"
    budgeted = True
    native = "fused"

    def __init__(self, ctx, *, overlap: str = "real"):
        super().__init__(ctx, overlap=overlap)
        self._plans: dict[tuple, Plan] = {}

    def forward(self, chunk, imbalance, phase, budget=0, limit=None):
        graph = self.ctx.graph(chunk, imbalance)
        if budget >= graph.unmitigated_bytes:
            plan = NO_PLAN
        else:
            key = (chunk, imbalance, budget)
            plan = self._plans.get(key)
            if plan is None:
                plan = self._plans[key] = greedy.solve(graph, budget).plan  # below M0: the floor plan
        return self.run(chunk, imbalance, plan)


class Oracle(OracleExact):
    """Knows every micro-batch's imbalance before planning, and so also what flexible would run: per iteration the
    exact plans (:class:`OracleExact`) or flexible's decisions (``alternatives``), each stage the faster of the two
    or one of them on every stage, whichever iteration is the shortest."""

    def __init__(self, ctx, *, plan_imbalance: float = 1.0, overlap: str = "real"):
        super().__init__(ctx, overlap=overlap)
        self.flexible = Flexible(ctx, plan_imbalance=plan_imbalance, overlap=overlap)

    def alternatives(self) -> tuple[StagePolicy, ...]:
        return (self, self.flexible)

    def state(self) -> tuple:
        return self.flexible.state()


CLASSES = {cls.name: cls for cls in (Flexible, StaticUnder, StaticOver, Kwai, AdaPipe, Ideal, Oracle, LayerLevel,
                                     FineStatic, Unfused, FlexibleL4)}


def native_execution(name: str) -> str:
    """The execution policy ``name``'s real system has (:mod:`.execution`): ``fused`` or ``megatron``."""
    return CLASSES[check_policy(name)].native


def make_policy(name: str, ctx: StageContext, *, plan_imbalance: float = 1.0, overlap: str = "real"
                ) -> StagePolicy:
    """Policy ``name`` (one of ``POLICIES`` or ``ABLATION``) on the stage of ``ctx``; the plans fixed before
    training (static-*, kwai, adapipe, L1, L2) are made at ``plan_imbalance`` (default 1: balanced load), and the
    decision paths (flexible, L3, L4, oracle's) make their pre-gate plans for it until their first gate;
    ``overlap``: the execution model (:data:`.execution.OVERLAP`)."""
    cls = CLASSES[check_policy(name)]
    if issubclass(cls, (Static, Flexible, Oracle)):
        return cls(ctx, plan_imbalance=plan_imbalance, overlap=overlap)
    return cls(ctx, overlap=overlap)
