"""The one after-gate decision (§V-A "Deferred Planning"): what a micro-batch runs once its MoE gate has measured
the imbalance. The decision path of the simulator, the trainer and ``exec``'s deferred planner all call
:func:`after_gate`; nothing else decides.

What exists before the MoE module (attention, the module input) stays as planned. The module itself is still free:
what it makes after its router (permute, dispatch, experts, combine, unpermute, shared expert) has not been
made yet, and what its norm and router made can still be re-run in backward from the module input. With the graph
built at the measured imbalance:

* ``keep``      the plan in force fits the budget and nothing after the router is cheaper;
* ``absorb``    (warmup only, when the caller passes ``limit_bytes``) the plan in force overruns the budget but
                keeps at most ``limit_bytes`` (what still leaves ``M0`` for every not-yet-launched warmup
                batch): accepted, the next budgets shrink (paper §V-A);
* ``replan``    graded re-planning: greedy over the tensors of the MoE module (:func:`gate_free_tensors`: made
                by the norm feeding the router, the router and after it, and what only ops after the router keep
                that no op makes), the rest fixed, at the measured imbalance — the cheapest plan of that part
                that fits;
* ``downgrade`` the paper's full MoE-module recompute (every tensor made after the router RECOMPUTE; what an op
                after the router keeps that no op makes, on a traced graph, OFFLOAD): the fallback when nothing
                cheaper fits, and the only option with ``downgrade="paper"``.

Among the options that fit, the cheapest (``PlanCost.overhead_ns``) wins, so a re-plan never costs more than the
full downgrade and fits whenever it does. When nothing fits the full downgrade is returned (an overrun the caller
records). A downgrade that would re-run an op whose outputs nothing can regenerate (``PlanCost.unavailable``: on a
traced graph, a router that draws random numbers) is no option: the plan in force stays. ``downgrade="paper"`` is the behaviour before graded re-planning: keep if it fits, else downgrade.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

from ..costmodel import OpGraph, Plan, PlanCost, Strategy, evaluate
from ..costmodel.graph import MOE_KINDS
from ..costmodel.validate import require_int
from ..mitigation import greedy
from ..mitigation.solution import check_graph

DOWNGRADES = ("graded", "paper")


class GateAction(str, enum.Enum):
    KEEP = "keep"
    ABSORB = "absorb"
    REPLAN = "replan"
    DOWNGRADE = "downgrade"


@dataclass(frozen=True)
class GateDecision:
    """The plan a micro-batch runs after its gate, why, and its cost on the graph it was decided on."""

    plan: Plan
    action: GateAction
    cost: PlanCost

    @property
    def changed(self) -> bool:
        """Did the gate change the plan in force (a re-plan or a downgrade)?"""
        return self.action in (GateAction.REPLAN, GateAction.DOWNGRADE)


def check_downgrade(downgrade: str) -> str:
    if downgrade not in DOWNGRADES:
        raise ValueError(f"downgrade must be one of {', '.join(DOWNGRADES)}, got {downgrade!r}")
    return downgrade


_AFTER: "weakref.WeakKeyDictionary[OpGraph, dict]" = weakref.WeakKeyDictionary()


def layers_key(layers) -> tuple[int, ...] | None:
    """``layers`` (None: all, or a collection of layer numbers) as a sorted tuple; one ``ValueError`` otherwise."""
    if layers is None:
        return None
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Iterable):
        raise ValueError(f"layers must be a collection of layer numbers or None, got {type(layers).__name__}")
    layers = tuple(layers)
    if not all(type(layer) is int for layer in layers):
        layers = tuple(require_int("layers", layer, 0) for layer in layers)
    return tuple(sorted(set(layers)))


def after_router_tensors(graph: OpGraph, layers=None) -> frozenset[str]:
    """Tensors made by the MoE ops that run after the router (of ``layers``, default all), in program order: what
    the gate may still re-plan. A MoE op of the layer that runs before its router (a shared expert some models
    compute first) has stored its tensors already. ``ValueError`` for a layer with no MoE module."""
    check_graph(graph)
    memo = _AFTER.setdefault(graph, {})
    key = layers_key(layers)
    found = memo.get(key)
    if found is None:
        moe_layers = {op.layer for op in graph.ops if op.kind == "router"}
        if key is not None:
            for layer in key:
                if layer not in moe_layers:
                    raise ValueError(f"layer {layer} is not a MoE layer of this graph ({graph.label})")
        wanted = moe_layers if key is None else set(key)
        makers, routed = set(), set()  # routed: the layers whose router has run
        for op in graph.ops:
            if op.kind == "router":
                routed.add(op.layer)
            elif op.kind in MOE_KINDS and op.layer in wanted and op.layer in routed:
                makers.add(op.name)
        found = memo[key] = frozenset(name for name, spec in graph.tensors.items() if spec.producer in makers)
    return found


def unmade_after_router(graph: OpGraph, layers=None) -> frozenset[str]:
    """Tensors no op makes (on a traced graph: what an op that can never re-run keeps, e.g. the rows a grouped GEMM
    casts for itself) that only MoE ops after the router (of ``layers``, default all) save: not stored yet when
    the gate decides, never recomputable, so the gate may still offload them."""
    check_graph(graph)
    memo = _AFTER.setdefault(graph, {})
    key = ("unmade", layers_key(layers))
    found = memo.get(key)
    if found is None:
        after_router_tensors(graph, layers)  # refuses a layer with no MoE module
        wanted, routed, savers = key[1], set(), set()
        for op in graph.ops:
            if op.kind == "router":
                routed.add(op.layer)
            elif op.kind in MOE_KINDS and op.layer in routed and (wanted is None or op.layer in wanted):
                savers.add(op.name)
        found = memo[key] = frozenset(  # one a pinned saving keeps on the device would be copied for nothing
            name for name, spec in graph.tensors.items()
            if spec.producer is None and graph.consumers(name)
            and all(saver in savers and (saver, name) not in graph.pinned for saver, _ in graph.consumers(name)))
    return found


def gate_free_tensors(graph: OpGraph, layers=None) -> frozenset[str]:
    """What the graded re-plan may change after the gate of ``layers`` (default all MoE layers): the tensors of the
    whole MoE module — made by the norm that feeds the router, by the router and after it (one the norm or the
    router made that an op before the router already stored, a shared expert some models run first, is not),
    and those no op makes that only ops after the router keep (:func:`unmade_after_router`: offload only).
    Their ops either have not run yet or have just run and can still be re-run in backward from the module input
    (the paper's "full recompute of the MoE module" restarts from there), and what no op makes is stored only
    after the gate; ``exec`` holds the savings of the norm and the router provisionally until the gate settles
    them."""
    check_graph(graph)
    memo = _AFTER.setdefault(graph, {})
    key = ("module", layers_key(layers))
    found = memo.get(key)
    if found is None:
        after = after_router_tensors(graph, layers)
        wanted = {graph.op(spec.producer).layer for spec in graph.tensors.values()
                  if spec.producer is not None and spec.name in after}
        position, router_of = {}, {}  # router_of: a module op (router, norm feeding it) -> its router's position
        for index, op in enumerate(graph.ops):
            position[op.name] = index
            if op.kind == "router" and op.layer in wanted:
                router_of[op.name] = index
                for t in op.inputs:
                    producer = graph.tensors[t].producer
                    if producer is not None and graph.op(producer).kind == "norm":
                        router_of.setdefault(producer, index)

        # a module op that makes no tensor (a router that drew random numbers: its outputs have no producer) is
        # never re-run, so exec cannot hold its savings for the gate: what it saved stays as the plan in force said
        making = {spec.producer for spec in graph.tensors.values() if spec.producer is not None}

        def held(tensor: str) -> bool:  # every saving of it is held for the gate or made after its router
            router = router_of[graph.tensors[tensor].producer]
            return all((saver in router_of and saver in making) or position[saver] > router
                       for saver, _ in graph.consumers(tensor))

        found = memo[key] = after | unmade_after_router(graph, layers) | frozenset(
            name for name, spec in graph.tensors.items() if spec.producer in router_of and held(name))
    return found


def downgrade_plan(graph: OpGraph, plan: Plan | None = None, *, layers=None) -> Plan:
    """``plan`` with the MoE modules of ``layers`` (default: all) downgraded after their gate: every saving of a
    tensor made by a MoE op after the router set to RECOMPUTE, and of one no op makes that only ops after the
    router save (:func:`unmade_after_router`, which nothing can recompute) to OFFLOAD; pinned savings stay."""
    check_graph(graph)
    plan = Plan.coerce(plan)
    memo = _AFTER.setdefault(graph, {})  # a pure function of its arguments: the gate asks again at every need level
    key = ("downgrade", None if plan is None else plan.entries, layers_key(layers))
    found = memo.get(key)
    if found is None:
        after, unmade = after_router_tensors(graph, layers), unmade_after_router(graph, layers)
        entries = dict(plan.entries) if plan is not None else {}
        for op, saving in graph.savings:
            if (op.name, saving.tensor) in graph.pinned:
                continue
            if saving.tensor in after:
                entries[f"{op.name}/{saving.tensor}"] = Strategy.RECOMPUTE
            elif saving.tensor in unmade:
                entries[f"{op.name}/{saving.tensor}"] = Strategy.OFFLOAD
        found = memo[key] = Plan(tuple(entries.items()))
    return found


def copy_windows(window_ns: int) -> tuple[int, ...]:
    """The copy windows a plan is made with when copies hidden up to ``window_ns`` are free: 0 (every copy priced
    in full), then ``window_ns`` and half of it (the copies a point can hide are fewer than its time: they overlap
    only the stages beside them, so the whole window prices too many of them as free); without a window, 0."""
    return tuple(dict.fromkeys((0, window_ns, window_ns // 2)))  # in that order, each once


def after_gate(graph: OpGraph, plan: Plan | None, budget_bytes: int, *, limit_bytes: int | None = None,
               downgrade: str = "graded", layers=None, downgrade_layers=None, cost=None,
               copy_window_ns: int = 0, duration=None, keep_fits: bool | None = None) -> GateDecision:
    """The plan to run once the gate has routed this micro-batch (see the module docstring).

    ``graph`` is built at the measured imbalance; ``plan`` is the plan in force; ``budget_bytes`` the micro-batch's
    budget; ``limit_bytes`` (warmup only) the most an overrun may keep; ``layers`` the MoE layers whose modules the
    re-plan may change (default all: the gate of the chunk's first MoE layer); ``downgrade_layers`` those the full
    downgrade covers (default ``layers``; the running model downgrades only the module whose gate fired); ``cost``,
    optional,
    a memo of ``evaluate(graph, ·)`` (the runtime's cache; it must return exactly what ``evaluate`` does);
    ``copy_window_ns`` > 0: the re-plan is also made with copies priced by what they leave exposed beyond that much
    copy time and beyond half of it (:func:`copy_windows`; ``greedy.GreedyConfig.copy_window_ns``); ``duration``,
    optional: the time of a plan's step (e.g. its scheduling point's fused order), which then ranks the options
    instead of their overhead when one of them offloads (without copies the overhead ranks them, as without
    ``duration``); ``keep_fits``, optional: whether the plan in force fits the micro-batch's budget as the caller
    measured it exactly (the runtime's path checks it at the measured token count; ``budget_bytes`` is then the
    budget its need level decides for, which the re-plan fits), instead of its cost against ``budget_bytes``.
    """
    check_graph(graph)
    plan = Plan.coerce(plan)
    budget_bytes = require_int("budget_bytes", budget_bytes, 0)
    if limit_bytes is not None:
        limit_bytes = require_int("limit_bytes", limit_bytes, 0)
    check_downgrade(downgrade)
    window_ns = require_int("copy_window_ns", copy_window_ns, 0)
    plan = plan if plan is not None else Plan()
    if cost is not None and not callable(cost):
        raise ValueError(f"cost must be a callable (plan -> PlanCost) or None, got {type(cost).__name__}")
    if duration is not None and not callable(duration):
        raise ValueError(f"duration must be a callable (plan -> ns) or None, got {type(duration).__name__}")
    cost = cost if cost is not None else (lambda candidate: evaluate(graph, candidate))
    in_force = cost(plan)
    if keep_fits is not None and not isinstance(keep_fits, bool):
        raise ValueError(f"keep_fits must be true, false or None, got {keep_fits!r}")
    fits = in_force.activation_bytes <= budget_bytes if keep_fits is None else keep_fits
    keep = GateDecision(plan, GateAction.KEEP, in_force)
    if downgrade == "paper":
        if fits:
            return keep
        full = downgrade_plan(graph, plan, layers=layers if downgrade_layers is None else downgrade_layers)
        if full == plan:  # nothing after a router to downgrade (no MoE layer, or all of it recomputed already)
            return keep
        downgraded = GateDecision(full, GateAction.DOWNGRADE, cost(full))
        return keep if downgraded.cost.unavailable else downgraded
    if not fits and limit_bytes is not None and in_force.activation_bytes <= limit_bytes:
        return GateDecision(plan, GateAction.ABSORB, in_force)
    full = downgrade_plan(graph, plan, layers=layers if downgrade_layers is None else downgrade_layers)
    downgraded = GateDecision(full, GateAction.DOWNGRADE, cost(full)) if full != plan else keep
    if downgraded.cost.unavailable:  # a re-run would need a tensor nothing regenerates (a traced random router)
        downgraded = keep
    options = [downgraded]
    for window in copy_windows(window_ns):
        try:
            replanned = greedy.solve(graph, budget_bytes, fixed=plan, free=gate_free_tensors(graph, layers),
                                     config=greedy.GreedyConfig(copy_window_ns=window) if window else None)
        except ValueError:  # the plan in force is not one strategy per tensor: only the full downgrade applies
            break
        if replanned.ok and not replanned.cost.unavailable and (
                not window or all(replanned.plan.entries != o.plan.entries for o in options)):
            options.append(GateDecision(replanned.plan, GateAction.REPLAN, replanned.cost))
    if fits and downgraded is not keep:
        options.append(keep)
    fitting = [o for o in options if (fits if o is keep else o.cost.activation_bytes <= budget_bytes)]
    if not fitting:
        return options[0]
    # cheapest first; on a tie prefer keeping, then the re-plan, then the downgrade
    rank = {GateAction.KEEP: 0, GateAction.REPLAN: 1, GateAction.DOWNGRADE: 2}
    if duration is not None and any(o.cost.offload_ns for o in fitting):  # copies: their overhead misprices them
        return min(fitting, key=lambda o: (duration(o.plan), o.cost.overhead_ns, rank[o.action]))
    return min(fitting, key=lambda o: (o.cost.overhead_ns, rank[o.action]))
