"""Replay one pipeline stage's iteration through the runtime decision path, and seeded imbalance traces.

The stage's iteration driver (:func:`~.iteration.run_iteration`) runs the (interleaved) 1F1B schedule: for every
forward Algorithm 1 hands out a budget (and, in warmup, the most an overrun may keep), the memoised
:class:`~.path.DecisionPath` decides for the imbalance the gate measured, the bytes the micro-batch keeps are
recorded back into the budget (re-basing); backwards free them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from ..costmodel import Hardware, ModelConfig, ParallelConfig
from ..costmodel.build import check_imbalance
from ..costmodel.config import PARALLEL_MAX, check_compatible
from ..costmodel.validate import require_int, require_number
from .iteration import is_sequence, run_iteration
from .path import DecisionPath

MAX_TRACE_IMBALANCE = float(PARALLEL_MAX["ep"])  # no rank receives more than ep times the mean
MAX_TRACE = 10**8  # imbalances one spike_trace draws (about 3 GB of Python floats)


def spike_trace(num_microbatches: int, *, spike_rate: float = 0.029, max_imbalance: float = 2.6,
                base_imbalance: float = 1.1, base_jitter: float = 0.0, spike_min: float | None = None,
                seed: int = 0) -> tuple[float, ...]:
    """Imbalance per micro-batch, seeded: most micro-batches at ``base_imbalance`` (uniform within
    ``± base_jitter``, at least 1), a share ``spike_rate`` drawn uniformly in ``[spike_min, max_imbalance]``
    (``spike_min`` defaults to ``base_imbalance + base_jitter``). The paper: 97.1% below 1.2x, 2.9% spikes up to
    2.6x — ``spike_trace(n, base_imbalance=1.1, base_jitter=0.1)``. Values are rounded to 2 decimals; at most
    ``MAX_TRACE`` of them."""
    require_int("num_microbatches", num_microbatches, 1, MAX_TRACE, high_open=False)
    spike_rate = require_number("spike_rate", spike_rate, 0, 1)
    base_jitter = require_number("base_jitter", base_jitter, 0)
    check_imbalance(base_imbalance)
    require_number("max_imbalance", max_imbalance, 1, MAX_TRACE_IMBALANCE, high_open=False)
    if base_imbalance + base_jitter > max_imbalance:
        raise ValueError(f"base_jitter={base_jitter} must keep the ordinary rates (base_imbalance={base_imbalance} "
                         f"+- base_jitter) at most max_imbalance={max_imbalance}")
    low = base_imbalance + base_jitter if spike_min is None else check_imbalance(spike_min)
    if max_imbalance < low:
        raise ValueError(f"max_imbalance={max_imbalance} must be >= the spikes' lower end {low}")
    rng = random.Random(require_int("seed", seed, 0))
    trace = []
    for _ in range(num_microbatches):
        if rng.random() < spike_rate:
            trace.append(min(round(rng.uniform(low, max_imbalance), 2), max_imbalance))  # never rounded past it
        elif base_jitter:
            trace.append(round(max(rng.uniform(base_imbalance - base_jitter, base_imbalance + base_jitter), 1.0), 2))
        else:
            trace.append(float(base_imbalance))
    return tuple(trace)


@dataclass(frozen=True)
class ForwardDecision:
    """What the runtime decided for one chunk-forward."""

    index: int
    microbatch: int
    chunk: int
    phase: str
    imbalance: float
    budget_bytes: int
    kept_bytes: int
    overhead_s: float
    num_mitigated: int
    downgraded: bool
    in_flight_bytes: int
    fused_makespan_s: float
    action: str = "keep"
    plan: str = "none"  # the plan the micro-batch ran, in its text form (Plan.from_str parses it)


@dataclass(frozen=True)
class IterationReplay:
    decisions: tuple[ForwardDecision, ...]
    m_max_bytes: int
    m0_bytes: int
    peak_in_flight_bytes: int
    cache_hits: int       # decision-cache hits and misses during this iteration
    cache_misses: int
    decision_time_s: float  # wall time of the whole decision path (budgets, decisions, records)

    @property
    def fits(self) -> bool:
        return self.peak_in_flight_bytes <= self.m_max_bytes


def replay_iteration(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, imbalances, *,
                     stage: int | None = None, path: DecisionPath | None = None, downgrade: str = "graded",
                     progress: Callable[[int, int], None] | None = None) -> IterationReplay:
    """Run the decision path for every forward of ``stage``; ``imbalances[m]`` is micro-batch m's measured rate.

    Pass the same ``path`` to consecutive calls to replay a trace of iterations with warm caches (``downgrade``
    only applies to a path made here; ``stage``, default 0 or the path's, must be the path's). The loop is
    :func:`~.iteration.run_iteration` over the path's engine.
    ``progress``, optional, is called with (forwards decided, forwards in all) after each forward.
    """
    if not is_sequence(imbalances):
        raise ValueError(f"imbalances must be a sequence of rates (one per micro-batch), "
                         f"got {type(imbalances).__name__}")
    if stage is not None:
        stage = require_int("stage", stage, 0)
    check_compatible(model, parallel)
    if path is not None and not isinstance(path, DecisionPath):
        raise ValueError(f"path must be a DecisionPath or None, got {type(path).__name__}")
    if path is not None and ((path.model, path.parallel, path.hardware) != (model, parallel, hardware)
                             or stage not in (None, path.stage)):
        raise ValueError("path must be a DecisionPath of the same model, parallel config, hardware and stage")
    if len(imbalances) != parallel.num_microbatches:
        raise ValueError(f"imbalances must have num_microbatches={parallel.num_microbatches} entries, "
                         f"got {len(imbalances)}")
    for value in imbalances:
        check_imbalance(value, ep=parallel.ep, model=model)
    path = path if path is not None else DecisionPath(model, parallel, hardware, stage=stage or 0, downgrade=downgrade)
    if progress is not None and not callable(progress):
        raise ValueError(f"progress must be a callable or None, got {type(progress).__name__}")
    hits, misses = path.hits, path.misses
    total, done = parallel.num_microbatches * parallel.vp, [0]

    def counted(step, imbalance, budget_bytes, limit_bytes):
        decision = path.decide(step, imbalance, budget_bytes, limit_bytes)
        done[0] += 1
        progress(done[0], total)
        return decision
    run = run_iteration(path.engine, path.decide if progress is None else counted, imbalances)
    decisions = tuple(ForwardDecision(i, f.step.microbatch, f.step.chunk, f.step.phase, f.imbalance, f.budget_bytes,
                                      d.kept_bytes, d.overhead_s, len(d.plan), d.downgraded, f.held_bytes,
                                      d.order.makespan_s, d.action.value, str(d.plan))
                      for i, f in enumerate(run.forwards) for d in (f.result,))
    return IterationReplay(decisions, run.m_max_bytes, run.m0_bytes, run.peak_bytes, path.hits - hits,
                           path.misses - misses, run.elapsed_s)
