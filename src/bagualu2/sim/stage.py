"""What the simulator knows of one pipeline stage: the runtime's stage engine (memory, schedule, graphs at any
imbalance, memoised cost — ``costmodel.evaluate``, the one evaluator — and fused order of a plan) for planning,
and for timing when the timing profile differs."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from ..costmodel import Hardware, ModelConfig, OpGraph, ParallelConfig, Plan, PlanCost, StageMemory
from ..costmodel.graph import MATMUL_KINDS
from ..costmodel.validate import require_int
from ..runtime import DecisionPath, Stage


class Choice(NamedTuple):
    """What one chunk-forward runs: the bytes it keeps (exact at its imbalance), its forward and backward seconds
    (``PlanCost.forward_s`` / ``backward_s``: recompute, copies and casts included), and, for the policies that
    fuse a steady F_x B_y pair, the pair's fused makespan (None: the pair runs one after the other)."""

    kept_bytes: int
    forward_s: float
    backward_s: float
    pair_s: float | None = None


class ChoiceKey(NamedTuple):
    """What running a plan on (chunk, imbalance) costs a policy, fused or not."""

    chunk: int
    imbalance: float
    entries: tuple
    fused: bool


class StageContext:
    """One stage of one model on one hardware, for the simulator's policies. ``engine`` is the runtime
    :class:`~bagualu2.runtime.Stage` plans are made on (``plan_hardware``'s): its memory and steps are the stage's,
    its graphs the planning graphs, and ``path`` (a :class:`~bagualu2.runtime.DecisionPath` over it;
    ``downgrade``: its gate, ``"graded"`` or ``"paper"``) decides for the flexible policies. ``plan_hardware``
    (default ``hardware``): the profile plans are made with — a trainer plans with its configured profile while
    its time is that of the machine (``hardware``, e.g. fitted to it); plans are timed (``cost``, ``pair_s``,
    ``choice``) on the graphs of ``timing``, the engine of ``hardware`` (the planning engine when both profiles
    are one). ``m_max_bytes``: the stage's activation capacity (default its ``M_max``); ``cache``: the engines'
    memo on or off (``runtime.Stage``)."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, stage: int, *,
                 plan_hardware: Hardware | None = None, downgrade: str = "graded", m_max_bytes: int | None = None,
                 cache: bool = True):
        self.model, self.parallel, self.hardware, self.stage = model, parallel, hardware, stage
        self.plan_hardware = hardware if plan_hardware is None else plan_hardware
        self.separate_timing = self.plan_hardware != hardware  # are plans timed on another profile?
        self.engine = Stage(model, parallel, self.plan_hardware, stage=stage, cache=cache)
        self.timing = Stage(model, parallel, hardware, stage=stage, cache=cache) if self.separate_timing else self.engine
        self.path = DecisionPath.on(self.engine, downgrade=downgrade)
        self.memory: StageMemory = self.engine.memory
        if m_max_bytes is not None:
            self.memory = dataclasses.replace(self.memory, m_max_bytes=require_int("m_max_bytes", m_max_bytes, 1))
        self.steps = self.engine.steps
        self._choices = self.timing.memo.table(ChoiceKey)

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
        return self.engine.graph(chunk, imbalance)

    def timing_graph(self, chunk: int, imbalance: float) -> OpGraph:
        """The graph plans are timed on (``hardware``'s; the planning graph when both profiles are one)."""
        return self.timing.graph(chunk, imbalance)

    def cost(self, chunk: int, imbalance: float, plan: Plan) -> PlanCost:
        return self.timing.cost(plan, imbalance, chunk)

    def pair_s(self, chunk: int, imbalance: float, plan: Plan) -> float:
        """Fused makespan of a steady F_x B_y scheduling point with x's graph and plan on both sides (the
        runtime's convention, ``Stage.point_order``)."""
        return self.timing.point_order(plan, imbalance, chunk).makespan_s

    def choice(self, chunk: int, imbalance: float, plan: Plan, *, fused: bool = False) -> Choice:
        """The :class:`Choice` of running ``plan`` on ``chunk`` at ``imbalance`` (memoised)."""
        key = ChoiceKey(chunk, imbalance, plan.entries, fused)
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
