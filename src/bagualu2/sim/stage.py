"""What the simulator knows of one pipeline stage: the runtime's stage engine (memory, schedule, graphs at any
imbalance, memoised cost — ``costmodel.evaluate``, the one evaluator — and fused order of a plan) for planning,
and for timing when the timing profile differs."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from typing import NamedTuple

from ..costmodel import Hardware, ModelConfig, OpGraph, ParallelConfig, Plan, PlanCost, StageMemory, points
from ..costmodel.graph import MATMUL_KINDS
from ..costmodel.validate import require_int
from ..fusion import build_chains
from ..runtime import DecisionPath, Stage
from ..fusion.interference import group_times_ns
from .execution import order_of


class ChoiceKey(NamedTuple):
    """What running a plan on (chunk, imbalance) costs under one execution and interference."""

    chunk: int
    imbalance: float
    entries: tuple
    execution: str
    share: float


class Choice(NamedTuple):
    """What one chunk-forward runs: the bytes it keeps (exact at its imbalance) and the seconds of the three steps
    it can be part of under the policy's execution (:mod:`.execution`): a forward alone (with the offload copies
    of the forward before it), a backward alone (with the recovery of the next one), and a steady F_x B_y pair
    with its own backward (``pair_s``: y's graph and plan are x's; :meth:`StageContext.pair` times a pair with
    y's own; ``pair_forward_out_s``: when in that pair x's forward output leaves, :class:`PairTime`); ``key``: what
    it was made for."""

    kept_bytes: int
    forward_s: float
    backward_s: float
    pair_s: float
    pair_forward_out_s: float
    key: ChoiceKey


class PairTime(NamedTuple):
    """A steady point F_x B_y: its seconds, and when after its start x's forward output leaves for the next stage
    — at the point's end where F and B run together (Megatron-Core's combined 1F1B step and the fused point send
    after the whole point), else where the forward part ends (F then B)."""

    seconds: float
    forward_out_s: float


class PairKey(NamedTuple):
    """A steady point F_x B_y: x's forward and y's backward, each as its own :class:`ChoiceKey` says."""

    lead: ChoiceKey
    back: ChoiceKey


@lru_cache(maxsize=32)
def shared_engine(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, stage: int,
                  downgrade: str, hidden_copies: bool = True) -> Stage:
    """One memoised :class:`~bagualu2.runtime.Stage` per (model, layout, profile, stage, gate) for every simulation
    of it: its graphs, costs, orders and choices are pure functions of their keys, so the policies of a run share
    them (a :class:`~bagualu2.runtime.DecisionPath`'s own state stays per simulation; paths that price copies
    differently decide differently, so each pricing has its own engine)."""
    return Stage(model, parallel, hardware, stage=stage)


def _capped(memory: StageMemory, m_max_bytes: int | None) -> StageMemory:
    return memory if m_max_bytes is None else dataclasses.replace(memory, m_max_bytes=m_max_bytes)


class StageContext:
    """One stage of one model on one hardware, for the simulator's policies. ``engine`` is the runtime
    :class:`~bagualu2.runtime.Stage` plans are made on (``plan_hardware``'s): its memory and steps are the stage's,
    its graphs the planning graphs, and ``path`` (a :class:`~bagualu2.runtime.DecisionPath` over it;
    ``downgrade``: its gate, ``"graded"`` or ``"paper"``) decides for the flexible policies. ``plan_hardware``
    (default ``hardware``): the profile plans are made with — a trainer plans with its configured profile while
    its time is that of the machine (``hardware``, e.g. fitted to it); plans are timed (``cost``, ``choice``) on the
    graphs of ``timing``, the engine of ``hardware`` (the planning engine when both profiles
    are one). Memory: ``memory`` is the device's (``hardware``'s ``M_max``: what an iteration's peak must fit), and
    ``plan_memory`` the one plans are made for (``plan_hardware``'s: the static policies' targets and flexible's
    budgets), the same when the profiles are. ``m_max_bytes``: the stage's activation capacity for both (default
    their ``M_max``); ``cache``: the engines' memo on or off (``runtime.Stage``); ``hidden_copies``: the path's
    pricing of copies (``runtime.DecisionPath``)."""

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, stage: int, *,
                 plan_hardware: Hardware | None = None, downgrade: str = "graded", m_max_bytes: int | None = None,
                 cache: bool = True, hidden_copies: bool = True):
        self.model, self.parallel, self.hardware, self.stage = model, parallel, hardware, stage
        self.plan_hardware = hardware if plan_hardware is None else plan_hardware
        self.separate_timing = self.plan_hardware != hardware  # are plans timed on another profile?
        if cache:
            self.engine = shared_engine(model, parallel, self.plan_hardware, stage, downgrade, hidden_copies)
            # the timing engine decides nothing: one per profile whatever the pricing of the planning path
            self.timing = (shared_engine(model, parallel, hardware, stage, downgrade) if self.separate_timing
                           else self.engine)
        else:
            self.engine = Stage(model, parallel, self.plan_hardware, stage=stage, cache=False)
            self.timing = (Stage(model, parallel, hardware, stage=stage, cache=False) if self.separate_timing
                           else self.engine)
        self.path = DecisionPath.on(self.engine, downgrade=downgrade, hidden_copies=hidden_copies)
        self._paths = {hidden_copies: self.path}
        self.downgrade, self.cache = downgrade, cache
        if m_max_bytes is not None:
            m_max_bytes = require_int("m_max_bytes", m_max_bytes, 1)
        self._plan_memory = _capped(self.engine.memory, m_max_bytes)
        self._memory = _capped(self.timing.memory, m_max_bytes) if self.separate_timing else self._plan_memory
        self.steps = self.engine.steps
        # the forwards that lead a scheduling point F_x B_y (costmodel.points: the one pairing rule)
        self.point_leads = frozenset((group[0].microbatch, group[0].chunk)
                                     for group in points(parallel, stage) if len(group) == 2)
        self._choices = self.timing.memo.table(ChoiceKey)
        self._pairs = self.timing.memo.table(PairKey)
        # a step's copies are its own micro-batches': at points of relation 1, and wherever each forward and
        # backward runs alone (no pipeline and no pairing, or too few micro-batches for any steady pair)
        self.own_copies = self.engine.point_relation == 1 or self.engine.alone

    def path_with(self, *, hidden_copies: bool) -> DecisionPath:
        """``path``, or (made on first use) a decision path over an engine of its own that prices copies as
        ``hidden_copies`` says: paths that price copies differently decide differently."""
        found = self._paths.get(hidden_copies)
        if found is None:
            engine = (shared_engine(self.model, self.parallel, self.plan_hardware, self.stage, self.downgrade,
                                    hidden_copies) if self.cache
                      else Stage(self.model, self.parallel, self.plan_hardware, stage=self.stage, cache=False))
            found = self._paths[hidden_copies] = DecisionPath.on(engine, downgrade=self.downgrade,
                                                                 hidden_copies=hidden_copies)
        return found

    @property
    def memory(self) -> StageMemory:
        """The device's memory (``hardware``'s; a given ``m_max_bytes`` as its capacity)."""
        return self._memory

    @property
    def plan_memory(self) -> StageMemory:
        """The memory plans are made for (``plan_hardware``'s; a given ``m_max_bytes`` as its capacity)."""
        return self._plan_memory

    @property
    def m_max_bytes(self) -> int:
        """The device's activation capacity: an iteration whose peak exceeds it runs out of memory."""
        return self.memory.m_max_bytes

    @property
    def plan_m_max_bytes(self) -> int:
        """The activation capacity plans are made for (``plan_hardware``'s; Algorithm 1's ``M_max``)."""
        return self.plan_memory.m_max_bytes

    def check_room(self, *, capped: bool = False) -> None:
        """One-line ``ValueError`` when no plan fits this stage (``StageMemory.check_room``), on the device or, with
        another planning profile, on that one; ``capped``: the capacity was given (``m_max_bytes``) rather than
        what the profile leaves."""
        self.memory.check_room(self.hardware, self.stage, capped=capped)
        if self.separate_timing:
            self.plan_memory.check_room(self.plan_hardware, self.stage, capped=capped)

    @property
    def inflight(self) -> int:
        return self.plan_memory.inflight_chunks

    @property
    def per_chunk_bytes(self) -> int:
        """What each in-flight chunk may keep when the planning ``M_max`` is split evenly: the static policies'
        target."""
        return self.plan_memory.m_max_bytes // self.plan_memory.inflight_chunks

    def graph(self, chunk: int, imbalance: float) -> OpGraph:
        """The graph plans are made on (``plan_hardware``'s)."""
        return self.engine.graph(chunk, imbalance)

    def timing_graph(self, chunk: int, imbalance: float) -> OpGraph:
        """The graph plans are timed on (``hardware``'s; the planning graph when both profiles are one)."""
        return self.timing.graph(chunk, imbalance)

    def cost(self, chunk: int, imbalance: float, plan: Plan) -> PlanCost:
        return self.timing.cost(plan, imbalance, chunk)

    def choice(self, chunk: int, imbalance: float, plan: Plan, *, execution: str = "serial",
               share: float = 0.0) -> Choice:
        """The :class:`Choice` of running ``plan`` on ``chunk`` at ``imbalance`` under ``execution`` (one of
        ``execution.EXECUTIONS``) with interference ``share``, on the timing graphs (memoised)."""
        key = ChoiceKey(chunk, imbalance, plan.entries, execution, share)
        found = self._choices.get(key)
        if found is None:
            graph, hardware = self.timing_graph(chunk, imbalance), self.hardware
            pair = self._timed(build_chains(graph, plan, graph, plan, hardware=hardware), execution, share)
            found = self._choices[key] = Choice(
                self.cost(chunk, imbalance, plan).activation_bytes,
                self._timed(build_chains(graph, plan, None, None, hardware=hardware), execution, share).seconds,
                self._timed(build_chains(None, None, graph, plan, hardware=hardware), execution, share).seconds,
                pair.seconds, pair.forward_out_s, key)
        return found

    def pair(self, lead: Choice, back: Choice) -> PairTime:
        """The steady point F_x B_y whose forward ran ``lead`` and whose backward is of the forward that ran
        ``back``: each on its own graph and plan, under ``lead``'s execution (memoised)."""
        if back.key == lead.key:
            return PairTime(lead.pair_s, lead.pair_forward_out_s)
        key = PairKey(lead.key, back.key)
        found = self._pairs.get(key)
        if found is None:
            x, y = lead.key, back.key
            chains = build_chains(self.timing_graph(x.chunk, x.imbalance), Plan(x.entries),
                                  self.timing_graph(y.chunk, y.imbalance), Plan(y.entries), hardware=self.hardware)
            found = self._pairs[key] = self._timed(chains, x.execution, x.share)
        return found

    def _timed(self, chains, execution: str, share: float) -> PairTime:
        """The makespan of ``chains`` under ``execution`` (the fused one: the DP's order for the slowdown
        ``share`` it is timed with), and when its forward's output leaves (:class:`PairTime`)."""
        order = order_of(execution, chains, lambda chains: self.timing.order(chains, share=share),
                         own_copies=self.own_copies)
        times = group_times_ns(order, chains, share)
        total = sum(times)
        kinds = [{kind for kind, _ in group} for group in order.groups]
        together = execution in ("fused", "fused-pairs") or any({"F", "B"} <= group for group in kinds)
        last_forward = max((i for i, group in enumerate(kinds) if "F" in group), default=len(kinds) - 1)
        out = total if together else sum(times[:last_forward + 1])
        return PairTime(1e-9 * total, 1e-9 * out)

    def model_flops(self) -> int:
        """Model FLOPs of this stage per iteration: 3 x the forward matrix-product FLOPs (``MATMUL_KINDS``) of
        every chunk at balanced load, times the micro-batches (backward = 2 x forward; recompute not counted)."""
        forward = sum(op.flops for chunk in range(self.parallel.vp) for op in self.graph(chunk, 1.0).ops
                      if op.kind in MATMUL_KINDS)
        return 3 * forward * self.parallel.num_microbatches
