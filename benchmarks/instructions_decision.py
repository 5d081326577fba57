"""Deterministic cost of the decision path: CPU instructions of the bench's 100-iteration round, under valgrind.

Wall time on a shared machine drifts by ±20% from minute to minute; instruction counts do not. This script runs
the timed loop of ``run_iteration`` (budget, decision, re-basing; ``benchmarks/bench_fusion.py -k decision``'s
trace and preset, fresh caches) and, with ``--setup-only``, everything but that loop. Their difference is the
decision path's instruction count:

    for mode in "" --setup-only; do
      PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1 setarch -R valgrind --tool=cachegrind --cache-sim=no \\
        --cachegrind-out-file=/dev/null python benchmarks/instructions_decision.py $mode 2>&1 | grep "I *refs"
    done

(one BLAS thread and a fixed hash seed make the count reproducible to the instruction; ``--twice`` runs the
round a second time on the warm caches, which gives the all-hit floor.)
"""

from __future__ import annotations

import argparse

from bagualu2.budget import BudgetAssigner
from bagualu2.costmodel import presets
from bagualu2.runtime import DecisionPath, spike_trace

MODEL, PARALLEL = presets.model("glm-1041b-a35b")
HW = presets.hardware("paper-gpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup-only", action="store_true", help="everything but the decision loop")
    parser.add_argument("--twice", action="store_true", help="run the round again on warm caches")
    args = parser.parse_args()
    trace = spike_trace(100 * PARALLEL.num_microbatches, spike_rate=0.029, max_imbalance=2.6, seed=0)
    path = DecisionPath(MODEL, PARALLEL, HW)
    memory, steps = path.engine.memory, path.engine.steps

    def iteration(imbalances) -> None:  # run_iteration's timed loop (budget, decision, re-basing)
        assigner = BudgetAssigner(m_max_bytes=memory.m_max_bytes, m0_bytes=memory.m0_bytes,
                                  num_microbatches=len(steps) // 2, num_warmup=memory.inflight_chunks)
        peak = 0
        for step in steps:
            if not step.forward:
                assigner.record_backward(step.index)
                continue
            budget = assigner.next_forward_budget()
            decision = path.forward(budget, imbalances[step.microbatch], step.phase, step.chunk,
                                    limit_bytes=assigner.absorb_limit_bytes() if step.phase == "warmup" else None)
            peak = max(peak, assigner.record_forward(step.index, decision.kept_bytes))
        assert peak <= memory.m_max_bytes

    rounds = 0 if args.setup_only else 2 if args.twice else 1
    for _ in range(rounds):
        for it in range(100):
            iteration(trace[it * PARALLEL.num_microbatches:(it + 1) * PARALLEL.num_microbatches])
    print(f"{path.hits} hits, {path.misses} misses")


if __name__ == "__main__":
    main()
