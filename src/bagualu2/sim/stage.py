"""What the simulator knows of one pipeline stage: its memory and schedule, its graphs at any imbalance, and the
memoised cost (``costmodel.evaluate``, the one evaluator) and fused order (``fusion.dp``) of a plan on them."""

from __future__ import annotations

from typing import NamedTuple

from ..costmodel import (Hardware, ModelConfig, OpGraph, ParallelConfig, Plan, PlanCost, StageMemory, build_graph,
                         evaluate)
from ..costmodel.graph import MATMUL_KINDS
from ..fusion import build_chains, dp
from ..runtime import DecisionPath


class Choice(NamedTuple):
    """What one chunk-forward runs: the bytes it keeps (exact at its imbalance), its forward and backward seconds
    (``PlanCost.forward_s`` / ``backward_s``: recompute, copies and casts included), and, for the policies that
    fuse a steady F_x B_y pair, the pair's fused makespan (None: the pair runs one after the other)."""

    kept_bytes: int
    forward_s: float
    backward_s: float
    pair_s: float | None = None


class StageContext:
    """One stage of one model on one hardware. ``path`` is a fresh runtime :class:`DecisionPath` of the stage: its
    ``stage_plan()`` gives the schedule, its ``graph()`` the memoised graphs, and the flexible policy decides with
    it (``downgrade``: its gate, ``"graded"`` or ``"paper"``). ``plan_hardware`` (default ``hardware``): the
    profile plans are made with — a trainer plans with its
    configured profile while its time is that of the machine (``hardware``, e.g. fitted to it); plans are made on
    graphs of ``plan_hardware`` and timed (``cost``, ``pair_s``, ``choice``) on graphs of ``hardware``."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, stage: int, *,
                 plan_hardware: Hardware | None = None, downgrade: str = "graded"):
        self.model, self.parallel, self.hardware, self.stage = model, parallel, hardware, stage
        self.plan_hardware = hardware if plan_hardware is None else plan_hardware
        self.separate_timing = self.plan_hardware != hardware  # are plans timed on another profile?
        self.path = DecisionPath(model, parallel, self.plan_hardware, stage=stage, downgrade=downgrade)
        self._timing: dict[tuple, OpGraph] = {}
        memory, steps = self.path.stage_plan()
        self.memory: StageMemory = memory
        self.steps = steps
        self._costs: dict[tuple, PlanCost] = {}
        self._choices: dict[tuple, Choice] = {}
        self._pairs: dict[tuple, float] = {}

    @property
    def m_max_bytes(self) -> int:
        return self.memory.m_max_bytes

    @property
    def inflight(self) -> int:
        return self.memory.inflight_chunks

    @property
    def per_chunk_bytes(self) -> int:
        """What each in-flight chunk may keep when M_max is split evenly: the static policies' target."""
        return self.memory.m_max_bytes // self.memory.inflight_chunks

    def graph(self, chunk: int, imbalance: float) -> OpGraph:
        """The graph plans are made on (``plan_hardware``'s)."""
        return self.path.graph(chunk, imbalance)

    def timing_graph(self, chunk: int, imbalance: float) -> OpGraph:
        """The graph plans are timed on (``hardware``'s; the planning graph when both profiles are one)."""
        if not self.separate_timing:
            return self.path.graph(chunk, imbalance)
        found = self._timing.get((chunk, imbalance))
        if found is None:
            found = self._timing[(chunk, imbalance)] = build_graph(self.model, self.parallel, self.hardware,
                                                                   imbalance=imbalance, stage=self.stage,
                                                                   chunk=chunk)
        return found

    def cost(self, chunk: int, imbalance: float, plan: Plan) -> PlanCost:
        key = (chunk, imbalance, plan.entries)
        found = self._costs.get(key)
        if found is None:
            found = self._costs[key] = evaluate(self.timing_graph(chunk, imbalance), plan)
        return found

    def pair_s(self, chunk: int, imbalance: float, plan: Plan) -> float:
        """Fused makespan of a steady F_x B_y scheduling point with x's graph and plan on both sides (the
        runtime's convention, ``DecisionPath``'s orders)."""
        key = (chunk, imbalance, plan.entries)
        found = self._pairs.get(key)
        if found is None:
            graph = self.timing_graph(chunk, imbalance)
            chains = build_chains(graph, plan, graph, plan, hardware=self.hardware)
            found = self._pairs[key] = dp.solve(chains, pipeline_degree=self.parallel.pp).makespan_s
        return found

    def choice(self, chunk: int, imbalance: float, plan: Plan, *, fused: bool = False) -> Choice:
        """The :class:`Choice` of running ``plan`` on ``chunk`` at ``imbalance`` (memoised)."""
        key = (chunk, imbalance, plan.entries, fused)
        found = self._choices.get(key)
        if found is None:
            cost = self.cost(chunk, imbalance, plan)
            pair = self.pair_s(chunk, imbalance, plan) if fused else None
            found = self._choices[key] = Choice(cost.activation_bytes, cost.forward_s, cost.backward_s, pair)
        return found

    def model_flops(self) -> int:
        """Model FLOPs of this stage per iteration: 3 x the forward matrix-product FLOPs (``MATMUL_KINDS``) of
        every chunk at balanced load, times the micro-batches (backward = 2 x forward; recompute not counted)."""
        forward = sum(op.flops for chunk in range(self.parallel.vp) for op in self.graph(chunk, 1.0).ops
                      if op.kind in MATMUL_KINDS)
        return 3 * forward * self.parallel.num_microbatches
