"""The fused dual-batch DP (paper §V-B) over prefixes of the F, B, O and R chains.

``best[i, j, k, l]`` is the shortest time to run the first i, j, k, l stages of F, B, O, R. A transition runs one
group: the next stage of any non-empty subset of the chains, started together behind a barrier; its time ``T`` is
the busiest resource of the group (stages on the same resource serialise, different resources overlap). The
recorded transfer points rebuild the order; a transition only extends prefixes, so no chain is ever permuted.

After compaction there are ``(|F|+1)(|B|+1)(|O|+1)(|R|+1)`` states and 15 transitions each; the states are
processed by anti-diagonal level (a transition lowers the level by 1 to 4) with numpy, one vector step per level.
"""

from __future__ import annotations

import warnings
from functools import lru_cache

import numpy as np

from ..costmodel import Hardware, Resource
from .chains import CHAIN_KINDS, Chains
from .order import Order
from .simulate import simulate

RESOURCES = tuple(Resource)
INF = np.int64(1) << 62
MASKS = tuple(range(1, 16))  # bit c set: chain CHAIN_KINDS[c] advances by one stage


@lru_cache(maxsize=256)
def _levels(shape: tuple[int, int, int, int]):
    """Per level: flat state indices and, per mask, the predecessor index (the sentinel ``size`` if invalid)."""
    size = int(np.prod(shape))
    coords = np.stack(np.unravel_index(np.arange(size), shape), axis=1)  # (size, 4)
    strides = np.array([int(np.prod(shape[c + 1:])) for c in range(4)], dtype=np.int64)
    level = coords.sum(axis=1)
    prev = np.full((len(MASKS), size), size, dtype=np.int64)
    for m, mask in enumerate(MASKS):
        bits = np.array([(mask >> c) & 1 for c in range(4)], dtype=np.int64)
        valid = np.all(coords >= bits, axis=1)
        prev[m, valid] = np.arange(size)[valid] - int(bits @ strides)
    order = [np.flatnonzero(level == lv) for lv in range(1, int(level.max()) + 1)] if size > 1 else []
    return coords, order, prev, size


def _group_times(chains: Chains, coords: np.ndarray) -> np.ndarray:
    """``T[m, s]``: time of the group that runs, for each chain in mask m, the stage ending at state s."""
    size = coords.shape[0]
    loads = np.zeros((len(MASKS), len(RESOURCES), size), dtype=np.int64)
    for c, kind in enumerate(CHAIN_KINDS):
        chain = chains.get(kind)
        if chain is None:
            continue
        duration = np.array([0] + [s.duration_ns for s in chain.stages], dtype=np.int64)
        resource = np.array([0] + [RESOURCES.index(s.resource) for s in chain.stages], dtype=np.int64)
        d, r = duration[coords[:, c]], resource[coords[:, c]]
        for m, mask in enumerate(MASKS):
            if (mask >> c) & 1:
                np.add.at(loads[m], (r, np.arange(size)), d)
    return loads.max(axis=1)


def solve(chains: Chains, *, hardware: Hardware | None = None, pipeline_degree: int | None = None) -> Order:
    """The fastest barrier-group order of ``chains`` (see module docstring).

    ``pipeline_degree`` <= 2 means x - y <= 2, where the offload and recovery targets coincide: the DP does not
    apply and the sequential order is returned with a warning. ``hardware`` is accepted for symmetry with the
    other solvers; durations are already in the chains.
    """
    if pipeline_degree is not None:
        if isinstance(pipeline_degree, bool) or not isinstance(pipeline_degree, int) or pipeline_degree < 1:
            raise ValueError(f"pipeline_degree must be an integer >= 1, got {pipeline_degree!r}")
        if pipeline_degree <= 2:
            from .baselines import sequential

            warnings.warn(f"pipeline degree {pipeline_degree} <= 2: offload and recovery would target the same "
                          "micro-batch; using the sequential order", RuntimeWarning, stacklevel=2)
            return sequential(chains)
    shape = tuple(n + 1 for n in chains.counts())
    coords, levels, prev, size = _levels(shape)
    times = _group_times(chains, coords)
    best = np.full(size + 1, INF, dtype=np.int64)
    best[0] = 0
    choice = np.zeros(size, dtype=np.int64)
    for states in levels:
        candidates = best[prev[:, states]] + times[:, states]
        pick = candidates.argmin(axis=0)
        best[states] = candidates[pick, np.arange(len(states))]
        choice[states] = pick
    groups = []
    state = size - 1
    strides = [int(np.prod(shape[c + 1:])) for c in range(4)]
    while state > 0:
        mask = MASKS[int(choice[state])]
        position = coords[state]
        groups.append(tuple((kind, int(position[c]) - 1) for c, kind in enumerate(CHAIN_KINDS) if (mask >> c) & 1))
        state -= sum(strides[c] for c in range(4) if (mask >> c) & 1)
    order = Order(tuple(reversed(groups)), barriers=True, makespan_ns=int(best[size - 1]), solver="dp")
    return order


def check(order: Order, chains: Chains) -> Order:
    """``order`` with its makespan recomputed by :func:`simulate` (used by tests and baselines)."""
    timeline = simulate(order, chains)
    return Order(order.groups, barriers=order.barriers, makespan_ns=timeline.makespan_ns, solver=order.solver)
