"""The runtime decision path of one pipeline stage (paper §V-A, §V-B "Runtime Solving"), memoised.

Per chunk-forward, ``DecisionPath.forward(budget, imbalance, phase, chunk)``:

1. **pre-gate plan** — what the micro-batch runs before its gate is known. A budget that covers the unmitigated
   bytes at balanced load (r = 1) commits nothing: the gate can always make room after the router (the full
   downgrade keeps only the part before it). A tighter budget is planned by greedy on the graph at the *planned*
   imbalance, the smallest imbalance the last ``window`` gates of this chunk measured (a low estimate: mitigation
   committed before the gate cannot be undone, the part after the router can still grow).
2. **gate** — the measured imbalance: a budget covering the unmitigated bytes at it runs the empty plan; in
   warmup an overrun within ``limit_bytes`` is absorbed; otherwise :func:`~.gate.after_gate` keeps, re-plans the
   part after the router, or downgrades it (``downgrade="paper"``: keep or full downgrade only).
3. **order** — the fused dual-batch order of the plan (``fusion.dp``).

Caches (a hit is safe for every request of its key): rows by (measured imbalance, chunk) -> the ceiling bucket
of the imbalance with its graph; pre-gate plans by (budget level, planned bucket, chunk); gate decisions by
(pre-gate plan, budget level, imbalance bucket, chunk); orders by what the DP reads. A budget level floors the
budget to ``budget_quantum_bytes`` (default 1/1024 of the stage's unmitigated bytes at balanced load), imbalance
buckets ceil to ``imbalance_step`` — so every cached plan was decided for a budget no larger and an imbalance no
smaller than the request's. Kept bytes are reported exactly at the measured imbalance (routed tensors scale with
the routed token count; ``PlanCost.activation_bytes_at``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..budget import BudgetPhase
from ..costmodel import (Hardware, ModelConfig, OpGraph, ParallelConfig, Plan, PlanCost, StageMemory, build_graph,
                         evaluate, schedule, stage_memory)
from ..costmodel.build import check_imbalance
from ..costmodel.validate import require_int, require_number
from ..fusion import Order, build_chains, dp
from ..mitigation import greedy
from .buckets import ceil_bucket, floor_bucket
from .gate import GateAction, after_gate, check_downgrade

MAX_ROWS = 4096  # measured imbalance values whose bucket is remembered
NO_PLAN = Plan()
WARMUP = BudgetPhase.WARMUP.value


@dataclass(frozen=True)
class Decision:
    """What the runtime runs for one chunk-forward. ``kept_bytes`` is exact at the measured imbalance;
    ``overhead_s`` is the plan's on the imbalance bucket's graph (an upper bound)."""

    plan: Plan
    kept_bytes: int
    overhead_s: float
    downgraded: bool  # the gate changed the plan (re-plan or full downgrade)
    order: Order
    action: GateAction = GateAction.KEEP


@dataclass(frozen=True)
class _Row:
    bucket: float
    graph: OpGraph
    empty: PlanCost  # the unmitigated cost on the bucket's graph


@dataclass(frozen=True)
class _Outcome:
    plan: Plan
    cost: PlanCost
    graph: OpGraph
    action: GateAction
    order: Order


class DecisionPath:
    """Decisions of one stage, memoised. ``forward(budget, imbalance, phase, chunk)`` is the hot path.

      stage                 pipeline stage.
      downgrade             ``"graded"`` (default) or ``"paper"`` (keep or full MoE-module downgrade, no absorption).
      planned_imbalance     None (default): follow the gates (min of the last ``window``); a number: constant.
      window                gates remembered per chunk for the planned imbalance (>= 1).
      budget_quantum_bytes  budget level width; None: 1/1024 of the stage's unmitigated bytes at r = 1.
      imbalance_step        imbalance bucket width (> 0).
    """

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, *, stage: int = 0,
                 downgrade: str = "graded", planned_imbalance: float | None = None, window: int = 16,
                 budget_quantum_bytes: int | None = None, imbalance_step: float = 0.02):
        self.model, self.parallel, self.hardware = model, parallel, hardware
        self.stage = require_int("stage", stage, 0, parallel.pp)
        self.downgrade = check_downgrade(downgrade)
        self.planned_imbalance = None if planned_imbalance is None else check_imbalance(planned_imbalance)
        self.window = require_int("window", window, 1)
        self.step = require_number("imbalance_step", imbalance_step, 0, 10, low_open=True)
        self._graphs: dict[tuple[int, float], OpGraph] = {}
        if budget_quantum_bytes is None:
            budget_quantum_bytes = max(min(self.graph(c, 1.0).unmitigated_bytes for c in range(parallel.vp)) >> 10, 1)
        self.quantum = require_int("budget_quantum_bytes", budget_quantum_bytes, 1)
        self._seen: dict[int, deque] = {}      # chunk -> the last `window` measured imbalances
        self._planned: dict[int, float] = {}   # chunk -> planned bucket (floored min of the window)
        self._rows: dict[tuple[float, int], _Row] = {}
        self._balanced: dict[int, int] = {}    # chunk -> unmitigated bytes at r = 1
        self._buckets: dict[tuple[float, int], _Row] = {}
        self._costs: dict[tuple, PlanCost] = {}
        self._pregate: dict[tuple, Plan] = {}
        self._outcomes: dict[tuple, _Outcome] = {}
        self._orders: dict[tuple, Order] = {}
        self._solved: dict[tuple, Order] = {}
        self._stage_plan: tuple | None = None
        self.hits = self.misses = 0

    # ---- the stage ----------------------------------------------------------------------------------------------
    def stage_plan(self) -> tuple[StageMemory, tuple[tuple[bool, int, int, int, str], ...]]:
        """The stage's memory (M_max, M0, in-flight count) and its schedule as ``(is_forward, forward index,
        micro-batch, chunk, phase)`` steps; constants of the stage, computed once. ``phase`` is the budget phase
        of a forward (the first B_w = in-flight count forwards are warmup, the others steady; "" for a backward)."""
        if self._stage_plan is None:
            memory = stage_memory(self.model, self.parallel, self.hardware, stage=self.stage)
            index: dict[tuple[int, int], int] = {}
            steps = []
            for action in schedule(self.parallel, self.stage):
                key = (action.microbatch, action.chunk)
                phase = ""
                if action.kind == "F":
                    phase = (BudgetPhase.WARMUP if len(index) < memory.inflight_chunks else BudgetPhase.STEADY).value
                    index[key] = len(index)
                steps.append((action.kind == "F", index[key], action.microbatch, action.chunk, phase))
            self._stage_plan = (memory, tuple(steps))
        return self._stage_plan

    def graph(self, chunk: int, imbalance: float) -> OpGraph:
        key = (chunk, imbalance)
        found = self._graphs.get(key)
        if found is None:
            found = self._graphs[key] = build_graph(self.model, self.parallel, self.hardware, imbalance=imbalance,
                                                    stage=self.stage, chunk=chunk)
        return found

    def planned(self, chunk: int) -> float:
        """The imbalance the pre-gate plan of ``chunk`` is made for (a bucket, rounded down)."""
        if self.planned_imbalance is not None:
            return floor_bucket(self.planned_imbalance, self.step)
        return self._planned.get(chunk, 1.0)

    def observe(self, chunk: int, imbalance: float) -> None:
        """Remember a gate's measurement (``forward`` does it for the imbalance it is given)."""
        seen = self._seen.get(chunk)
        if seen is None:
            seen = self._seen[chunk] = deque(maxlen=self.window)
        seen.append(imbalance)
        self._planned[chunk] = floor_bucket(min(seen), self.step)

    # ---- the hot path ---------------------------------------------------------------------------------------------
    def forward(self, budget_bytes: int, imbalance: float, phase: str, chunk: int, *,
                limit_bytes: int | None = None) -> Decision:
        """Decision for a forward of ``chunk`` with ``budget_bytes`` whose gate measured ``imbalance``.

        ``phase`` is the forward's budget phase; in ``"warmup"`` an overrun up to ``limit_bytes`` (the caller's
        ``BudgetAssigner.absorb_limit_bytes()``) is absorbed instead of re-planned."""
        if type(budget_bytes) is not int or budget_bytes < 0:
            budget_bytes = require_int("budget_bytes", budget_bytes, 0)
        row = self._rows.get((imbalance, chunk))
        if row is None:
            row = self._row(imbalance, chunk)
        planned = self.planned(chunk)
        self.observe(chunk, imbalance)
        if budget_bytes >= row.empty.activation_bytes_at(row.graph, imbalance):
            outcome = self._outcome(NO_PLAN, -1, row, chunk, budget_bytes)  # covered: the empty plan
        else:
            level = budget_bytes // self.quantum
            floor = row.graph.floor_bytes
            decided = level * self.quantum if level * self.quantum >= floor else budget_bytes
            if decided != level * self.quantum:
                level = ("exact", budget_bytes)  # the level's floor is below M0: decide for this budget alone
            pre = self._pre_gate(budget_bytes, level, decided, planned, chunk)
            outcome = None
            if limit_bytes is not None and phase == WARMUP and self.downgrade == "graded":
                cost = self._cost(pre, row.bucket, chunk)
                kept = cost.activation_bytes_at(row.graph, imbalance)
                if budget_bytes < kept <= limit_bytes:  # absorbed: the next warmup budgets shrink
                    outcome = self._outcome(pre, ("absorb", level), row, chunk, decided, GateAction.ABSORB)
            if outcome is None:
                outcome = self._outcome(pre, level, row, chunk, decided)
        return Decision(outcome.plan, outcome.cost.activation_bytes_at(outcome.graph, imbalance),
                        outcome.cost.overhead_s, outcome.action in (GateAction.REPLAN, GateAction.DOWNGRADE),
                        outcome.order, outcome.action)

    def _covers_balanced(self, budget_bytes: int, chunk: int) -> bool:
        balanced = self._balanced.get(chunk)
        if balanced is None:
            balanced = self._balanced[chunk] = self.graph(chunk, 1.0).unmitigated_bytes
        return budget_bytes >= balanced

    def _row(self, imbalance: float, chunk: int) -> _Row:
        """The ceiling bucket of a measured imbalance, with its graph and unmitigated cost."""
        bucket = ceil_bucket(check_imbalance(imbalance), self.step)
        row = self._buckets.get((bucket, chunk))
        if row is None:
            graph = self.graph(chunk, bucket)
            row = self._buckets[(bucket, chunk)] = _Row(bucket, graph, self._cost(NO_PLAN, bucket, chunk))
        if len(self._rows) >= MAX_ROWS:  # measured imbalances may be continuous: bound the memo of their buckets
            self._rows.clear()
        self._rows[(imbalance, chunk)] = row
        return row

    def _cost(self, plan: Plan, imbalance: float, chunk: int) -> PlanCost:
        key = (plan.entries, imbalance, chunk)
        found = self._costs.get(key)
        if found is None:
            found = self._costs[key] = evaluate(self.graph(chunk, imbalance), plan)
        return found

    def _pre_gate(self, budget_bytes: int, level, decided: int, planned: float, chunk: int) -> Plan:
        """The plan in force before the gate (step 1 of the module docstring)."""
        if self._covers_balanced(budget_bytes, chunk):
            return NO_PLAN
        key = (level, planned, chunk)
        found = self._pregate.get(key)
        if found is None:
            graph = self.graph(chunk, planned)
            solution = greedy.solve(graph, decided)
            if not solution.ok:  # below M0 nothing fits: the least the micro-batch can keep (full recompute)
                solution = greedy.solve(graph, graph.floor_bytes)
            found = self._pregate[key] = solution.plan
        return found

    def _outcome(self, pre: Plan, level, row: _Row, chunk: int, decided: int,
                 absorbed: GateAction | None = None) -> _Outcome:
        key = (pre.entries, level, row.bucket, chunk)
        found = self._outcomes.get(key)
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        if level == -1 or absorbed is not None:
            plan, action = pre, absorbed or GateAction.KEEP
            cost = self._cost(plan, row.bucket, chunk)
        else:
            gate = after_gate(row.graph, pre, decided, downgrade=self.downgrade)
            plan, action, cost = gate.plan, gate.action, gate.cost
        found = self._outcomes[key] = _Outcome(plan, cost, row.graph, action, self._order(row.graph, plan, chunk))
        return found

    def _order(self, graph: OpGraph, plan: Plan, chunk: int) -> Order:
        key = (plan.entries, graph.imbalance, chunk)  # the chains depend on the plan and graph only
        order = self._orders.get(key)
        if order is None:
            chains = build_chains(graph, plan, graph, plan, hardware=self.hardware)
            # the DP reads only each chain's stage resources and durations: plans that differ elsewhere share it
            solved = tuple(None if chain is None else tuple((s.resource, s.duration_ns) for s in chain.stages)
                           for chain in (chains.forward, chains.backward, chains.offload, chains.recovery))
            order = self._solved.get(solved)
            if order is None:
                order = self._solved[solved] = dp.solve(chains, pipeline_degree=self.parallel.pp)
            self._orders[key] = order
        return order
