"""Replay one pipeline stage's iteration through the runtime decision path, and seeded imbalance traces.

For every forward of the (interleaved) 1F1B schedule: Algorithm 1 hands out a budget (and, in warmup, the most an
overrun may keep), the memoised :class:`~.path.DecisionPath` decides for the imbalance the gate measured, the bytes
the micro-batch keeps are recorded back into the budget (re-basing); backwards free them.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from ..budget import BudgetAssigner
from ..costmodel import Hardware, ModelConfig, ParallelConfig
from ..costmodel.build import check_imbalance
from ..costmodel.validate import require_int, require_number
from .path import DecisionPath


def spike_trace(num_microbatches: int, *, spike_rate: float = 0.029, max_imbalance: float = 2.6,
                base_imbalance: float = 1.1, base_jitter: float = 0.0, spike_min: float | None = None,
                seed: int = 0) -> tuple[float, ...]:
    """Imbalance per micro-batch, seeded: most micro-batches at ``base_imbalance`` (uniform within
    ``± base_jitter``, at least 1), a share ``spike_rate`` drawn uniformly in ``[spike_min, max_imbalance]``
    (``spike_min`` defaults to ``base_imbalance + base_jitter``). The paper: 97.1% below 1.2x, 2.9% spikes up to
    2.6x — ``spike_trace(n, base_imbalance=1.1, base_jitter=0.1)``. Values are rounded to 2 decimals."""
    require_int("num_microbatches", num_microbatches, 1)
    spike_rate = require_number("spike_rate", spike_rate, 0, 1)
    base_jitter = require_number("base_jitter", base_jitter, 0)
    check_imbalance(base_imbalance)
    check_imbalance(max_imbalance)
    low = base_imbalance + base_jitter if spike_min is None else check_imbalance(spike_min)
    if max_imbalance < low:
        raise ValueError(f"max_imbalance={max_imbalance} must be >= the spikes' lower end {low}")
    rng = random.Random(seed)
    trace = []
    for _ in range(num_microbatches):
        if rng.random() < spike_rate:
            trace.append(round(rng.uniform(low, max_imbalance), 2))
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
                     stage: int = 0, path: DecisionPath | None = None, downgrade: str = "graded"
                     ) -> IterationReplay:
    """Run the decision path for every forward of ``stage``; ``imbalances[m]`` is micro-batch m's measured rate.

    Pass the same ``path`` to consecutive calls to replay a trace of iterations with warm caches (``downgrade``
    only applies to a path made here).
    """
    if len(imbalances) != parallel.num_microbatches:
        raise ValueError(f"imbalances must have num_microbatches={parallel.num_microbatches} entries, "
                         f"got {len(imbalances)}")
    for value in imbalances:
        check_imbalance(value)
    path = path if path is not None else DecisionPath(model, parallel, hardware, stage=stage, downgrade=downgrade)
    memory, steps = path.stage_plan()
    assigner = BudgetAssigner(m_max_bytes=memory.m_max_bytes, m0_bytes=memory.m0_bytes,
                              num_microbatches=len(steps) // 2, num_warmup=memory.inflight_chunks)
    hits, misses = path.hits, path.misses
    raw = []
    peak = 0
    forward, record_forward, record_backward = path.forward, assigner.record_forward, assigner.record_backward
    next_budget, limit, keep = assigner.next_forward_budget, assigner.absorb_limit_bytes, raw.append
    started = time.perf_counter()
    for is_forward, index, microbatch, chunk, phase in steps:  # the timed hot path: budget, decision, re-basing
        if not is_forward:
            record_backward(index)
            continue
        budget = next_budget()
        decision = forward(budget, imbalances[microbatch], phase, chunk,
                           limit_bytes=limit() if phase == "warmup" else None)
        held = record_forward(index, decision.kept_bytes)  # the in-flight bytes after it
        if held > peak:
            peak = held
        keep((budget, decision, held))
    elapsed = time.perf_counter() - started
    forwards = [(mb, chunk, phase) for is_forward, _, mb, chunk, phase in steps if is_forward]
    decisions = [ForwardDecision(i, mb, chunk, phase, imbalances[mb], budget, d.kept_bytes, d.overhead_s,
                                 len(d.plan), d.downgraded, held, d.order.makespan_s, d.action.value, str(d.plan))
                 for i, ((mb, chunk, phase), (budget, d, held)) in enumerate(zip(forwards, raw))]
    return IterationReplay(tuple(decisions), memory.m_max_bytes, memory.m0_bytes, peak, path.hits - hits,
                           path.misses - misses, elapsed)
