"""Exact baseline of the scheduling point: CP-SAT with interval variables — no barriers, no groups.

Every stage is an interval; stages of one chain follow each other (precedence); stages on one resource do not
overlap (``add_no_overlap``); the makespan is minimised. This is the true optimum of the general problem, so it
bounds what any barrier-group order (the DP's) can reach.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from ..costmodel import Resource
from ..costmodel.validate import check_solver_options
from .chains import CHAIN_KINDS, Chains, check_chains
from .order import Order


@dataclass
class ScheduleModel:
    model: cp_model.CpModel
    start: dict[tuple[str, int], cp_model.IntVar]
    end: dict[tuple[str, int], cp_model.IntVar]
    makespan: cp_model.IntVar


def build_model(chains: Chains, *, hint: Order | None = None) -> ScheduleModel:
    model = cp_model.CpModel()
    horizon = max(chains.sequential_ns, 1)
    start, end = {}, {}
    by_resource: dict[Resource, list] = {r: [] for r in Resource}
    for kind in CHAIN_KINDS:
        chain = chains.get(kind)
        if chain is None:
            continue
        for index, stage in enumerate(chain.stages):
            key = (kind, index)
            start[key] = model.new_int_var(0, horizon, f"start[{kind}{index}]")
            end[key] = model.new_int_var(0, horizon, f"end[{kind}{index}]")
            interval = model.new_interval_var(start[key], stage.duration_ns, end[key], f"run[{kind}{index}]")
            by_resource[stage.resource].append(interval)
            # chain precedence: a stage starts after its predecessor in the same chain ends
            if index:
                model.add(start[key] >= end[(kind, index - 1)])
    # one stage at a time on each resource (compute stream, comm stream, each copy engine)
    for intervals in by_resource.values():
        if len(intervals) > 1:
            model.add_no_overlap(intervals)
    makespan = model.new_int_var(0, horizon, "makespan")
    model.add_max_equality(makespan, list(end.values()) or [0])
    model.minimize(makespan)
    if hint is not None:  # seed with the DP's schedule
        from .simulate import simulate

        for event in simulate(hint, chains).events:
            model.add_hint(start[(event.chain, event.index)], event.start_ns)
    return ScheduleModel(model, start, end, makespan)


def solve(chains: Chains, *, time_limit_s: float = 10.0, num_workers: int = 1, seed: int = 0,
          hint: Order | None = None) -> Order:
    """Optimal issue order (``barriers=False``) and its makespan; ``solver`` is ``exact`` if proven optimal,
    ``exact-feasible`` if the time limit stopped the search first."""
    check_solver_options(time_limit_s, num_workers, seed)
    check_chains(chains)
    if hint is not None and not isinstance(hint, Order):
        raise ValueError(f"hint must be an Order or None, got {type(hint).__name__}")
    if not any(True for _ in chains.present()):
        return Order((), makespan_ns=0, solver="exact")
    built = build_model(chains, hint=hint)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit_s)
    solver.parameters.catch_sigint_signal = False  # Ctrl-C is Python's KeyboardInterrupt, not a quiet early stop
    solver.parameters.num_workers = num_workers
    solver.parameters.random_seed = seed
    code = solver.solve(built.model)
    if code == cp_model.MODEL_INVALID:  # e.g. durations beyond CP-SAT's integer range: the input, not the limit
        raise ValueError(f"CP-SAT rejected the schedule model (stage durations out of its integer range?): "
                         f"{' '.join(built.model.validate().split())[:200]}")
    if code not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"CP-SAT found no schedule ({solver.status_name(code)}); raise time_limit_s")
    starts = sorted(built.start, key=lambda key: (solver.value(built.start[key]), solver.value(built.end[key]),
                                                  CHAIN_KINDS.index(key[0]), key[1]))
    return Order(tuple((key,) for key in starts), barriers=False, makespan_ns=int(solver.value(built.makespan)),
                 solver="exact" if code == cp_model.OPTIMAL else "exact-feasible")
