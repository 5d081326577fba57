"""The fused dual-batch DP (paper §V-B) over prefixes of the F, B, O and R chains.

``best[i, j, k, l]`` is the shortest time to run the first i, j, k, l stages of F, B, O, R. A transition runs one
group: the next stage of any non-empty subset of the chains, started together behind a barrier; its time ``T`` is
the busiest resource of the group (stages on the same resource serialise, different resources overlap), with
``share`` > 0 compute slowed while communication runs beside it (:mod:`.interference`). The transfer points
rebuild the order; a transition only extends prefixes, so no chain is ever permuted.

After compaction there are ``(|F|+1)(|B|+1)(|O|+1)(|R|+1)`` states and up to 15 transitions each (only those
advancing non-empty chains); the states are laid out and processed by anti-diagonal level (a transition lowers
the level by 1 to 4) with numpy, one vector step per level. The transfer points are not stored: walking back from
the last state, each state's first minimising transition is recomputed from the table of best times.

The table takes about a kilobyte per state, so it is bounded: chains with more than ``MAX_STATES`` states
(long chunks: over ~30 layers with many copies) are ordered in two steps instead, F and B by the DP with O and R
at the point's edges (:func:`with_edges`; Megatron-Core's combined 1F1B where even F and B exceed it), and the
fastest of that and the baseline orders of the same chains is taken (:func:`bounded`). Layouts are cached per
shape up to ``CACHED_STATES`` states in all.

At pipeline degree 2 the offload and the recovery copy the same micro-batch: the DP orders F and B, and O and R
run at the point's edges (:func:`with_edges`). At degree 1 (no pipeline, F_(y+1) beside B_y) the copies are the
micro-batches' own and run beside their own F and B (:func:`with_own_copies`).
"""

from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np

from ..costmodel import Resource
from ..costmodel.validate import require_int
from .baselines import BASELINES, combined_1f1b_groups, sequential, with_copies
from .chains import CHAIN_KINDS, Chains, check_chains
from .interference import check_share, makespan_ns, slowed_compute
from .order import Order
from .simulate import simulate

RESOURCES = tuple(Resource)
RESOURCE_INDEX = {r: i for i, r in enumerate(RESOURCES)}
COMPUTE, COMM = RESOURCE_INDEX[Resource.COMPUTE], RESOURCE_INDEX[Resource.COMM]
INF = np.int64(1) << 62
MASKS = tuple(range(1, 16))  # bit c set: chain CHAIN_KINDS[c] advances by one stage
MAX_STATES = 1 << 17  # states of one DP table (~1 KiB each while it is solved)
CACHED_STATES = 1 << 19  # states of the layouts kept between solves, all shapes together


class _ShapeCache:
    """Least-recently-used values per state-grid shape, holding at most ``CACHED_STATES`` states in all."""

    def __init__(self, make):
        self.make, self.entries, self.states = make, OrderedDict(), 0

    def __call__(self, shape: tuple[int, int, int, int]):
        found = self.entries.get(shape)
        if found is not None:
            self.entries.move_to_end(shape)
            return found
        found = self.entries[shape] = self.make(shape)
        self.states += math.prod(shape)
        while self.states > CACHED_STATES and len(self.entries) > 1:
            evicted, _ = self.entries.popitem(last=False)
            self.states -= math.prod(evicted)
        return found


def _make_levels(shape: tuple[int, int, int, int]):
    """The state grid of ``shape`` laid out by level (a position per state, level by level, each level in flat
    index order) and the masks that can ever apply (those advancing only non-empty chains; any other mask has no
    valid predecessor anywhere, so dropping it changes neither the minimum nor the first mask reaching it).

    Returns ``(masks, coords, levels, prev)``: ``coords[c, p]`` chain c's prefix length at position p; ``levels``
    a list of ``(lo, hi, prev[:, lo:hi])`` for levels 1, 2, ...; ``prev[m, p]`` the position before mask
    ``masks[m]`` ran (``size`` if invalid).
    """
    size = math.prod(shape)
    masks = tuple(mask for mask in MASKS if all(shape[c] > 1 for c in range(4) if (mask >> c) & 1))
    flat = np.indices(shape, dtype=np.int64).reshape(4, size)  # (4, size): prefix lengths in flat index order
    level = flat.sum(axis=0)
    order = np.argsort(level, kind="stable")  # position -> flat index
    position = np.empty(size + 1, dtype=np.int64)
    position[order] = np.arange(size)
    position[size] = size  # the sentinel stays the sentinel
    coords = flat[:, order]
    bits = np.array([[(mask >> c) & 1 for c in range(4)] for mask in masks], dtype=np.int64).reshape(-1, 4)
    strides = np.array([math.prod(shape[c + 1:]) for c in range(4)], dtype=np.int64)
    valid = np.ones((len(masks), size), dtype=bool)  # (masks, size): every chain the mask advances has begun
    for c in range(4):
        valid &= coords[c] >= bits[:, c, None]
    prev = np.where(valid, position[np.where(valid, order - (bits @ strides)[:, None], size)], size)
    counts = np.bincount(level, minlength=1)
    bounds = np.cumsum(counts).tolist()
    # each level's predecessors as their own contiguous block: the gather of the level loop is ~20% faster
    levels = [(lo, hi, np.ascontiguousarray(prev[:, lo:hi])) for lo, hi in zip(bounds, bounds[1:])]
    for array in (coords, prev, *(before for _, _, before in levels)):
        array.flags.writeable = False
    return masks, coords, levels, prev


def _make_walk_tables(shape: tuple[int, int, int, int]) -> tuple[list[list[int]], list[list[int]]]:
    """``_levels(shape)``'s ``prev`` and ``coords`` as Python lists per position (``prev_at[p][m]``,
    ``coords_at[p][c]``): the walk back visits one position at a time, where list indexing beats numpy's."""
    _, coords, _, prev = _levels(shape)
    return prev.T.tolist(), coords.T.tolist()


_levels = _ShapeCache(_make_levels)
_walk_tables = _ShapeCache(_make_walk_tables)


def _group_times(chains: Chains, masks: tuple[int, ...], coords: np.ndarray, share: float = 0.0) -> np.ndarray:
    """``T[m, p]``: time of the group that runs, for each chain in ``masks[m]``, the stage ending at position p
    (``share``: compute slowed beside communication, :func:`~.interference.group_ns`)."""
    size = coords.shape[1]
    per_chain: dict[int, np.ndarray] = {}  # chain -> (resource, position) load of its stage ending there
    for c, chain in enumerate((chains.forward, chains.backward, chains.offload, chains.recovery)):
        if chain is None:
            continue
        table = np.zeros((len(RESOURCES), len(chain.stages) + 1), dtype=np.int64)
        for i, stage in enumerate(chain.stages, start=1):
            table[RESOURCE_INDEX[stage.resource], i] = stage.duration_ns
        per_chain[c] = table.take(coords[c], axis=1)
    loads: dict[int, np.ndarray] = {}
    times = np.empty((len(masks), size), dtype=np.int64)
    for m, mask in enumerate(masks):  # a mask's loads extend those of the mask without its lowest chain
        low = (mask & -mask).bit_length() - 1
        rest = mask & (mask - 1)
        loads[mask] = per_chain[low] + loads[rest] if rest else per_chain[low]
        load = loads[mask]
        if share:
            load = load.copy()
            load[COMPUTE] = slowed_compute(load[COMPUTE], load[COMM], share)
        np.maximum.reduce(load, axis=0, out=times[m])
    return times


def solve(chains: Chains, *, pipeline_degree: int | None = None, share: float = 0.0) -> Order:
    """The fastest barrier-group order of ``chains`` (see module docstring).

    ``pipeline_degree`` 2 means x - y = 2: the offload's micro-batch (x-1) is the recovery's (y+1), whose copies
    out must end before its copies back begin. F and B are still independent and ordered by the DP; O and R run at
    the point's edges (:func:`with_edges`). ``pipeline_degree`` 1 means x - y = 1 (no pipeline, Megatron-Core's
    combined 1F1B: F_(y+1) beside B_y): x-1 is y and y+1 is x, so copies given with them are F's and B's own
    (F's tensors copied out as it runs, B's reloaded ahead of it) and join F and B's groups
    (:func:`with_own_copies`). Durations are in the chains. ``share`` (in [0, 1)): the compute slowdown while
    communication runs beside it, which the groups' times and the makespan then include (:mod:`.interference`).
    """
    check_chains(chains)
    share = check_share(share)
    if pipeline_degree is not None:
        degree = require_int("pipeline_degree", pipeline_degree, 1)
        if degree == 1 and (chains.offload is not None or chains.recovery is not None):
            return with_own_copies(chains, share=share)
        if degree == 2 and chains.offload is not None and chains.recovery is not None:
            if chains.forward is None and chains.backward is None:
                return sequential(chains)  # nothing to overlap the copies with: out, then back
            return with_edges(solve(Chains(chains.forward, chains.backward), share=share), chains, share=share)
    present = list(chains.present())
    if len(present) == 1:  # one chain: the only transition runs its next stage, so each stage is its own group
        chain = present[0]
        return Order(tuple(((chain.kind, i),) for i in range(len(chain))), barriers=True,
                     makespan_ns=chain.duration_ns, solver="dp")
    shape = tuple(n + 1 for n in chains.counts())
    if math.prod(shape) > MAX_STATES:
        return bounded(chains, share=share)
    masks, coords, levels, prev = _levels(shape)
    size = coords.shape[1]
    times = _group_times(chains, masks, coords, share)
    best = np.full(size + 1, INF, dtype=np.int64)
    best[0] = 0
    add, minimum = np.add, np.minimum.reduce
    for lo, hi, before in levels:  # best of one level from the levels below
        minimum(add(best[before], times[:, lo:hi]), axis=0, out=best[lo:hi])
    return Order(_rebuild(best.tolist(), times, masks, shape), barriers=True, makespan_ns=int(best[size - 1]),
                 solver="dp")


def _rebuild(best: list[int], times: np.ndarray, masks: tuple[int, ...], shape: tuple[int, int, int, int]
             ) -> tuple[tuple[tuple[str, int], ...], ...]:
    """The groups on the way back from the last state: at each state the first mask (in ``masks`` order)
    reaching its best time, i.e. the transfer point of the recurrence (argmin's first minimum)."""
    prev_at, coords_at = _walk_tables(shape)
    groups = []
    position = len(best) - 2
    while position > 0:
        before = prev_at[position]
        candidates = [best[q] + t for q, t in zip(before, times[:, position].tolist())]
        m = candidates.index(min(candidates))
        mask, at = masks[m], coords_at[position]
        groups.append(tuple((kind, at[c] - 1) for c, kind in enumerate(CHAIN_KINDS) if (mask >> c) & 1))
        position = before[m]
    return tuple(reversed(groups))


def bounded(chains: Chains, *, share: float = 0.0) -> Order:
    """The order of chains too long for one DP table (over ``MAX_STATES`` states): F and B by the DP (Megatron-Core's
    combined 1F1B where they alone exceed it) with the copies beside their groups or O and R at the point's edges,
    or a baseline order of the same chains (:data:`~.baselines.BASELINES`) where that is faster."""
    plain = Chains(chains.forward, chains.backward)
    if math.prod(n + 1 for n in plain.counts()) <= MAX_STATES:
        core = solve(plain, share=share).groups
    else:
        core = combined_1f1b_groups(chains)
    candidates = [_timed(with_copies(core, chains), chains, share)]
    if chains.offload is not None and chains.recovery is not None:
        candidates.append(with_edges(Order(core, barriers=True), chains, share=share))
    candidates += [_timed(baseline(chains).groups, chains, share) for baseline in BASELINES.values()]
    return min(candidates, key=lambda order: order.makespan_ns)  # the first of equals


def _timed(groups, chains: Chains, share: float) -> Order:
    """``groups`` as a barrier order with its makespan (the simulator's; with ``share``, :mod:`.interference`'s)."""
    ordered = Order(tuple(tuple(g) for g in groups), barriers=True)
    spent = makespan_ns(ordered, chains, share) if share else simulate(ordered, chains).makespan_ns
    return Order(ordered.groups, barriers=True, makespan_ns=spent, solver="dp")


def with_own_copies(chains: Chains, *, share: float = 0.0) -> Order:
    """The order of a point of pipeline degree 1, whose copies are those of its own micro-batches (F's tensors
    copied out as its forward produces them, B's reloaded ahead of the backward stages that read them, layer by
    layer as Megatron-Kwai's offloading runs them): an order of F and B whose groups are joined by the copies
    (:func:`~.baselines.with_copies` with ``own=True``: a copy out once F has produced what it copies, a reload
    ahead of the backward stage that reads it; the rest of the recovery after). Of three orders of F and B (the
    DP's, Megatron-Core's combined 1F1B, F then B: fewer groups overlap more compute, more groups hide more
    copies), the shortest with its copies."""
    cores: list[tuple] = [()]
    if chains.forward is not None or chains.backward is not None:
        plain = Chains(chains.forward, chains.backward)
        cores = [solve(plain, share=share).groups, tuple(((chain.kind, i),) for chain in plain.present()
                                            for i in range(len(chain)))]
        if chains.forward is not None and chains.backward is not None:
            cores.insert(1, combined_1f1b_groups(chains))
    best = None
    for core in cores:
        found = _timed(with_copies(core, chains, own=True), chains, share)
        if best is None or found.makespan_ns < best.makespan_ns:
            best = found
    return best


def with_edges(core: Order, chains: Chains, *, share: float = 0.0) -> Order:
    """``core`` (an order of F and B) with the offload from the point's start and the recovery up to its end:
    O's stages join the first groups, one each, R's the last ones, and every O stage comes before every R stage
    (standalone groups between them when ``core`` has too few). Where O and R copy the same micro-batch (pipeline
    degree 2: x-1 = y+1) its copies out end before its copies back begin, the copies overlap the F and B stages
    of the edges, and F and B keep the DP's order. Its makespan is the simulator's (with ``share``, the
    interference's)."""
    groups = [list(group) for group in core.groups]
    offload = [("O", i) for i in range(len(chains.offload))]
    recovery = [("R", i) for i in range(len(chains.recovery))]
    front = min(len(offload), len(groups))
    back = min(len(recovery), len(groups) - front)
    for group, stage in zip(groups[:front], offload):
        group.append(stage)
    for group, stage in zip(groups[len(groups) - back:], recovery[len(recovery) - back:]):
        group.append(stage)
    middle = ([[stage] for stage in offload[front:]] + groups[front:len(groups) - back]
              + [[stage] for stage in recovery[:len(recovery) - back]])
    return _timed(groups[:front] + middle + groups[len(groups) - back:], chains, share)
