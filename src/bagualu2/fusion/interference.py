"""The time of a barrier-group order when compute slows beside communication.

A communication kernel occupies streaming multiprocessors, so compute that overlaps it runs at ``1 - share`` of
its speed while it lasts: a group's compute ``c`` beside communication ``k`` takes ``c / (1 - share)`` when that
ends within ``k``, else ``c + share * k``. A group takes its busiest resource; ``share = 0`` is the DP's own cost
(the busiest resource alone), the sum of which is :func:`~.simulate.simulate`'s makespan of a barrier order.
"""

from __future__ import annotations

import numpy as np

from ..costmodel import Resource
from .chains import Chains
from .order import Order


def check_share(share: float) -> float:
    """``share`` as a float in [0, 1); one-line ``ValueError`` otherwise."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ValueError(f"share must be a number in [0, 1), got {share!r}")
    return float(share)


def group_ns(loads: dict[Resource, int], share: float) -> int:
    """One barrier group of per-resource ``loads``: its busiest resource, compute slowed while communication runs."""
    compute, comm = loads.get(Resource.COMPUTE, 0), loads.get(Resource.COMM, 0)
    if compute and comm and share:
        slowed = compute / (1 - share)
        compute = round(slowed) if slowed <= comm else compute + round(share * comm)
    return max(compute, comm, loads.get(Resource.D2H, 0), loads.get(Resource.H2D, 0))


def slowed_compute(compute: np.ndarray, comm: np.ndarray, share: float) -> np.ndarray:
    """:func:`group_ns`'s compute time for arrays of groups (int64; the same rounding, half to even)."""
    if not share:
        return compute
    slowed = compute / (1 - share)
    beside = np.where(slowed <= comm, np.rint(slowed), compute + np.rint(share * comm)).astype(np.int64)
    return np.where((compute > 0) & (comm > 0), beside, compute)


def group_times_ns(order: Order, chains: Chains, share: float) -> list[int]:
    """Nanoseconds of each group of ``order`` (barrier groups) on ``chains`` with interference ``share``."""
    times = []
    for group in order.groups:
        loads: dict[Resource, int] = {}
        for kind, index in group:
            stage = chains.get(kind).stages[index]
            loads[stage.resource] = loads.get(stage.resource, 0) + stage.duration_ns
        times.append(group_ns(loads, share))
    return times


def makespan_ns(order: Order, chains: Chains, share: float) -> int:
    """Nanoseconds of ``order`` (barrier groups) on ``chains`` with interference ``share`` (0: none)."""
    return sum(group_times_ns(order, chains, share))
