"""The stage engine: what every decision about one pipeline stage is made over.

A :class:`Stage` owns

* the stage's **memory** (``StageMemory``: ``M_max``, ``M0``, the in-flight count) and its **steps**: the
  (interleaved) 1F1B schedule's forwards and backwards in order, each a :class:`Step`;
* its **graphs** per (chunk, imbalance): built when first asked for and shared by every user of the stage (the
  graph of an imbalance reuses the balanced graph's decisions for tensors that do not scale with it); the
  balanced graphs are kept, the others up to ``max_graphs``, least recently used dropped first (a trace of
  continuous rates would otherwise keep one graph per rate seen);
* the **chunk aliases**: virtual chunks whose graphs are the same up to layer numbering decide alike, so they share
  one canonical chunk's results and only the names in their plans move (a plan is ranked by the steps all of them
  run, ``step_counts``);
* **one bounded memo** (:class:`Memo`) of pure results under typed keys: plan costs (``costmodel.evaluate``, the
  one evaluator), fused orders (``fusion.dp``) and the intermediate results of the decision functions built on the
  stage (``DecisionPath``, ``PointOrders``, ``exec.DeferredPlanner``, the simulator's policies).

``cache=False`` turns the memo off: every lookup misses and nothing is stored, so every result is computed again
(slower, and the same: a test compares every decision both ways). The graphs are the stage's, not the memo's.
:func:`~.iteration.run_iteration` is the one loop over a stage's steps.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Hashable, NamedTuple

from ..budget import BudgetPhase
from ..costmodel import (Hardware, ModelConfig, OpGraph, ParallelConfig, Plan, PlanCost, StageMemory, build_graph,
                         evaluate, imbalance_limit, point_relation, points, schedule, stage_memory)
from ..costmodel.config import check_compatible, check_hardware
from ..costmodel.rescale import at_imbalance
from ..costmodel.validate import require_int
from ..fusion import Chains, Order, build_chains, dp
from ..fusion.baselines import sequential
from ..fusion.chains import check_chains
from ..mitigation.space import share_decisions
from .keys import chunk_aliases

MAX_ENTRIES = 4096  # default bound of each key kind in the memo
MAX_GRAPHS = 256  # default bound of an engine's graphs at imbalances other than 1 (~150 KB each at paper scale)


class Step(NamedTuple):
    """One step of a stage's schedule: a chunk-forward (``forward``) or a chunk-backward of ``microbatch``.
    ``index`` numbers the chunk-forwards in schedule order (the budget's slot; a backward carries its forward's);
    ``phase`` is a forward's budget phase (``"warmup"`` for the first in-flight-count forwards, else
    ``"steady"``; ``""`` for a backward)."""

    forward: bool
    index: int
    microbatch: int
    chunk: int
    phase: str


class CostKey(NamedTuple):
    """``evaluate`` of a plan on the graph of (chunk, imbalance)."""

    entries: tuple
    imbalance: float
    chunk: int


class OrderKey(NamedTuple):
    """A fused order: what the DP reads of the four chains, each chain's (resource, duration) stages, and the
    compute slowdown beside communication it orders for."""

    stages: tuple
    share: float = 0.0


class PointKey(NamedTuple):
    """The order of a scheduling point whose micro-batches all run one plan on one graph (``warmup``: F and O
    only; ``cooldown``: B and R only)."""

    entries: tuple
    imbalance: float
    chunk: int
    warmup: bool
    cooldown: bool = False


class Memo:
    """One bounded memo of pure results, a table per key type. ``table(KeyType)`` is a dict the caller looks up
    and stores into directly (the hot path); each table holds at most ``max_entries`` entries and is emptied when
    full. ``enabled=False``: every table forgets what it is given (lookups miss, stores are dropped)."""

    def __init__(self, *, enabled: bool = True, max_entries: int = MAX_ENTRIES):
        self.enabled = bool(enabled)
        self.max_entries = require_int("max_entries", max_entries, 1)
        self._tables: dict[type, dict] = {}

    def table(self, kind: type) -> dict:
        found = self._tables.get(kind)
        if found is None:
            found = self._tables[kind] = _Bounded(self.max_entries) if self.enabled else _Forgetful()
        return found

    def sizes(self) -> dict[str, int]:
        """Entries held per key type."""
        return {kind.__name__: len(table) for kind, table in self._tables.items()}


class _Bounded(dict):
    __slots__ = ("limit",)

    def __init__(self, limit: int):
        super().__init__()
        self.limit = limit

    def __setitem__(self, key: Hashable, value) -> None:
        if len(self) >= self.limit and key not in self:
            self.clear()
        dict.__setitem__(self, key, value)


class _Graphs:
    """An engine's graphs by (chunk, imbalance): those at imbalance 1 always kept, the others at most ``limit``,
    the least recently used dropped first. A graph is a pure function of its key, so a dropped one is built again
    (equal) when next asked for. The bound is this table's: a memo entry that holds a graph (a point's chains) keeps
    it until the memo drops the entry, and one keyed by a graph's id checks that it is the same graph."""

    __slots__ = ("limit", "_balanced", "_recent")

    def __init__(self, limit: int):
        self.limit = require_int("max_graphs", limit, 1)
        self._balanced: dict[tuple[int, float], OpGraph] = {}
        self._recent: OrderedDict[tuple[int, float], OpGraph] = OrderedDict()

    def get(self, key: tuple[int, float]) -> OpGraph | None:
        found = self._balanced.get(key)
        if found is None:
            found = self._recent.get(key)
            if found is not None:
                self._recent.move_to_end(key)
        return found

    def put(self, key: tuple[int, float], graph: OpGraph) -> None:
        if key[1] == 1.0:
            self._balanced[key] = graph
            return
        self._recent[key] = graph
        if len(self._recent) > self.limit:
            self._recent.popitem(last=False)

    def __len__(self) -> int:
        return len(self._balanced) + len(self._recent)


class _Forgetful(dict):
    __slots__ = ()

    def get(self, key, default=None):
        return default

    def __setitem__(self, key, value) -> None:
        pass

    def setdefault(self, key, default=None):
        return default


class _Engine:
    """What every engine has: one memo, graphs per (chunk, imbalance) and the costs of plans on them."""

    memo: Memo
    _costs: dict
    max_imbalance: float | None = None  # the largest imbalance its graphs take (None: no bound)

    @property
    def cache(self) -> bool:
        return self.memo.enabled

    def graph(self, chunk: int, imbalance: float) -> OpGraph:
        raise NotImplementedError

    def cost(self, plan: Plan | str | None, imbalance: float, chunk: int) -> PlanCost:
        """``evaluate(graph(chunk, imbalance), plan)``, memoised (``plan`` as ``evaluate`` takes it: its text form
        or None too)."""
        if not isinstance(plan, Plan):
            plan = Plan.coerce(plan) or Plan()
        key = CostKey(plan.entries, imbalance, chunk)
        found = self._costs.get(key)
        if found is None:
            found = self._costs[key] = evaluate(self.graph(chunk, imbalance), plan)
        return found

    def remember_cost(self, plan: Plan, imbalance: float, chunk: int, cost: PlanCost) -> None:
        """Store a cost a solver already got from ``evaluate`` for this plan on this graph (never recomputed)."""
        key = CostKey(plan.entries, imbalance, chunk)
        if key not in self._costs:
            self._costs[key] = cost


class TracedStage(_Engine):
    """The engine of a stage known by one graph traced from the running model (``bagualu2.exec``), not by a
    model configuration: one chunk (0), whose graph at an imbalance is the traced graph with its routed tensors
    resized (``costmodel.rescale.at_imbalance``); costs and decisions memoised as :class:`Stage` does. It has no
    schedule: what it serves is the decision after the gate (``exec.DeferredPlanner.for_graph``)."""

    def __init__(self, graph: OpGraph, *, cache: bool = True, max_entries: int = MAX_ENTRIES,
                 max_graphs: int = MAX_GRAPHS):
        if not isinstance(graph, OpGraph):
            raise ValueError(f"graph must be an OpGraph (a traced graph), got {type(graph).__name__}")
        if not graph.mean_routed_tokens:
            raise ValueError(f"graph {graph.label!r} has no routed token counts: trace a model whose routers report "
                             "to the gate (exec.instrument(..., gate=...), integrations.hf.instrument), each MoE "
                             "layer's router once, every layer sending the same number of copies")
        self.traced, self.hardware = graph, graph.hardware
        self.memo = Memo(enabled=cache, max_entries=max_entries)
        self._graphs = _Graphs(max_graphs)
        self._costs = self.memo.table(CostKey)
        self.graph(0, 1.0)  # a graph that cannot be rescaled (a layer that received nothing) is refused here

    def graph(self, chunk: int, imbalance: float) -> OpGraph:
        """The traced graph with every MoE layer at ``imbalance`` (built when first asked for; again if dropped)."""
        self.check_chunk(chunk)
        found = self._graphs.get((0, imbalance))
        if found is None:
            found = at_imbalance(self.traced, imbalance)
            self._graphs.put((0, imbalance), found)
        return found

    def check_chunk(self, chunk) -> tuple[int, int]:
        """``(0, 0)``: a traced graph is one chunk; one-line ``ValueError`` for any other."""
        if chunk != 0 or isinstance(chunk, bool):
            raise ValueError(f"chunk must be 0 (a traced graph is one chunk), got {chunk!r}")
        return 0, 0

    def __repr__(self) -> str:
        return f"TracedStage({self.traced.label!r}, cache={self.cache})"


class Stage(_Engine):
    """The engine of pipeline stage ``stage`` of a model on a hardware profile (module docstring).

      cache         the memo on (default) or off (every result recomputed; for checks).
      max_entries   the most entries of one key type the memo holds.
      max_graphs    the most graphs at imbalances other than 1 the engine keeps (least recently used dropped).
      m_max_bytes   the stage's activation capacity when a cap sets it (a trainer's ``--memory-cap``) instead of
                    what the profile's memory leaves (default); the decision paths over the engine anchor their
                    budget grid at it.
    """

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, *, stage: int = 0,
                 cache: bool = True, max_entries: int = MAX_ENTRIES, max_graphs: int = MAX_GRAPHS,
                 m_max_bytes: int | None = None):
        check_compatible(model, parallel)
        check_hardware(hardware)
        self.model, self.parallel, self.hardware = model, parallel, hardware
        self.max_imbalance = imbalance_limit(model, parallel)  # the most routed load one expert-parallel rank gets
        self.stage = require_int("stage", stage, 0, parallel.pp)
        if not isinstance(cache, bool):
            raise ValueError(f"cache must be True or False, got {cache!r}")
        self.memo = Memo(enabled=cache, max_entries=max_entries)
        self._graphs = _Graphs(max_graphs)
        self.memory: StageMemory = stage_memory(model, parallel, hardware, stage=self.stage)
        if m_max_bytes is not None:
            self.memory = dataclasses.replace(self.memory, m_max_bytes=require_int("m_max_bytes", m_max_bytes, 1))
        self.steps: tuple[Step, ...] = self._steps()
        self.point_relation = point_relation(parallel, stage)  # the fusion DP's pipeline_degree at this stage
        # every forward and backward runs alone: no pipeline and no pairing, or no steady pair F_x B_y at all
        grouped = points(parallel, stage)
        self.alone = (parallel.pp == 1 and not parallel.paired) or not any(len(point) == 2 for point in grouped)
        self.aliases: dict[int, tuple[int, int]] = chunk_aliases({c: self.graph(c, 1.0) for c in range(parallel.vp)})
        # per chunk, how the forwards and backwards of it and of the chunks that decide alike run: (steady points
        # they lead, forwards alone, backwards alone), summed over the chunks that share its decisions, and how
        # many chunks those are
        self.step_counts: dict[int, tuple[int, int, int, int]] = _step_counts(grouped, parallel.vp, self.alone,
                                                                              self.aliases)
        self._costs = self.memo.table(CostKey)
        self._orders = self.memo.table(OrderKey)
        self._points = self.memo.table(PointKey)
        # the ids of the pre-gate plans decision paths made on this engine: one numbering for every path over it,
        # so the memo entries keyed by an id mean one plan whichever path stored them (never cleared)
        self.plan_ids: dict[tuple, int] = {(): 0}
        # the grid options of the decision paths over this engine: its memo is keyed by what they decide on those
        # grids, so every path over it must use the same (set by the first path)
        self.path_grid: tuple | None = None

    @property
    def num_forwards(self) -> int:
        """Chunk-forwards per iteration (micro-batches x virtual chunks)."""
        return len(self.steps) // 2

    def _steps(self) -> tuple[Step, ...]:
        index: dict[tuple[int, int], int] = {}
        steps = []
        for action in schedule(self.parallel, self.stage):
            key = (action.microbatch, action.chunk)
            phase = ""
            if action.kind == "F":
                phase = (BudgetPhase.WARMUP if len(index) < self.memory.inflight_chunks else BudgetPhase.STEADY).value
                index[key] = len(index)
            steps.append(Step(action.kind == "F", index[key], action.microbatch, action.chunk, phase))
        return tuple(steps)

    def graph(self, chunk: int, imbalance: float) -> OpGraph:
        """The graph of ``chunk`` at ``imbalance`` (built when first asked for; again if it was dropped)."""
        key = (chunk, imbalance)
        found = self._graphs.get(key)
        if found is None:
            found = build_graph(self.model, self.parallel, self.hardware, imbalance=imbalance, stage=self.stage,
                                chunk=chunk)
            balanced = self._graphs.get((chunk, 1.0))
            if balanced is not None:  # the decisions of tensors that do not scale with the imbalance, reused
                share_decisions(found, balanced)
            self._graphs.put(key, found)
        return found

    def order(self, chains: Chains, *, share: float = 0.0) -> Order:
        """The fused order of ``chains``: the DP's (``fusion.dp`` at the stage's ``point_relation``: 2, of F and
        B with O and R at the point's edges; 1, as at pp = 1 ``paired``, of F and B with their own copies beside
        them), or where no forward shares a point with a backward (``alone``: without a pipeline or pairing, or
        with too few micro-batches for a steady pair), F's then B's, each with its own copies beside it
        (:meth:`_unpaired`); memoised by what the DP reads, each chain's stage resources
        and durations, so points that differ elsewhere share one order. ``share``: the compute slowdown beside
        communication the DP orders for (``fusion.interference``; 0, the DP's own cost, is what the decision
        path uses)."""
        check_chains(chains)
        key = OrderKey(tuple(None if chain is None else tuple((s.resource, s.duration_ns) for s in chain.stages)
                             for chain in (chains.forward, chains.backward, chains.offload, chains.recovery)),
                       share)
        found = self._orders.get(key)
        if found is None:
            found = self._orders[key] = (
                self._unpaired(chains, share) if self.alone
                else dp.solve(chains, pipeline_degree=self.point_relation, share=share))
        return found

    @staticmethod
    def _unpaired(chains: Chains, share: float) -> Order:
        """pp = 1 without pairing: the forward with its offloads beside it (each once the forward made what it
        copies), then the backward with its reloads ahead of the stages that read them (``dp.with_own_copies``),
        as copy streams run them; a point of both (how the decision path ranks plans) is the two in turn."""
        parts = [dp.solve(part, pipeline_degree=1, share=share)
                 for part in (Chains(chains.forward, None, chains.offload, None),
                              Chains(None, chains.backward, None, chains.recovery))
                 if any(chain is not None for chain in part.present())]
        if len(parts) == 1:
            return parts[0]
        if not parts:
            return sequential(chains)
        return Order(parts[0].groups + parts[1].groups, barriers=True,
                     makespan_ns=parts[0].makespan_ns + parts[1].makespan_ns, solver="unpaired")

    def point_order(self, plan: Plan | str | None, imbalance: float, chunk: int, *, warmup: bool = False,
                    cooldown: bool = False) -> Order:
        """The order of a scheduling point whose micro-batches run ``plan`` (a Plan, its text form or None) on the
        graph of (chunk, imbalance): in the steady phase F_x B_y (O and R from the same plan); in warmup F_x with
        the offload of x-1 only; in cooldown B_y with the recovery of y+1 only."""
        if not isinstance(plan, Plan):
            plan = Plan.coerce(plan) or Plan()
        if warmup and cooldown:
            raise ValueError("a scheduling point is a warmup one, a cooldown one or neither, not both")
        key = PointKey(plan.entries, imbalance, chunk, warmup, cooldown)
        found = self._points.get(key)
        if found is None:
            graph = self.graph(chunk, imbalance)
            chains = (build_chains(graph, plan, None, None, hardware=self.hardware) if warmup
                      else build_chains(None, None, graph, plan, hardware=self.hardware) if cooldown
                      else build_chains(graph, plan, graph, plan, hardware=self.hardware))
            found = self._points[key] = self.order(chains)
        return found

    def step_ns(self, plan: Plan | str | None, imbalance: float, chunk: int) -> int:
        """What ``plan`` on the graph of (chunk, imbalance) takes per micro-batch of the chunk in this stage's
        schedule: its steady points F_x B_y, its forwards that run alone (warmup; every forward where none pairs)
        and its backwards that run alone (cooldown), each in its own order, averaged over the micro-batches of
        the chunk and of the chunks that share its decisions (``step_counts``). Copies a steady point hides may be
        exposed where a step runs alone; a plan ranked by its steady point alone may then be slower than one that
        copies less."""
        self.check_chunk(chunk)
        pairs, forwards, backwards, chunks = self.step_counts[chunk]
        total = pairs * self.point_order(plan, imbalance, chunk).makespan_ns if pairs else 0
        if forwards:
            total += forwards * self.point_order(plan, imbalance, chunk, warmup=True).makespan_ns
        if backwards:
            total += backwards * self.point_order(plan, imbalance, chunk, cooldown=True).makespan_ns
        return total // (self.parallel.num_microbatches * chunks)

    def check_chunk(self, chunk) -> tuple[int, int]:
        """``(canonical chunk, layer offset)`` of ``chunk``; one-line ``ValueError`` for a chunk not of the stage."""
        try:
            alias = None if isinstance(chunk, bool) else self.aliases.get(chunk)
        except TypeError:  # unhashable
            alias = None
        if alias is None:
            raise ValueError(f"chunk must be an integer in [0, vp={self.parallel.vp}), got {chunk!r}")
        return alias

    def __repr__(self) -> str:
        return (f"Stage(stage={self.stage}, pp={self.parallel.pp}, vp={self.parallel.vp}, "
                f"steps={len(self.steps)}, cache={self.cache})")


def _step_counts(grouped, num_chunks: int, alone: bool,
                 aliases: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int, int, int]]:
    """Per chunk of a stage whose schedule is ``grouped`` (``costmodel.points``): the steady points F_x B_y whose
    forward is of that chunk, its forwards that run alone and its backwards that run alone (with ``alone``, every
    step runs alone), each summed over the chunks of its alias group, and the group's size (one decision serves
    them all: it is ranked by the steps of all of them)."""
    counts = {chunk: [0, 0, 0] for chunk in range(num_chunks)}
    for point in grouped:
        if len(point) == 2 and not alone:
            counts[point[0].chunk][0] += 1
        else:
            for action in point:
                counts[action.chunk][1 if action.kind == "F" else 2] += 1
    groups: dict[int, list[int]] = {}
    for chunk, (canonical, _) in aliases.items():
        groups.setdefault(canonical, []).append(chunk)
    return {chunk: (*(sum(counts[c][i] for c in groups[aliases[chunk][0]]) for i in range(3)),
                    len(groups[aliases[chunk][0]]))
            for chunk in range(num_chunks)}
