"""The runtime decision path of one pipeline stage (paper §V-A, §V-B "Runtime Solving"), memoised.

Per chunk-forward, ``DecisionPath.forward(budget, imbalance, phase, chunk)``:

1. **covered** — a budget at or above the unmitigated bytes at the measured imbalance (exact, not bucketed) runs
   the empty plan when nothing was committed before the gate (step 2: the planned imbalance was no higher, or the
   pre-gate step left everything to the gate).
2. **pre-gate plan** — what runs before the gate: a budget covering the unmitigated bytes at the *planned*
   imbalance — the smallest the last ``window`` gates of this chunk measured (a low estimate: what is committed
   before the gate cannot be undone, the MoE module can still be re-planned) — commits nothing; a tighter one is
   planned by greedy on the graph at the planned imbalance, over every tensor of the chunk (a re-plan of the MoE
   module alone would leave the cheaper savings outside it unused), and still commits nothing when its decided
   budget covers balanced load and the gate's decision from nothing is as fast at the planned imbalance. With
   ``hidden_copies``, the greedy with copy windows and the offload-prefix plans (``mitigation.prefix``) are
   candidates too, and the one whose steady point is shortest runs.
3. **gate** — in warmup, an overrun of the pre-gate plan within ``limit_bytes`` is absorbed (the next budgets
   shrink, never below M0); otherwise :func:`~.gate.after_gate` at the measured imbalance: keep, graded re-plan
   of the MoE module, or the full downgrade (``downgrade="paper"``: keep or full downgrade only). Keeping is an
   option whenever the pre-gate plan fits the budget at the measured imbalance (exact, not bucketed); a re-plan
   fits the budget the need level decides for.
4. **order** — the fused dual-batch order of the forward's scheduling point (``fusion.dp``): F_x B_y (with O and
   R) in the steady phase; F_x and the offload of x−1 in warmup, where no backward runs.

The path works over a :class:`~.stage.Stage` (its graphs, schedule and memo; chunks whose graphs are the same up to
layer numbering share their canonical chunk's results, only the names in their plans differ). Memoised, each hit
safe for every request of its key: measured imbalance -> its *ceiling* bucket (``imbalance_step``, ``spike_step``
above ``spike_threshold``) with the bucket's graph; pre-gate plans by (need level, planned bucket, chunk); gate
decisions by (pre-gate plan, need level — marked when the pre-gate plan fits the request's budget exactly, which
makes keeping it an option —, imbalance bucket, chunk); orders by what the DP reads. The *need* of a decision is
``unmitigated bytes - budget``; its level rounds it *up* on a geometric grid (ratio ``1 + need_step`` from one
``budget_quantum_bytes``), so a decision frees at least what is needed, finely for small needs and coarsely for the
large, rare needs of spikes; a need larger than the budget rounds the budget *down* instead, on a grid anchored at
``M_max`` (:class:`NeedGrid`). Pre-gate plans use a coarser grid (``pregate_need_step``): what they free beyond the
need is in part inside the MoE module, which the gate re-plans at the fine grid; a need above the budget rounds
the budget down on the fine grid for them too (a coarse step of a tight budget gives up more than the re-plan of
the MoE module wins back). On a miss, a gate decision of a
nearby need level (up to ``reuse_levels`` away) stands in when it is as good: a smaller-need one that fits this
budget at the measured imbalance, or a larger-need one that fits and costs at most ``1 + need_step`` times the
smaller-need one (with no smaller-need one cached: one at most ``UNREFERENCED_LEVELS`` levels up). Kept bytes are
reported exactly at the measured imbalance (routed tensors scale with the routed token count;
``PlanCost.activation_bytes_at``); ``overhead_s`` is the plan's on the bucket's graph. docs/runtime.md has the
measured quality.

Besides the stage's memo (pure results; ``Stage(cache=False)`` turns it off), the path has state: the gates it
has seen (the planned imbalance) and the gate decisions it has made per need level (what the stand-ins read).
Decisions are the same with the memo on or off.
"""


from __future__ import annotations

from typing import NamedTuple

from ..budget import BudgetPhase
from ..costmodel import Hardware, ModelConfig, OpGraph, ParallelConfig, Plan, StageMemory, Strategy
from ..costmodel.build import check_imbalance
from ..costmodel.validate import require_int, require_number
from ..fusion import Order
from ..mitigation import greedy, prefix
from .buckets import ceil_bucket
from .gate import GateAction, after_gate, check_downgrade, copy_windows
from .keys import NeedGrid, PlannedImbalance, shift_plan
from .records import (NO_PLAN, NO_PRE, Decision, LevelKey, Outcome, PreBudgetKey, PreBytesKey, PreGate, PreGateKey,
                      Row, RowKey, Seen, SeenKey, ShiftKey, split_bytes)
from .stage import Stage, Step

MAX_DECISIONS = 1 << 16  # gate decisions remembered per need level (the stand-ins' history)
UNREFERENCED_LEVELS = 2  # with no smaller-need decision made, a larger-need one this many levels up stands in
STAY_ON_DEVICE = (Strategy.KEEP, Strategy.RECOMPUTE)  # strategies that add no forward cast and no copy
WARMUP = BudgetPhase.WARMUP.value
PHASES = (BudgetPhase.WARMUP.value, BudgetPhase.STEADY.value)  # the phases a forward runs in
COVERED, ABSORBED = "covered", "absorbed"  # decision keys of the two outcomes that keep the plan in force
KEEPABLE = "keepable"  # (KEEPABLE, level): a need level's decision where the plan in force fits the budget exactly


class _At(NamedTuple):
    """Where a forward runs, for :meth:`DecisionPath.forward` (the two fields of a :class:`Step` it reads)."""

    phase: str
    chunk: int


class DecisionPath:
    """Decisions of one stage over its :class:`~.stage.Stage` engine. ``forward(budget, imbalance, phase,
    chunk)`` is the hot path.

      stage                 pipeline stage.
      downgrade             ``"graded"`` (default) or ``"paper"`` (keep or full MoE-module downgrade, no absorption).
      planned_imbalance     None (default): follow the gates (min of the last ``window``); a number: constant.
      window                gates remembered per chunk for the planned imbalance (>= 1).
      budget_quantum_bytes  first step of the need grid; None: 1/1024 of the smallest chunk's unmitigated bytes at
                            r = 1.
      imbalance_step        imbalance bucket width up to ``spike_threshold`` (> 0).
      spike_threshold       imbalances above it (spikes: rare, each a new value) are bucketed by ``spike_step``.
      spike_step            bucket width of spikes (> 0).
      need_step             ratio - 1 of the need grid of gate decisions (in [1e-6, 1]).
      pregate_need_step     ratio - 1 of the need grid of pre-gate plans (in [1e-6, 1]); their budget grid (a
                            need above the budget) is the gate decisions' (``need_step``).
      reuse_levels          how many need levels away a decision made may stand in (>= 0).
      hidden_copies         also plan with copies priced by what they leave exposed (``greedy.GreedyConfig``'s
                            ``copy_window_ns`` = the steady point's time under the plan priced in full, and half
                            of it: ``gate.copy_windows``; in the fused order the copy engines run beside it) and
                            keep, before and after the gate, the plan whose scheduling point is shorter
                            (``Stage.point_order``); False (default):
                            Algorithm 2's pricing alone, every copy in full (right where copies do not overlap
                            compute, e.g. on a CPU).
      engine                the stage's :class:`~.stage.Stage` (default: a new one); shared with the other
                            users of the stage (``DecisionPath.on(engine)``).

    ``hits`` / ``misses`` count the decisions found / made.
    """

    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, *, stage: int = 0,
                 downgrade: str = "graded", planned_imbalance: float | None = None, window: int = 16,
                 budget_quantum_bytes: int | None = None, imbalance_step: float = 0.02,
                 spike_threshold: float = 1.2, spike_step: float = 0.2, need_step: float = 0.05,
                 pregate_need_step: float = 0.15, reuse_levels: int = 16, hidden_copies: bool = False,
                 engine: Stage | None = None):
        self.model, self.parallel, self.hardware = model, parallel, hardware
        self.stage = require_int("stage", stage, 0, parallel.pp)
        if engine is None:
            engine = Stage(model, parallel, hardware, stage=self.stage)
        elif not isinstance(engine, Stage) or (engine.model, engine.parallel, engine.hardware, engine.stage) != (
                model, parallel, hardware, self.stage):
            raise ValueError("engine must be a Stage of the same model, parallel config, hardware and stage")
        self.engine = engine
        self.downgrade = check_downgrade(downgrade)
        self.planned_imbalance = None if planned_imbalance is None else self._check(planned_imbalance)
        self.step = require_number("imbalance_step", imbalance_step, 0, 10, low_open=True)
        self._planner = PlannedImbalance(window, self.step, self.planned_imbalance)
        self.spike_threshold = check_imbalance(spike_threshold)
        self.spike_step = require_number("spike_step", spike_step, 0, 10, low_open=True)
        if budget_quantum_bytes is None:
            budget_quantum_bytes = max(min(self.graph(c, 1.0).unmitigated_bytes for c in range(parallel.vp)) >> 10, 1)
        anchor = max(engine.memory.m_max_bytes, 1)
        self.needs = NeedGrid(budget_quantum_bytes, need_step, anchor_bytes=anchor)
        # a need above the budget: the budget grid, the gate's ratio (a coarser level gives up more of the budget)
        self.pregate_needs = NeedGrid(budget_quantum_bytes, pregate_need_step, anchor_bytes=anchor,
                                      name="pregate_need_step", budget_step=need_step)
        self.reuse_levels = require_int("reuse_levels", reuse_levels, 0)
        if not isinstance(hidden_copies, bool):
            raise ValueError(f"hidden_copies must be true or false, got {hidden_copies!r}")
        self.hidden_copies = hidden_copies
        grid = (self.step, self.spike_threshold, self.spike_step, self.needs.ratio, self.pregate_needs.ratio,
                budget_quantum_bytes, hidden_copies, self.downgrade)
        if engine.memo.enabled and engine.path_grid not in (None, grid):
            raise ValueError("engine: another decision path over this Stage uses other grid options (imbalance_step, "
                             "spike_threshold, spike_step, need_step, pregate_need_step, budget_quantum_bytes, "
                             "hidden_copies, downgrade), and "
                             "the Stage's memo holds its decisions; use the same options or another Stage")
        engine.path_grid = grid
        self._alias = engine.aliases
        memo = engine.memo
        self._cached = memo.enabled
        self._seen, self._rows = memo.table(SeenKey), memo.table(RowKey)
        self._pregate, self._pre_bytes, self._shifted = memo.table(PreGateKey), memo.table(PreBytesKey), memo.table(
            ShiftKey)
        self._pre_budget, self._levels = memo.table(PreBudgetKey), memo.table(LevelKey)
        # the engine's ids of pre-gate plans (shared by the paths over it); state, not memo: the gate decisions
        # made per need level
        self._pre_ids = engine.plan_ids
        self._outcomes: dict[tuple, Outcome] = {}
        # the decisions of forwards that needed the gate, by everything they read. A decision resting on a stand-in
        # (a nearby need level's gate decision) is listed under the family it was looked up in, (pre-gate plan,
        # bucket, chunk), and dropped when a gate decision of that family is made: the stand-in rule reads that
        # family only, and a gate decision, once made, never changes. So a hit is what deciding again would give.
        self._decisions: dict[tuple, Decision] = {}
        self._dependents: dict[tuple, list] = {}
        self.hits = self.misses = 0

    @classmethod
    def on(cls, engine: Stage, **options) -> "DecisionPath":
        """A decision path over ``engine`` (``options``: the keywords of the constructor). Paths that share an engine
        share its memo, which is keyed by what is decided, not by the grid options: a path with other grid options
        than the first over the engine is refused (``ValueError``)."""
        if not isinstance(engine, Stage):
            raise ValueError(f"engine must be a Stage, got {type(engine).__name__}")
        return cls(engine.model, engine.parallel, engine.hardware, stage=engine.stage, engine=engine, **options)

    # ---- the stage ----------------------------------------------------------------------------------------------
    def stage_plan(self) -> tuple[StageMemory, tuple[Step, ...]]:
        """The stage's memory (M_max, M0, in-flight count) and its schedule (``Stage.memory``, ``Stage.steps``)."""
        return self.engine.memory, self.engine.steps

    def graph(self, chunk: int, imbalance: float) -> OpGraph:
        return self.engine.graph(chunk, imbalance)

    def expect(self, imbalance: float, *, at_least: bool = False) -> None:
        """Before any gate of a chunk was measured, its pre-gate plans are made for ``imbalance`` (default 1.0,
        balanced): the load an operator plans for, as fixed plans are made for it. The first gate's measurement
        replaces it (the planned imbalance follows the gates); with ``at_least`` the gates only raise it (the
        pre-gate plans are never made for less: a lower rate just measured says little of the next micro-batch's
        when the operator expects this load). The gates already measured are kept."""
        if not isinstance(at_least, bool):
            raise ValueError(f"at_least must be true or false, got {at_least!r}")
        imbalance = self._check(imbalance)
        planner = PlannedImbalance(self._planner.window, self.step, self.planned_imbalance, imbalance,
                                   least=imbalance if at_least else 1.0)
        for chunk, values in sorted(self._planner.seen().items()):
            for value in values:
                planner.observe(chunk, value)
        self._planner = planner

    @property
    def warm(self) -> bool:
        """Whether a gate was measured (the planned imbalance follows the gates from then on)."""
        return any(self._planner.seen().values())

    def planned(self, chunk: int) -> float:
        """The imbalance the pre-gate plan of ``chunk`` is made for (a bucket, rounded down)."""
        return self._planner.get(chunk)

    def observe(self, chunk: int, imbalance: float) -> None:
        """Remember a gate's measurement (``forward`` does it for the imbalance it is given)."""
        self.engine.check_chunk(chunk)
        self._planner.observe(chunk, self._check(imbalance))

    def pre_gate(self, budget_bytes: int, chunk: int, *, planned: float | None = None) -> Plan:
        """The plan a running forward of ``chunk`` starts with (step 2), at the chunk's planned imbalance or
        ``planned`` (a value every expert-parallel rank agrees on); the gates then decide through
        :func:`~.gate.after_gate`. A pure function of its arguments and the gates observed."""
        budget_bytes = require_int("budget_bytes", budget_bytes, 0)
        canonical, offset = self.engine.check_chunk(chunk)
        planned = self._planner.get(chunk) if planned is None else self._check(planned)
        plan = self._pre_gate(budget_bytes, planned, canonical).plan
        if offset and plan.entries:
            plan = self._moved(plan, offset)
        return plan

    def state_dict(self) -> dict:
        """What decisions depend on besides the arguments (the gates remembered per chunk), JSON-able; the memo is
        not state, and the gate decisions per need level only choose among equally good stand-ins."""
        return {"seen": {str(chunk): list(values) for chunk, values in self._planner.seen().items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (the remembered gates are replayed in order); on a ``ValueError`` the state
        is left as it was."""
        shape = "runtime state must be {'seen': {chunk: [imbalance, ...]}}"
        try:
            items = state["seen"].items()
            seen = {int(chunk): values for chunk, values in items}
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError):
            raise ValueError(shape) from None
        planner = PlannedImbalance(self._planner.window, self.step, self.planned_imbalance, self._planner.initial)
        for chunk, values in sorted(seen.items()):
            if not isinstance(values, (list, tuple)):
                raise ValueError(f"{shape}: chunk {chunk} holds {type(values).__name__}, not a list")
            self.engine.check_chunk(chunk)
            for value in values:
                planner.observe(chunk, self._check(value))
        self._planner = planner

    # ---- the hot path ---------------------------------------------------------------------------------------------
    def forward(self, budget_bytes: int, imbalance: float, phase: str, chunk: int, *,
                limit_bytes: int | None = None) -> Decision:
        """Decision for a forward of ``chunk`` with ``budget_bytes`` whose gate measured ``imbalance``.

        ``phase`` is the forward's budget phase; in ``"warmup"`` an overrun up to ``limit_bytes`` (the caller's
        ``BudgetAssigner.absorb_limit_bytes()``) is absorbed instead of re-planned. ``phase``: ``"warmup"``,
        ``"steady"`` or a :class:`~bagualu2.budget.BudgetPhase`."""
        phase = getattr(phase, "value", phase)
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {', '.join(PHASES)} (or a BudgetPhase), got {phase!r}")
        if limit_bytes is not None:
            limit_bytes = require_int("limit_bytes", limit_bytes, 0)
        return self.decide(_At(phase, chunk), imbalance, budget_bytes, limit_bytes)

    def decide(self, step: Step, imbalance: float, budget_bytes: int, limit_bytes: int | None) -> Decision:
        """:meth:`forward` for one step of the stage's iteration driver (``run_iteration(engine, path.decide,
        imbalances)``; it reads the step's ``phase`` and ``chunk``)."""
        if type(budget_bytes) is not int or budget_bytes < 0:
            budget_bytes = require_int("budget_bytes", budget_bytes, 0)
        chunk, phase = step.chunk, step.phase
        # the memo's keys are plain numbers (True would find 1's entries): anything else is validated first
        seen = self._seen.get((imbalance, chunk)) if type(chunk) is int and type(imbalance) in (float, int) else None
        if seen is None:
            seen = self._seen_row(imbalance, chunk)  # validates the chunk and the imbalance
        planned = self._planner.observe(chunk, imbalance)  # the estimate before this gate
        if budget_bytes >= seen.unmitigated_bytes and (
                planned <= imbalance or self._pre(budget_bytes, planned, seen.chunk) is NO_PRE):
            # covered at the measured imbalance, and nothing was committed before the gate
            self.hits += 1
            covered = seen.warmup if phase == WARMUP else seen.steady
            return covered if covered is not None else self._covered(seen, phase == WARMUP, budget_bytes)
        key = (budget_bytes, imbalance, phase, planned, limit_bytes, chunk)
        found = self._decisions.get(key)
        if found is not None:
            self.hits += 1
            return found
        decision, family = self._decide(seen, budget_bytes, imbalance, phase, planned, limit_bytes)
        if self._cached:
            decisions = self._decisions
            if len(decisions) >= MAX_DECISIONS:
                decisions.clear()
                self._dependents.clear()
            decisions[key] = decision
            if family is not None:
                self._dependents.setdefault(family, []).append(key)
        return decision

    def _covered(self, seen: Seen, warm: bool, budget_bytes: int) -> Decision:
        row, chunk = seen.row, seen.chunk
        outcome = self._outcome(NO_PRE, COVERED, row, chunk, budget_bytes)[0]
        covered = Decision(outcome.plan, seen.unmitigated_bytes, outcome.overhead_s, False,
                           self._order(row.graph, NO_PLAN, chunk, warm), outcome.action)
        if warm:
            seen.warmup = covered
        else:
            seen.steady = covered
        return covered

    def _decide(self, seen: Seen, budget_bytes: int, imbalance: float, phase: str, planned: float,
                limit_bytes: int | None) -> tuple[Decision, tuple | None]:
        """A forward whose budget does not cover its unmitigated bytes: steps 2-4 of the module docstring. Returns
        the decision and, when it rests on a stand-in, the family of gate decisions it was found in."""
        row, tokens, chunk, offset = seen.row, seen.tokens, seen.chunk, seen.offset  # the canonical chunk's
        pre = self._pre(budget_bytes, planned, chunk)
        outcome = family = None
        fits = False  # does the pre-gate plan fit this budget at the measured imbalance (exact, not bucketed)?
        if pre is not NO_PRE:
            key = PreBytesKey(pre.id, row.bucket, chunk)
            split = self._pre_bytes.get(key)
            if split is None:
                split = self._pre_bytes[key] = split_bytes(row.graph, self.engine.cost(pre.plan, row.bucket, chunk))
            kept = split[0] + split[1] * tokens
            fits = kept <= budget_bytes
            if not fits and limit_bytes is not None and phase == WARMUP and self.downgrade == "graded" \
                    and kept <= limit_bytes:
                outcome = self._outcome(pre, ABSORBED, row, chunk, budget_bytes)[0]  # the next budgets shrink
        if outcome is None:
            found = self._levels.get((budget_bytes, row.bucket, chunk))
            if found is None:
                found = self._levels[LevelKey(budget_bytes, row.bucket, chunk)] = self.needs.level(
                    row.unmitigated_bytes, row.graph.floor_bytes, budget_bytes)
            level, decided = found
            outcome, family = self._outcome(pre, (KEEPABLE, level) if fits else level, row, chunk, decided,
                                            budget_bytes, tokens)
        plan = outcome.plan
        if offset and plan.entries:  # plans are moved back to this chunk's layers by ``offset``
            shifted = outcome.shifted.get(offset)
            if shifted is None:
                shifted = self._moved(plan, offset)
                if self._cached:
                    outcome.shifted[offset] = shifted
            plan = shifted
        warm = phase == WARMUP
        order = outcome.orders.get(warm)
        if order is None:
            order = self._order(outcome.graph, outcome.plan, chunk, warm)
            if self._cached:
                outcome.orders[warm] = order
        return Decision(plan, outcome.fixed_bytes + outcome.per_token_bytes * tokens, outcome.overhead_s,
                        outcome.changed, order, outcome.action), family

    def _moved(self, plan: Plan, offset: int) -> Plan:
        """``plan`` moved by ``offset`` layers (memoised: chunks sharing results share their plans)."""
        key = ShiftKey(plan.entries, offset)
        found = self._shifted.get(key)
        if found is None:
            found = self._shifted[key] = shift_plan(plan, offset)
        return found

    def _check(self, imbalance: float) -> float:
        """A measured or planned imbalance: a number in [1, min(ep, num_experts / top_k)] (one-line ``ValueError``
        otherwise)."""
        return check_imbalance(imbalance, ep=self.engine.parallel.ep, model=self.engine.model)

    def _seen_row(self, imbalance: float, chunk: int) -> Seen:
        """The :class:`Seen` of a measured imbalance on ``chunk`` (its canonical chunk's bucket row)."""
        canonical, offset = self.engine.check_chunk(chunk)
        row = self._row(imbalance, canonical)
        seen = self._seen[SeenKey(imbalance, chunk)] = Seen(row, row.graph.routed_tokens(imbalance), canonical,
                                                             offset)
        return seen

    def _row(self, imbalance: float, chunk: int) -> Row:
        """The ceiling bucket of a measured imbalance, with its graph and unmitigated cost."""
        imbalance = self._check(imbalance)
        bucket = ceil_bucket(imbalance, self.step if imbalance <= self.spike_threshold else self.spike_step,
                             self.engine.max_imbalance)
        key = RowKey(bucket, chunk)
        row = self._rows.get(key)
        if row is None:
            graph = self.graph(chunk, bucket)
            fixed, per_token = split_bytes(graph, self.engine.cost(NO_PLAN, bucket, chunk))
            row = self._rows[key] = Row(bucket, graph, graph.unmitigated_bytes, fixed, per_token)
        return row

    def _pre(self, budget_bytes: int, planned: float, chunk: int) -> PreGate:
        """:meth:`_pre_gate`, memoised by the exact budget (canonical ``chunk``)."""
        pre = self._pre_budget.get((budget_bytes, planned, chunk))
        if pre is None:
            pre = self._pre_budget[PreBudgetKey(budget_bytes, planned, chunk)] = self._pre_gate(budget_bytes, planned,
                                                                                              chunk)
        return pre

    def _pre_gate(self, budget_bytes: int, planned: float, chunk: int) -> PreGate:
        """The plan in force before the gate (step 2 of the module docstring), with its id."""
        graph = self.graph(chunk, planned)
        if budget_bytes >= graph.unmitigated_bytes:
            return NO_PRE
        level, decided = self.pregate_needs.level(graph.unmitigated_bytes, graph.floor_bytes, budget_bytes)
        key = PreGateKey(level, planned, chunk)
        found = self._pregate.get(key)  # no stand-ins: what runs before the gate cannot be undone
        if found is None:
            solution = greedy.solve(graph, decided)
            if solution.ok and self.hidden_copies:
                for window in copy_windows(self._point_ns(solution.plan, planned, chunk))[1:]:
                    solution = self._faster(solution, greedy.solve(graph, decided, config=greedy.GreedyConfig(
                        copy_window_ns=window)), planned, chunk)
                for base in prefix.BASES:  # offload-prefix candidates, timed the same way
                    solution = self._faster(solution, prefix.fit_prefix(graph, base, decided), planned, chunk)
            if not solution.ok:  # below M0 nothing fits: the least the micro-batch can keep (full recompute)
                solution = greedy.solve(graph, graph.floor_bytes)
            plan = solution.plan
            self.engine.remember_cost(plan, planned, chunk, solution.cost)  # the evaluator's, once
            if self._gate_alone_as_good(plan, graph, planned, chunk, decided):
                found = self._pregate[key] = NO_PRE
            else:
                found = self._pregate[key] = PreGate(plan, self._pre_ids.setdefault(plan.entries, len(self._pre_ids)))
        return found

    def _gate_alone_as_good(self, plan: Plan, graph: OpGraph, planned: float, chunk: int, decided: int) -> bool:
        """Whether committing nothing before the gate is as good as ``plan`` at the planned imbalance: the decided
        budget covers balanced load (whatever the gate measures, the MoE module can make room) and the gate's
        decision from nothing, at the planned imbalance, fits and runs no longer than ``plan`` (its step with
        copies priced as the path prices them, else its overhead)."""
        if decided < self.graph(chunk, 1.0).unmitigated_bytes:
            return False
        engine = self.engine
        gate = after_gate(graph, NO_PLAN, decided, downgrade=self.downgrade,
                          cost=lambda candidate: engine.cost(candidate, planned, chunk))
        if gate.cost.activation_bytes > decided or gate.cost.unavailable:
            return False
        if self.hidden_copies:
            return self._point_ns(gate.plan, planned, chunk) <= self._point_ns(plan, planned, chunk)
        return gate.cost.overhead_ns <= engine.cost(plan, planned, chunk).overhead_ns

    def _outcome(self, pre: PreGate, level, row: Row, chunk: int, decided: int, budget_bytes: int = 0,
                 tokens: int = 0) -> tuple[Outcome, tuple | None]:
        """The gate decision of a need level (made on a miss), and the family it was found in when a nearby
        level's stands in (valid for this request only), else None. ``(KEEPABLE, level)``: the level's decision
        with keeping the pre-gate plan an option (it fits the request's budget; such levels have no stand-ins)."""
        key = (pre.id, level, row.bucket, chunk)
        outcomes = self._outcomes
        found = outcomes.get(key)
        if found is not None:
            self.hits += 1
            return found, None
        if type(level) is int:
            found = self._nearby(pre, level, row, chunk, budget_bytes, tokens)
            if found is not None:
                self.hits += 1
                return found, (pre.id, row.bucket, chunk)
        self.misses += 1
        engine = self.engine
        if level == COVERED or level == ABSORBED:
            plan, action = pre.plan, GateAction.KEEP if level == COVERED else GateAction.ABSORB
        else:
            hidden = self.hidden_copies and self.downgrade == "graded"  # the paper's gate neither re-plans nor ranks
            keepable = type(level) is tuple and level[0] == KEEPABLE  # the caller found the plan in force fits
            gate = after_gate(row.graph, pre.plan, decided, downgrade=self.downgrade, keep_fits=keepable or None,
                              cost=lambda plan: engine.cost(plan, row.bucket, chunk),
                              copy_window_ns=self._point_ns(pre.plan, row.bucket, chunk) if hidden else 0,
                              duration=(lambda plan: self._point_ns(plan, row.bucket, chunk)) if hidden else None)
            plan, action = gate.plan, gate.action
            engine.remember_cost(plan, row.bucket, chunk, gate.cost)  # the evaluator's, once
        cost = engine.cost(plan, row.bucket, chunk)
        fixed, per_token = split_bytes(row.graph, cost)
        if len(outcomes) >= MAX_DECISIONS:
            outcomes.clear()
            self._decisions.clear()
            self._dependents.clear()
        # what the stand-in rule finds in this family has changed: the decisions that rested on it are dropped
        stale = self._dependents.pop((pre.id, row.bucket, chunk), ())
        for decision_key in stale:
            self._decisions.pop(decision_key, None)
        found = outcomes[key] = Outcome(plan, action, action in (GateAction.REPLAN, GateAction.DOWNGRADE),
                                         cost.overhead_s, fixed, per_token, row.graph, cost.activation_bytes)
        return found, None

    def _point_ns(self, plan: Plan, imbalance: float, chunk: int) -> int:
        """The time ``plan`` on the graph of (chunk, imbalance) takes per micro-batch of the chunk in the stage's
        schedule (``Stage.step_ns``: its steady points and the steps it runs alone, in their own orders)."""
        return self.engine.step_ns(plan, imbalance, chunk)

    def _faster(self, full, hidden, imbalance: float, chunk: int):
        """Of two solutions for one budget, the one shorter in the stage's steps (:meth:`_point_ns`; ``full``, the
        first, on a tie)."""
        if not hidden.ok or hidden.plan.entries == full.plan.entries:
            return full
        return hidden if self._point_ns(hidden.plan, imbalance, chunk) < self._point_ns(full.plan, imbalance,
                                                                                        chunk) else full

    def _nearby(self, pre: PreGate, level: int, row: Row, chunk: int, budget_bytes: int, tokens: int):
        """A decision made for a nearby need level that is as good here (the greedy's cost grows with the need):
        the nearest smaller-need decision if it fits this budget at the measured imbalance, else the nearest
        larger-need one if it fits and costs at most ``1 + need_step`` times the smaller-need one — or, with no
        smaller-need decision made, if it is at most ``UNREFERENCED_LEVELS`` levels up (made for a need at most
        ``(1 + need_step) ** UNREFERENCED_LEVELS`` times this one, or a budget at most that much smaller). Only
        levels of the request's grid are read (:class:`~.keys.NeedGrid`)."""
        outcomes, pid, bucket = self._outcomes, pre.id, row.bucket
        lower = None
        # the need grid's keys are >= 0, the budget grid's < 0 (``NeedGrid``): a stand-in is on the request's grid
        stop = level - 1 - self.reuse_levels
        for smaller in range(level - 1, max(stop, -1) if level >= 0 else stop, -1):
            lower = outcomes.get((pid, smaller, bucket, chunk))
            if lower is not None:
                if lower.fixed_bytes + lower.per_token_bytes * tokens <= budget_bytes:
                    return lower
                break
        reach = self.reuse_levels if lower is not None else min(self.reuse_levels, UNREFERENCED_LEVELS)
        end = level + 1 + reach
        for larger in range(level + 1, end if level >= 0 else min(end, 0)):
            higher = outcomes.get((pid, larger, bucket, chunk))
            if higher is not None:
                if higher.fixed_bytes + higher.per_token_bytes * tokens > budget_bytes:
                    return None
                if lower is None:  # no reference cost: made for a need at most ratio ** UNREFERENCED_LEVELS larger
                    return higher
                return higher if higher.overhead_s <= lower.overhead_s * self.needs.ratio + 1e-6 else None
        return None

    def _order(self, graph: OpGraph, plan: Plan, chunk: int, warmup: bool) -> Order:
        """The fused order of the scheduling point of a forward running ``plan`` (``Stage.point_order``); in warmup
        a plan that adds no cast and no copy runs the plain forward's point, whatever is recomputed."""
        if warmup and plan.entries and all(strategy in STAY_ON_DEVICE for _, strategy in plan.entries):
            plan = NO_PLAN
        return self.engine.point_order(plan, graph.imbalance, chunk, warmup=warmup)
