"""Discrete-event dry run of an order: checks dependencies, reports makespan and resource use."""

from __future__ import annotations

from dataclasses import dataclass

from ..costmodel import Resource
from .chains import CHAIN_KINDS, Chains, check_chains
from .order import Order

MITIGATION_CHAINS = ("O", "R")


@dataclass(frozen=True)
class Event:
    chain: str
    index: int
    resource: Resource
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class Timeline:
    """What running an order does: every stage's interval, the makespan, busy time per resource, and the time
    during which only mitigation (offload or recovery) runs — the mitigation that is not hidden."""

    events: tuple[Event, ...]
    makespan_ns: int
    busy_ns: dict[str, int]
    exposed_mitigation_ns: int

    @property
    def makespan_s(self) -> float:
        return self.makespan_ns * 1e-9


def simulate(order: Order, chains: Chains) -> Timeline:
    """Run ``order`` on ``chains``; ``ValueError`` if it skips, repeats or reorders a chain's stages."""
    if not isinstance(order, Order):
        raise ValueError(f"order must be an Order (its text form: Order.from_str), got {type(order).__name__}")
    check_chains(chains)
    expected = {kind: (len(chains.get(kind)) if chains.get(kind) is not None else 0) for kind in CHAIN_KINDS}
    done = {kind: 0 for kind in CHAIN_KINDS}
    chain_end = {kind: 0 for kind in CHAIN_KINDS}
    free = {r: 0 for r in Resource}
    events: list[Event] = []
    now = 0
    for group in order.groups:
        group_end = now
        for kind, index in group:
            if index >= expected[kind]:
                raise ValueError(f"order runs stage {kind}{index} but chain {kind} has {expected[kind]} stages")
            if index != done[kind]:
                raise ValueError(f"order runs stage {kind}{index} before {kind}{done[kind]}: chain order broken")
            stage = chains.get(kind).stages[index]  # type: ignore[union-attr]
            ready = now if order.barriers else chain_end[kind]
            start = max(ready, free[stage.resource])
            end = start + stage.duration_ns
            free[stage.resource] = chain_end[kind] = end
            done[kind] += 1
            events.append(Event(kind, index, stage.resource, start, end))
            group_end = max(group_end, end)
        if order.barriers:
            now = group_end
    missing = [f"{k}{done[k]}" for k in CHAIN_KINDS if done[k] != expected[k]]
    if missing:
        raise ValueError(f"order does not run every stage; first missing: {', '.join(missing)}")
    makespan = max((e.end_ns for e in events), default=0)
    busy = {r.value: 0 for r in Resource}
    for event in events:
        busy[event.resource.value] += event.end_ns - event.start_ns
    return Timeline(tuple(events), makespan, busy, _exposed(events))


def _exposed(events: list[Event]) -> int:
    """Length of the time where some O/R stage runs and no F/B stage does."""
    points = sorted({e.start_ns for e in events} | {e.end_ns for e in events})
    exposed = 0
    for lo, hi in zip(points, points[1:]):
        active = {e.chain for e in events if e.start_ns < hi and e.end_ns > lo}
        if active & set(MITIGATION_CHAINS) and not active - set(MITIGATION_CHAINS):
            exposed += hi - lo
    return exposed
