"""Roofline-guided iterative mitigation (paper §V-A, Algorithm 2) and an improved variant.

Both start from "keep everything" and move one tensor at a time (all its consumers together, so the
multi-device and multi-precision rules hold by construction) until the micro-batch fits ``budget_bytes``.
Each candidate is conflict-checked before it is applied: a recompute whose regeneration would need an input
nobody stores is rejected. Reductions and recompute costs are re-evaluated as moves are applied (recomputing
one op makes regenerating its other outputs free; dropping a tensor makes regenerating its consumers dearer).

``variant="paper"``    every tensor has one candidate, the strategy with the highest mitigation bandwidth
                       (bytes saved per second of overhead) for its size — the roofline choice of §IV-B — and
                       each iteration applies the candidate with the largest memory reduction.
``variant="improved"`` (default) every applicable strategy is a candidate (a quantised tensor may later be
                       offloaded or recomputed); each iteration takes the best bytes-per-second candidate
                       (lazy re-evaluation with a heap).
                       A candidate freeing more than is still needed is not applied but remembered as a way to
                       finish (min-knapsack style); the cheapest ending wins, then moves the budget does not
                       need are dropped.

``copy_window_ns`` (both variants; default 0, the paper's pricing) prices offload copies by what they leave
exposed: the copy engines run beside the scheduling point's compute, so the plan's device->host and host->device
copies add no time up to ``copy_window_ns`` in all, and each copy nanosecond beyond it counts in full. An offload's
cost is then the growth of the exposed copy time (lazily re-evaluated as copies accumulate).
"""

from __future__ import annotations

import heapq
import time
import weakref
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from ..costmodel import OpGraph, Plan, Strategy, resolve
from ..costmodel.evaluate import recompute_closure
from ..costmodel.validate import require_int
from .solution import Solution, SolveStatus, check_budget, check_graph, infeasible, make_solution
from .space import Space, TensorChoice, decision_space

VARIANTS = ("improved", "paper")
KEEP, RECOMPUTE, OFFLOAD, QUANTIZE = Strategy.KEEP, Strategy.RECOMPUTE, Strategy.OFFLOAD, Strategy.QUANTIZE
FINAL = (RECOMPUTE, OFFLOAD)  # strategies that free everything: no further move from them
EMPTY: frozenset = frozenset()
MAX_PRUNE_CLOSURES = 6  # recompute reverts re-derive the re-run set: bound that work

Delta = tuple[int, int, frozenset]  # (bytes freed, ns added, ops newly re-run in backward)


@dataclass(frozen=True, kw_only=True)
class GreedyConfig:
    """variant: ``improved`` or ``paper`` (see module docstring); prune: drop unneeded moves at the end;
    copy_window_ns: offload copy time (both directions, in all) hidden beside compute (module docstring; >= 0)."""

    variant: str = "improved"
    prune: bool = True
    copy_window_ns: int = 0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        if not isinstance(self.prune, bool):
            raise ValueError(f"prune must be true or false, got {self.prune!r}")
        require_int("copy_window_ns", self.copy_window_ns, 0)


def _bytes(choice: TensorChoice, strategy: Strategy) -> int:
    if strategy is KEEP:
        return choice.keep_bytes
    return choice.quantized_bytes if strategy is QUANTIZE else 0


def _copy_ns(choice: TensorChoice, strategy: Strategy) -> int:
    return choice.offload_ns if strategy is OFFLOAD else 0


def _cast_ns(choice: TensorChoice, strategy: Strategy) -> int:
    return choice.quantize_ns if strategy is QUANTIZE else 0


def _standalone_ns(choice: TensorChoice, strategy: Strategy) -> int:
    """The strategy's own cost, copies priced in full (a recompute's depends on what else is re-run)."""
    return _copy_ns(choice, strategy) + _cast_ns(choice, strategy)


class _State:
    """Tensor-level assignment with its freed bytes, overhead and the ops re-run in backward. ``movable``: the
    tensors the solver may change (None: all)."""

    def __init__(self, space: Space, movable: frozenset | None = None, window_ns: int = 0):
        self.space = space
        self.movable = movable
        self.window_ns = window_ns  # copy time hidden beside compute (GreedyConfig.copy_window_ns)
        self.chosen: dict[str, Strategy] = {}
        self.rerun: set[str] = set()
        self.freed = 0
        self.overhead_ns = 0
        self.copy_ns = 0  # the copies of the offloaded tensors, both directions
        self.start_key = None  # what identifies the start's candidates (they are cached by it: _candidates_key)

    def exposed_ns(self, copy_ns: int) -> int:
        """What ``copy_ns`` of copies add to the point's time."""
        return copy_ns - min(copy_ns, self.window_ns)

    def copy_delta_ns(self, choice: TensorChoice, current: Strategy, strategy: Strategy) -> int:
        """Added time of the copies when ``choice`` moves from ``current`` to ``strategy``."""
        after = self.copy_ns + _copy_ns(choice, strategy) - _copy_ns(choice, current)
        return self.exposed_ns(after) - self.exposed_ns(self.copy_ns)

    def stored(self, tensor: str) -> bool:
        space = self.space
        return tensor in space.pinned or (tensor in space.saved and self.chosen.get(tensor) is not RECOMPUTE)

    def recompute_ops(self, start: str) -> frozenset | None:
        """Ops to add to the re-run set if ``start`` is recomputed; None if it cannot be regenerated."""
        space = self.space
        new, unavailable = recompute_closure((start,), self.stored, space.producer.__getitem__,
                                             space.inputs.__getitem__, self.rerun)
        return None if unavailable else frozenset(new)

    def move(self, choice: TensorChoice, strategy: Strategy) -> Delta | None:
        """Delta of moving ``choice`` from its current strategy to ``strategy``; None when the candidate
        conflicts (a recompute that cannot be regenerated)."""
        current = self.chosen.get(choice.tensor, KEEP)
        freed = _bytes(choice, current) - _bytes(choice, strategy)
        added = (_cast_ns(choice, strategy) - _cast_ns(choice, current)
                 + self.copy_delta_ns(choice, current, strategy))
        if strategy is not RECOMPUTE:
            return freed, added, EMPTY
        ops = self.recompute_ops(choice.tensor)
        if ops is None:
            return None
        forward_ns = self.space.forward_ns
        return freed, added + sum(forward_ns[o] for o in ops), ops

    def closure(self) -> set[str]:
        """Least set of ops backward re-runs to regenerate every recomputed tensor (the evaluator's closure)."""
        space = self.space
        missing = [t for t, s in self.chosen.items() if s is RECOMPUTE]
        return recompute_closure(missing, self.stored, space.producer.__getitem__, space.inputs.__getitem__)[0]

    def apply(self, choice: TensorChoice, strategy: Strategy, delta: Delta) -> None:
        self.copy_ns += _copy_ns(choice, strategy) - _copy_ns(choice, self.chosen.get(choice.tensor, KEEP))
        self.chosen[choice.tensor] = strategy
        self.freed += delta[0]
        self.overhead_ns += delta[1]
        self.rerun |= delta[2]

    def may_move(self, tensor: str) -> bool:
        return self.movable is None or tensor in self.movable


def rerun_ops(space: Space, chosen: dict[str, Strategy]) -> set[str]:
    """Ops backward re-runs for a tensor-level assignment (the evaluator's least closure)."""
    state = _State(space)
    state.chosen = dict(chosen)
    return state.closure()


def tensor_strategies(graph: OpGraph, plan: Plan | None) -> dict[str, Strategy]:
    """``plan`` as one strategy per mitigated tensor (KEEP omitted); ``ValueError`` if two consumers of one tensor
    disagree (such a plan is not in the solvers' conflict-free space)."""
    found: dict[str, Strategy] = {}
    for (op_name, tensor), strategy in resolve(graph, plan).items():
        if (op_name, tensor) in graph.pinned:
            continue
        if found.setdefault(tensor, strategy) is not strategy:
            raise ValueError(f"fixed plan gives the consumers of tensor {tensor!r} different strategies "
                             f"({found[tensor].value}, {strategy.value}); allowed: one strategy per tensor")
    return {tensor: strategy for tensor, strategy in found.items() if strategy is not KEEP}


_STARTS: "weakref.WeakKeyDictionary[Space, dict]" = weakref.WeakKeyDictionary()


def _start(space: Space, graph: OpGraph, fixed: Plan | None, free, window_ns: int = 0) -> _State:
    """The state the solver starts from: ``fixed``'s strategies on the tensors outside ``free``, KEEP elsewhere
    (built once per space, start and copy window; each solve works on a copy)."""
    if fixed is None and free is None:
        state = _State(space, window_ns=window_ns)
        state.start_key = (None, None, window_ns) if window_ns else None
        return state
    movable = None if free is None else frozenset(free)
    key = (None if fixed is None else fixed.entries, movable, window_ns)
    memo = _STARTS.setdefault(space, {})
    found = memo.get(key)
    if found is None:
        built = _fixed_start(space, graph, fixed, movable, window_ns)
        found = memo[key] = _Start(built.movable, built.chosen, frozenset(built.rerun), built.freed,
                                   built.overhead_ns, built.copy_ns, _candidates_key(built))
    state = _State(space, found.movable, window_ns)
    state.chosen, state.rerun = dict(found.chosen), set(found.rerun)
    state.freed, state.overhead_ns, state.start_key = found.freed, found.overhead_ns, found.start_key
    state.copy_ns = found.copy_ns
    return state


class _Start(NamedTuple):
    """A start as the memo keeps it: the state's values without its space (a value that held the space would keep
    the memo's weak key, and every space with it, alive)."""

    movable: frozenset | None
    chosen: dict
    rerun: frozenset
    freed: int
    overhead_ns: int
    copy_ns: int
    start_key: tuple


def _fixed_start(space: Space, graph: OpGraph, fixed: Plan | None, movable: frozenset | None,
                 window_ns: int = 0) -> _State:
    state = _State(space, movable, window_ns)
    if fixed is None:
        return state
    strategies = tensor_strategies(graph, fixed)
    for choice in space.choices:
        strategy = strategies.get(choice.tensor)
        if strategy is None or (movable is not None and choice.tensor in movable):
            continue
        state.chosen[choice.tensor] = strategy
        state.freed += choice.keep_bytes - _bytes(choice, strategy)
        state.overhead_ns += _cast_ns(choice, strategy)
        state.copy_ns += _copy_ns(choice, strategy)
    state.rerun = state.closure()
    state.overhead_ns += sum(space.forward_ns[o] for o in state.rerun) + state.exposed_ns(state.copy_ns)
    if movable is None:
        state.movable = frozenset()  # everything is fixed
    return state


def _candidates_key(state: _State) -> tuple:
    """What the first candidates of a start with a movable set depend on (:func:`_improved` caches them by it):
    the movable tensors (all at KEEP), the copy window and, under a window, the copies already made (an offload's
    cost then depends on them; without one they only ride along in the heap entries, never read), and what the
    recompute walks from the movable tensors can see of the fixed part: which tensors on their way are recomputed
    (not stored) and which ops on it already re-run (:func:`_walk_reach`). Two starts that agree on these give
    every movable tensor the same deltas, so the same initial heap."""
    tensors, ops = _walk_reach(state.space, state.movable)
    recomputed = frozenset(t for t in tensors if state.chosen.get(t) is RECOMPUTE)
    return (state.movable, state.window_ns, state.copy_ns if state.window_ns else None, recomputed,
            frozenset(state.rerun & ops))


def _walk_reach(space: Space, movable: frozenset) -> tuple[frozenset, frozenset]:
    """The tensors outside ``movable`` that a recompute walk from a tensor in ``movable`` may ask whether they are
    stored, and the ops it may ask whether they re-run already, whatever the other tensors' strategies: the walk of
    :func:`recompute_closure` with only the pinned tensors stored (built once per space and movable set)."""
    memo = _STARTS.setdefault(space, {})
    key = ("reach", movable)
    found = memo.get(key)
    if found is None:
        tensors, ops = set(movable), set()
        work = list(movable)
        while work:
            producer = space.producer[work.pop()]
            if producer is None or producer in ops:
                continue
            ops.add(producer)
            for source in space.inputs[producer]:
                if source not in tensors and source not in space.pinned:
                    tensors.add(source)
                    work.append(source)
        found = memo[key] = (frozenset(tensors - movable), frozenset(ops))
    return found


def solve(graph: OpGraph, budget_bytes: int, *, config: GreedyConfig | None = None, fixed: Plan | None = None,
          free=None) -> Solution:
    """Plan that keeps at most ``budget_bytes`` of activations for ``graph``, by greedy selection.

    A partial solve (the runtime's re-plan after the MoE gate): ``free`` names the tensors the solver may change,
    starting from KEEP; every other tensor keeps its strategy in ``fixed`` (default KEEP; one strategy per tensor,
    else ``ValueError``). With ``fixed`` alone nothing may change: the result is ``fixed`` if it fits (as
    per-tensor entries: a kind policy comes back spelt out tensor by tensor, with the same strategies).
    """
    started = time.perf_counter()
    check_graph(graph)
    budget_bytes = check_budget(budget_bytes)
    fixed = Plan.coerce(fixed)
    if config is not None and not isinstance(config, GreedyConfig):
        raise ValueError(f"config must be a GreedyConfig or None, got {type(config).__name__}")
    if free is not None:
        if isinstance(free, str) or not isinstance(free, Iterable):
            raise ValueError(f"free must be a collection of tensor names, got {type(free).__name__}")
        free = tuple(free)
        if not all(isinstance(t, str) for t in free):
            raise ValueError("free must be a collection of tensor names (strings)")
        free = frozenset(free)
        unknown = sorted(str(t) for t in free if t not in graph.tensors)
        if unknown:
            raise ValueError(f"free names tensors the graph does not have: {', '.join(unknown[:3])}")
    config = config or GreedyConfig()
    name = f"greedy-{config.variant}"
    if budget_bytes < graph.floor_bytes:
        return infeasible(graph, budget_bytes, name, started, time.perf_counter())
    space = decision_space(graph)
    need = graph.unmitigated_bytes - budget_bytes
    state = _start(space, graph, fixed, free, config.copy_window_ns)
    if need > state.freed:
        state = _paper(state, space, need) if config.variant == "paper" else _improved(state, space, need)
        if config.prune and state.freed >= need:
            _prune(state, space, need)
    stats = {"moves": len(state.chosen), "estimated_overhead_ns": state.overhead_ns}
    if state.freed < need:  # only on graphs whose inputs are not pinned: some tensors cannot be regenerated
        return make_solution(graph, space.plan(state.chosen), SolveStatus.INFEASIBLE, name, started,
                             time.perf_counter(), stats, reason="no conflict-free candidate is left and the "
                             f"plan still keeps {graph.unmitigated_bytes - state.freed} > {budget_bytes} bytes")
    status = SolveStatus.OPTIMAL if need <= 0 and not state.chosen else SolveStatus.FEASIBLE
    return make_solution(graph, space.plan(state.chosen), status, name, started, time.perf_counter(), stats)


# per space: the candidates of a start, by start (None: all KEEP; else what they depend on, _candidates_key)
_INITIAL: "weakref.WeakKeyDictionary[Space, dict]" = weakref.WeakKeyDictionary()


def _improved(state: _State, space: Space, need: int) -> _State:
    version = {c.tensor: 0 for c in space.choices}
    epoch = 0  # bumps on every recompute move
    dirty: list[frozenset] = []  # dirty[e]: ops whose re-run cost the move ending epoch e may have changed
    by_name = {c.tensor: c for c in space.choices}
    counter = 0
    heappush, heappop = heapq.heappush, heapq.heappop

    def push(choice: TensorChoice, strategy: Strategy) -> None:
        nonlocal counter
        if state.chosen.get(choice.tensor) in FINAL or not state.may_move(choice.tensor):
            return
        delta = state.move(choice, strategy)
        if delta is None or delta[0] <= 0:
            return
        counter += 1
        heappush(heap, (-delta[0] / max(delta[1], 1), -delta[0], counter, choice, strategy,
                        version[choice.tensor], epoch, state.copy_ns, delta))

    starts = _INITIAL.setdefault(space, {})
    initial = starts.get(state.start_key)
    if initial is None:  # a start is the same for every budget: build its candidates once
        heap: list = []
        for choice in space.choices:
            for strategy in choice.strategies:
                push(choice, strategy)
        initial = starts[state.start_key] = list(heap)
    heap = list(initial)
    counter = len(heap)
    history: list[tuple[TensorChoice, Strategy, Delta]] = []
    best_end: tuple[int, int, tuple] | None = None  # (overhead, moves kept, finishing move)
    # a lower bound on the overhead of any state reachable from here: moves only add overhead, except moving a
    # tensor quantised by this solve on (at most its cast saved, once); above the best ending, nothing can win
    refundable_ns = 0
    while state.freed < need and heap:
        if best_end is not None and state.overhead_ns - refundable_ns > best_end[0]:
            break  # the ending below is taken whatever else is popped (same result as draining the heap)
        _, _, _, choice, strategy, seen_version, seen_epoch, seen_copy_ns, delta = heappop(heap)
        if seen_version != version[choice.tensor]:
            continue  # the tensor moved since
        if strategy is OFFLOAD and state.window_ns and seen_copy_ns != state.copy_ns:
            push(choice, strategy)  # the copies since left less of the window: re-evaluate lazily
            continue
        if strategy is RECOMPUTE and seen_epoch != epoch and \
                any(delta[2] & changed for changed in dirty[seen_epoch:]):
            push(choice, strategy)  # its regeneration cost changed: re-evaluate lazily
            continue
        if delta[0] > need - state.freed:  # overshoots: only ever a way to finish from here
            total = state.overhead_ns + delta[1]
            if best_end is None or total < best_end[0]:
                best_end = (total, len(history), (choice, strategy, delta))
            continue
        if state.chosen.get(choice.tensor) is QUANTIZE:
            refundable_ns -= choice.quantize_ns
        state.apply(choice, strategy, delta)
        history.append((choice, strategy, delta))
        version[choice.tensor] += 1
        if strategy is QUANTIZE:  # a quantised tensor may still be offloaded or recomputed
            refundable_ns += choice.quantize_ns
            push(choice, OFFLOAD)
            if RECOMPUTE in choice.strategies:
                push(choice, RECOMPUTE)
        elif strategy is RECOMPUTE:
            epoch += 1
            dirty.append(delta[2] | frozenset(space.readers.get(choice.tensor, ())))
            # tensors these re-run ops produce now regenerate for free; pushed in program order (the push
            # counter breaks ties, and a set's order would follow the string hash seed)
            for op in sorted(delta[2], key=space.position.__getitem__):
                for produced in space.produces.get(op, ()):
                    push(by_name[produced], RECOMPUTE)
    if best_end is not None and (state.freed < need or best_end[0] < state.overhead_ns):
        state = _restart(state, history)
        for move in history[:best_end[1]]:
            state.apply(*move)
        state.apply(*best_end[2])
    return state


def _restart(state: _State, history: list) -> _State:
    """``state`` as it was before its first move (movable tensors start at KEEP; the fixed ones never move)."""
    fresh = _State(state.space, state.movable, state.window_ns)
    moved = {choice.tensor for choice, _, _ in history}
    fresh.chosen = {t: s for t, s in state.chosen.items() if t not in moved}
    fresh.freed = state.freed - sum(d[0] for _, _, d in history)
    fresh.overhead_ns = state.overhead_ns - sum(d[1] for _, _, d in history)
    by_name = {c.tensor: c for c in state.space.choices}
    fresh.copy_ns = sum(_copy_ns(by_name[t], s) for t, s in fresh.chosen.items())
    fresh.rerun = fresh.closure()
    return fresh


def _paper(state: _State, space: Space, need: int) -> _State:
    roofline = {}
    for choice in space.choices:  # the time-minimising strategy for this tensor's size
        if not state.may_move(choice.tensor):
            continue
        options = [(delta[1] / delta[0], strategy) for strategy in choice.strategies
                   if (delta := state.move(choice, strategy)) is not None and delta[0] > 0]
        if options:
            roofline[choice.tensor] = min(options, key=lambda o: o[0])[1]
    while state.freed < need:
        best = None
        for choice in space.choices:
            strategy = roofline.get(choice.tensor)
            if strategy is None or choice.tensor in state.chosen:
                continue
            delta = state.move(choice, strategy)  # conflict check: None when it cannot be regenerated
            if delta is not None and delta[0] > 0 and (best is None or delta[0] > best[2][0]):
                best = (choice, strategy, delta)
        if best is None:  # roofline candidates exhausted: recompute what is still kept
            for choice in space.choices:
                if state.may_move(choice.tensor) and state.chosen.get(choice.tensor) not in FINAL \
                        and (delta := state.move(choice, RECOMPUTE)) is not None and delta[0] > 0:
                    state.apply(choice, RECOMPUTE, delta)
                    if state.freed >= need:
                        break
            break
        state.apply(*best)
    return state


def _prune(state: _State, space: Space, need: int) -> None:
    """Revert moves (the largest saving first) while the budget still holds and the overhead drops."""
    by_name = {c.tensor: c for c in space.choices}

    def saving(tensor: str) -> tuple[int, int]:  # what reverting saves (a hidden copy: nothing), then its full cost
        choice, strategy = by_name[tensor], state.chosen[tensor]
        return (state.copy_delta_ns(choice, strategy, KEEP) - _cast_ns(choice, strategy),
                -_standalone_ns(choice, strategy))

    order = sorted((t for t in state.chosen if state.may_move(t)), key=saving)
    closures_left = MAX_PRUNE_CLOSURES
    for tensor in order:
        choice, strategy = by_name[tensor], state.chosen[tensor]
        freed = choice.keep_bytes - _bytes(choice, strategy)
        if state.freed - freed < need:
            continue
        if strategy is not RECOMPUTE:  # stored either way: the re-run set does not change
            state.freed -= freed
            state.overhead_ns -= _cast_ns(choice, strategy) - state.copy_delta_ns(choice, strategy, KEEP)
            state.copy_ns -= _copy_ns(choice, strategy)
            del state.chosen[tensor]
            continue
        producer = space.producer[tensor]
        if closures_left == 0 or any(state.chosen.get(t) is RECOMPUTE for t in space.produces.get(producer, ())
                                     if t != tensor):
            continue  # a sibling keeps its producer re-running: reverting saves nothing
        closures_left -= 1
        del state.chosen[tensor]
        rerun = state.closure()
        before = sum(space.forward_ns[o] for o in state.rerun)
        after = sum(space.forward_ns[o] for o in rerun)
        if after < before:
            state.freed -= freed
            state.overhead_ns += after - before
            state.rerun = rerun
        else:
            state.chosen[tensor] = strategy
