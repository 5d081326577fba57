"""The runtime decision path of one pipeline stage, with the memo caches of §V-B "Runtime Solving".

Per chunk-forward: Algorithm 1's budget -> a plan for the imbalance expected before the gate (``PlanCache``,
greedy on a miss) -> after the gate, the deferred MoE downgrade if the measured imbalance does not fit -> the
fused order of the steady-state point (``dp`` on a miss). Every decision is memoised under (budget bucket,
imbalance bucket, chunk); the budget bucket floors and the imbalance bucket ceils, so a cached decision is
safe for every request in its bucket, and the bytes it reports are an upper bound of what the micro-batch keeps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..budget import BudgetPhase, downgrade_needed, downgrade_plan
from ..costmodel import (Hardware, ModelConfig, OpGraph, ParallelConfig, Plan, PlanCost, StageMemory, build_graph,
                         evaluate, schedule, stage_memory)
from ..costmodel.build import check_imbalance
from ..fusion import Order, build_chains, dp
from ..mitigation import PlanCache

MAX_ROWS = 4096  # measured imbalance values whose bucket is remembered
NO_PLAN = Plan()


@dataclass(frozen=True)
class Decision:
    """What the runtime runs for one chunk-forward."""

    plan: Plan
    kept_bytes: int
    overhead_s: float
    downgraded: bool
    order: Order


class DecisionPath:
    """Decisions of one stage, memoised. ``forward(budget, imbalance, phase, chunk)`` is the hot path."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, *, stage: int = 0,
                 planned_imbalance: float = 1.2, budget_quantum_bytes: int = 256 << 20,
                 imbalance_step: float = 0.1, spike_step: float = 0.5):
        self.model, self.parallel, self.hardware, self.stage = model, parallel, hardware, stage
        self.planned_imbalance = check_imbalance(planned_imbalance)
        self.plans = PlanCache(budget_quantum_bytes=budget_quantum_bytes, imbalance_step=imbalance_step)
        if isinstance(spike_step, bool) or not isinstance(spike_step, (int, float)) or not 0 < spike_step < 100:
            raise ValueError(f"spike_step must be a number in (0, 100), got {spike_step!r}")
        self.quantum, self.step, self.spike_step = budget_quantum_bytes, imbalance_step, spike_step
        self._graphs: dict[tuple[int, float], OpGraph] = {}
        # (bucket, chunk) -> (M0, unmitigated bytes, decisions of the bucket by budget level, bucket)
        self._buckets: dict[tuple[float, int], tuple[int, int, dict, float]] = {}
        self._rows: dict[tuple[float, int], tuple[int, int, dict, float]] = {}  # (imbalance, chunk) -> its bucket's
        self._costs: dict[tuple, PlanCost] = {}  # evaluate(graph of the bucket, plan) by (plan, bucket, chunk)
        self._outcomes: dict[tuple, Decision] = {}  # (planned plan, bucket, chunk, downgraded) -> decision
        self._orders: dict[tuple, Order] = {}  # fused orders by (plan, imbalance bucket, chunk)
        self._solved: dict[tuple, Order] = {}  # fused orders by what the DP reads: each chain's (resource, ns)
        self._stage_plan: tuple | None = None
        self.hits = self.misses = 0

    def stage_plan(self) -> tuple[StageMemory, tuple[tuple[bool, int, int, int, str], ...]]:
        """The stage's memory (M_max, M0, in-flight count) and its schedule as ``(is_forward, forward index,
        micro-batch, chunk, phase)`` steps; both are constants of the stage, computed once. ``phase`` is the
        budget phase of a forward (Algorithm 1 with B_w = the in-flight count: the first B_w forwards are warmup,
        the others steady; "" for a backward)."""
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

    def forward(self, budget_bytes: int, imbalance: float, phase: str, chunk: int) -> Decision:
        """Decision for a forward of ``chunk`` with ``budget_bytes`` whose gate measured ``imbalance``.

        A budget at or above what the micro-batch keeps unmitigated needs no plan: all such budgets share one
        key, so the spikes that shift later budgets do not multiply the cached decisions. Imbalances above the
        planned one (spikes) are bucketed by the coarser ``spike_step``: they are rare and mostly downgraded.
        A decision does not depend on the phase: it is shared across phases.
        """
        row = self._rows.get((imbalance, chunk))
        if row is None:
            row = self._row(imbalance, chunk)
        floor, cap, decisions, bucket = row
        if budget_bytes >= cap:
            level = -1  # nothing to mitigate: one decision for all such budgets
        else:
            level = budget_bytes // self.quantum
            if level * self.quantum < floor:
                level = ("exact", budget_bytes)  # the bucket's floor is below M0: decide for this budget alone
        found = decisions.get(level)
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        budget = cap if level == -1 else budget_bytes if isinstance(level, tuple) else level * self.quantum
        found = decisions[level] = self._decide(budget, bucket, chunk)
        return found

    def _row(self, imbalance: float, chunk: int) -> tuple[int, int, dict, float]:
        """The bucket of a measured imbalance (the imbalance bucket ceils) with its bounds and decisions."""
        step = self.step if imbalance <= self.planned_imbalance else self.spike_step
        bucket = max(round(math.ceil(imbalance / step - 1e-12) * step, 9), 1.0)
        row = self._buckets.get((bucket, chunk))
        if row is None:  # M0 and the unmitigated bytes (the empty plan's, whose cost the decisions reuse)
            unmitigated = self._cost(NO_PLAN, bucket, chunk).activation_bytes
            row = self._buckets[(bucket, chunk)] = (self.graph(chunk, bucket).floor_bytes, unmitigated, {}, bucket)
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

    def _decide(self, budget: int, imbalance: float, chunk: int) -> Decision:
        planned = self.plans.get(budget, self.planned_imbalance, chunk, lambda r: self.graph(chunk, r)).plan
        kept = self._cost(planned, imbalance, chunk).activation_bytes
        # deferred planning after the gate: keep the plan if it fits, else the MoE-module downgrade of it;
        # both outcomes are shared by every budget level whose planned plan is the same
        downgraded = downgrade_needed(kept, budget)
        key = (planned.entries, imbalance, chunk, downgraded)
        found = self._outcomes.get(key)
        if found is None:
            actual = self.graph(chunk, imbalance)
            plan = downgrade_plan(actual, planned) if downgraded else planned
            found = self._outcomes[key] = self._decision(actual, plan, downgraded, imbalance, chunk)
        return found

    def _decision(self, graph: OpGraph, plan: Plan, downgraded: bool, imbalance: float, chunk: int) -> Decision:
        cost = self._cost(plan, imbalance, chunk)
        order_key = (plan.entries, imbalance, chunk)  # the chains depend on the plan and graph only
        order = self._orders.get(order_key)
        if order is None:
            chains = build_chains(graph, plan, graph, plan, hardware=self.hardware)
            # the DP reads only each chain's stage resources and durations: plans that differ elsewhere share it
            solved = tuple(None if chain is None else tuple((s.resource, s.duration_ns) for s in chain.stages)
                           for chain in (chains.forward, chains.backward, chains.offload, chains.recovery))
            order = self._solved.get(solved)
            if order is None:
                order = self._solved[solved] = dp.solve(chains, pipeline_degree=self.parallel.pp)
            self._orders[order_key] = order
        return Decision(plan, cost.activation_bytes, cost.overhead_s, downgraded, order)
