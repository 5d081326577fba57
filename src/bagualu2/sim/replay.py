"""Replay one pipeline stage's iteration through the runtime decision path of BaGuaLu-2.

For every forward of the (interleaved) 1F1B schedule: Algorithm 1 hands out a budget, the plan cache (greedy on
a miss) plans the micro-batch for the imbalance expected before the gate, the gate reveals the actual
imbalance, and deferred planning downgrades the MoE module when the planned bytes would not fit. The bytes the
micro-batch then keeps are recorded back into the budget (re-basing); backwards free them.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

from ..budget import BudgetAssigner, plan_after_gate
from ..costmodel import Hardware, ModelConfig, ParallelConfig, build_graph, evaluate, schedule, stage_memory
from ..costmodel.build import check_imbalance
from ..mitigation import PlanCache


def spike_trace(num_microbatches: int, *, spike_rate: float = 0.029, max_imbalance: float = 2.6,
                base_imbalance: float = 1.1, seed: int = 0) -> tuple[float, ...]:
    """Imbalance per micro-batch: ``base_imbalance`` most of the time, spikes up to ``max_imbalance`` at
    ``spike_rate`` (the paper: 2.9% of iterations, up to 2.6x)."""
    if not 0 <= spike_rate <= 1:
        raise ValueError(f"spike_rate must be in [0, 1], got {spike_rate!r}")
    check_imbalance(base_imbalance)
    check_imbalance(max_imbalance)
    if max_imbalance < base_imbalance:
        raise ValueError(f"max_imbalance={max_imbalance} must be >= base_imbalance={base_imbalance}")
    rng = random.Random(seed)
    return tuple(round(rng.uniform(1.2, max_imbalance), 2) if rng.random() < spike_rate else base_imbalance
                 for _ in range(num_microbatches))


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


@dataclass(frozen=True)
class IterationReplay:
    decisions: tuple[ForwardDecision, ...]
    m_max_bytes: int
    m0_bytes: int
    peak_in_flight_bytes: int
    cache_hits: int
    cache_misses: int
    decision_time_s: float

    @property
    def fits(self) -> bool:
        return self.peak_in_flight_bytes <= self.m_max_bytes


def replay_iteration(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, imbalances, *,
                     stage: int = 0, planned_imbalance: float = 1.2, cache: PlanCache | None = None
                     ) -> IterationReplay:
    """Run the decision path for every forward of ``stage``; ``imbalances[m]`` is micro-batch m's actual rate."""
    if len(imbalances) != parallel.num_microbatches:
        raise ValueError(f"imbalances must have num_microbatches={parallel.num_microbatches} entries, "
                         f"got {len(imbalances)}")
    for value in imbalances:
        check_imbalance(value)
    memory = stage_memory(model, parallel, hardware, stage=stage)
    actions = schedule(parallel, stage)
    assigner = BudgetAssigner(m_max_bytes=memory.m_max_bytes, m0_bytes=memory.m0_bytes,
                              num_microbatches=len(actions) // 2, num_warmup=memory.inflight_chunks)
    cache = cache if cache is not None else PlanCache()
    graphs: dict[tuple[int, float], object] = {}

    def graph(chunk: int, imbalance: float):
        key = (chunk, imbalance)
        if key not in graphs:
            graphs[key] = build_graph(model, parallel, hardware, imbalance=imbalance, stage=stage, chunk=chunk)
        return graphs[key]

    forward_index: dict[tuple[int, int], int] = {}
    decisions = []
    peak = 0
    decision_s = 0.0
    for action in actions:
        key = (action.microbatch, action.chunk)
        if action.kind == "B":
            assigner.record_backward(forward_index[key])
            continue
        started = time.perf_counter()
        index = len(forward_index)
        phase = assigner.phase.value
        budget = assigner.next_forward_budget()
        planned = cache.get(budget, planned_imbalance, (phase, action.chunk),
                            lambda r, chunk=action.chunk: graph(chunk, r))
        actual_graph = graph(action.chunk, imbalances[action.microbatch])
        plan, downgraded = plan_after_gate(actual_graph, planned.plan, budget)
        cost = evaluate(actual_graph, plan)
        decision_s += time.perf_counter() - started
        forward_index[key] = index
        assigner.record_forward(index, cost.activation_bytes)
        peak = max(peak, assigner.in_flight_bytes)
        decisions.append(ForwardDecision(index, action.microbatch, action.chunk, phase, imbalances[action.microbatch],
                                         budget, cost.activation_bytes, cost.overhead_s, len(plan), downgraded,
                                         assigner.in_flight_bytes))
    return IterationReplay(tuple(decisions), memory.m_max_bytes, memory.m0_bytes, peak, cache.hits, cache.misses,
                           decision_s)
