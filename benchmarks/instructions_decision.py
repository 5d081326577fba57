"""Deterministic cost of the decision path: CPU instructions of the bench's 100-iteration round, under valgrind.

Wall time on a shared machine drifts by ±20% from minute to minute; instruction counts do not. This script runs
the timed loop of ``run_iteration`` (budget, decision, re-basing; ``benchmarks/bench_fusion.py -k decision``'s
trace and preset, fresh caches; ``--preset`` another, ``--paper-trace`` the reproduction's trace) and, with
``--setup-only``, everything but that loop. Their difference is the decision path's instruction count:

    for mode in "" --setup-only; do
      PYTHONHASHSEED=0 OPENBLAS_NUM_THREADS=1 setarch -R valgrind --tool=cachegrind --cache-sim=no \\
        --cachegrind-out-file=/dev/null python benchmarks/instructions_decision.py $mode 2>&1 | grep "I *refs"
    done

(one BLAS thread and a fixed hash seed make the count reproducible to the instruction; ``--twice`` runs the
round a second time on the warm caches, which gives the all-hit floor.)
"""

from __future__ import annotations

import argparse

from bagualu2.costmodel import presets
from bagualu2.runtime import DecisionPath, run_iteration, spike_trace
from bagualu2.sim import paper_trace

HW = presets.hardware("paper-gpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setup-only", action="store_true", help="everything but the decision loop")
    parser.add_argument("--twice", action="store_true", help="run the round again on warm caches")
    parser.add_argument("--preset", default="glm-1041b-a35b", help="model preset (default glm-1041b-a35b)")
    parser.add_argument("--paper-trace", action="store_true",
                        help="the reproduction's trace (one rate per iteration, bagualu2 reproduce) instead")
    parser.add_argument("--start", type=int, default=0,
                        help="run the trace's first START iterations before the counted round, in both modes "
                             "(steady state: the iterations a run's median is made of)")
    args = parser.parse_args()
    model, parallel = presets.model(args.preset)
    n = parallel.num_microbatches
    total = args.start + 100
    if args.paper_trace:
        rates = paper_trace(total, seed=0)
        windows = [(rate,) * n for rate in rates]
    else:
        trace = spike_trace(total * n, spike_rate=0.029, max_imbalance=2.6, seed=0)
        windows = [trace[it * n:(it + 1) * n] for it in range(total)]
    path = DecisionPath(model, parallel, HW)
    for window in windows[:args.start]:  # not counted: setup of both modes
        assert run_iteration(path.engine, path.decide, window).fits
    windows = windows[args.start:]
    rounds = 0 if args.setup_only else 2 if args.twice else 1
    for _ in range(rounds):
        for window in windows:  # run_iteration's timed loop: budget, decision, re-basing
            assert run_iteration(path.engine, path.decide, window).fits
    print(f"{path.hits} hits, {path.misses} misses")


if __name__ == "__main__":
    main()
