"""Replay one pipeline stage's iteration through the runtime decision path of BaGuaLu-2.

For every forward of the (interleaved) 1F1B schedule: Algorithm 1 hands out a budget, the memoised
:class:`~.runtime.DecisionPath` plans the micro-batch, applies the deferred MoE downgrade for the imbalance the
gate measured and orders the fused scheduling point; the bytes the micro-batch keeps are recorded back into the
budget (re-basing); backwards free them.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from ..budget import BudgetAssigner
from ..costmodel import Hardware, ModelConfig, ParallelConfig
from ..costmodel.build import check_imbalance
from .runtime import DecisionPath


def spike_trace(num_microbatches: int, *, spike_rate: float = 0.029, max_imbalance: float = 2.6,
                base_imbalance: float = 1.1, seed: int = 0) -> tuple[float, ...]:
    """Imbalance per micro-batch: ``base_imbalance`` most of the time, spikes up to ``max_imbalance`` at
    ``spike_rate`` (the paper: 2.9% of iterations, up to 2.6x)."""
    if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    if isinstance(spike_rate, bool) or not isinstance(spike_rate, (int, float)) or not 0 <= spike_rate <= 1:
        raise ValueError(f"spike_rate must be in [0, 1], got {spike_rate!r}")
    check_imbalance(base_imbalance)
    check_imbalance(max_imbalance)
    if max_imbalance < base_imbalance:
        raise ValueError(f"max_imbalance={max_imbalance} must be >= base_imbalance={base_imbalance}")
    rng = random.Random(seed)
    return tuple(round(rng.uniform(base_imbalance, max_imbalance), 2) if rng.random() < spike_rate
                 else base_imbalance for _ in range(num_microbatches))


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
                     stage: int = 0, planned_imbalance: float = 1.2, path: DecisionPath | None = None
                     ) -> IterationReplay:
    """Run the decision path for every forward of ``stage``; ``imbalances[m]`` is micro-batch m's actual rate.

    Pass the same ``path`` to consecutive calls to replay a trace of iterations with warm caches.
    """
    if len(imbalances) != parallel.num_microbatches:
        raise ValueError(f"imbalances must have num_microbatches={parallel.num_microbatches} entries, "
                         f"got {len(imbalances)}")
    for value in imbalances:
        check_imbalance(value)
    path = path if path is not None else DecisionPath(model, parallel, hardware, stage=stage,
                                                      planned_imbalance=planned_imbalance)
    memory, steps = path.stage_plan()
    assigner = BudgetAssigner(m_max_bytes=memory.m_max_bytes, m0_bytes=memory.m0_bytes,
                              num_microbatches=len(steps) // 2, num_warmup=memory.inflight_chunks)
    hits, misses = path.hits, path.misses
    raw = []
    peak = 0
    forward, record_forward, record_backward = path.forward, assigner.record_forward, assigner.record_backward
    next_budget, keep = assigner.next_forward_budget, raw.append
    started = time.perf_counter()
    for is_forward, index, microbatch, chunk, phase in steps:  # the timed hot path: budget, decision, re-basing
        if not is_forward:
            record_backward(index)
            continue
        budget = next_budget()
        decision = forward(budget, imbalances[microbatch], phase, chunk)
        held = record_forward(index, decision.kept_bytes)  # the in-flight bytes after it
        if held > peak:
            peak = held
        keep((budget, decision, held))
    elapsed = time.perf_counter() - started
    forwards = [(mb, chunk, phase) for is_forward, _, mb, chunk, phase in steps if is_forward]
    decisions = [ForwardDecision(i, mb, chunk, phase, imbalances[mb], budget, d.kept_bytes, d.overhead_s,
                                 len(d.plan), d.downgraded, held, d.order.makespan_s)
                 for i, ((mb, chunk, phase), (budget, d, held)) in enumerate(zip(forwards, raw))]
    return IterationReplay(tuple(decisions), memory.m_max_bytes, memory.m0_bytes, peak, path.hits - hits,
                           path.misses - misses, elapsed)
