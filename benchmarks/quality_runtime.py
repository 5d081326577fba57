"""Quality of the runtime decision path against a clairvoyant per-micro-batch greedy solve.

Replays spike traces (97% of micro-batches uniform in [1.0, 1.2], 3% spikes uniform up to 2.6x; several seeds)
through the decision path of several stages of Table II presets, ``--iterations`` iterations per replay with warm
caches, and reports per preset:

* ``wasted``: forwards whose budget covered their unmitigated bytes at the measured imbalance but ran a
  non-empty plan (share of all forwards);
* ``overhead ratio``: summed mitigation overhead of the plans the path ran (``evaluate`` on the graph at the
  measured imbalance) over that of ``greedy.solve`` on that graph with the same budget (clairvoyant);
* ``peak / M_max``: the largest in-flight bytes over the stage's activation capacity (must be <= 1).

Run: ``python benchmarks/quality_runtime.py [--iterations 4] [--seeds 0 1 2] [--downgrade graded|paper]``.
The same script measures the decision path before ``bagualu2.runtime`` existed (it falls back to
``bagualu2.sim``'s path and its call signature).
"""

from __future__ import annotations

import argparse
import sys
import time

from bagualu2.budget import BudgetAssigner
from bagualu2.costmodel import build_graph, evaluate, presets
from bagualu2.mitigation import greedy

try:
    from bagualu2.runtime import DecisionPath, spike_trace
    NEW = True
except ImportError:  # the tree before the runtime package
    from bagualu2.runtime import DecisionPath, spike_trace
    NEW = False

PRESETS = ("glm-188b-a20b", "glm-423b-a30b", "glm-1041b-a35b")


def replay(model, parallel, hardware, stage: int, trace, iterations: int, downgrade: str, extra=None):
    """``(forward rows, peak in-flight bytes, M_max, decision seconds)`` of ``iterations`` replayed iterations."""
    options = {"downgrade": downgrade, **(extra or {})} if NEW else {}
    path = DecisionPath(model, parallel, hardware, stage=stage, **options)
    memory, steps = path.engine.memory, path.engine.steps
    rows, peak, spent = [], 0, 0.0
    for it in range(iterations):
        window = trace[it * parallel.num_microbatches:(it + 1) * parallel.num_microbatches]
        assigner = BudgetAssigner(m_max_bytes=memory.m_max_bytes, m0_bytes=memory.m0_bytes,
                                  num_microbatches=len(steps) // 2, num_warmup=memory.inflight_chunks)
        for step in steps:
            if not step.forward:
                assigner.record_backward(step.index)
                continue
            started = time.perf_counter()
            budget = assigner.next_forward_budget()
            imbalance = window[step.microbatch]
            if NEW:
                limit = assigner.absorb_limit_bytes() if step.phase == "warmup" else None
                decision = path.forward(budget, imbalance, step.phase, step.chunk, limit_bytes=limit)
            else:
                decision = path.forward(budget, imbalance, step.phase, step.chunk)
            held = assigner.record_forward(step.index, decision.kept_bytes)
            spent += time.perf_counter() - started
            peak = max(peak, held)
            rows.append((step.chunk, imbalance, budget, decision.plan))
    return rows, peak, memory.m_max_bytes, spent


def score(model, parallel, hardware, stage, rows):
    """``(forwards, wasted, our overhead s, clairvoyant overhead s)``."""
    graphs, clairvoyant, ours = {}, {}, {}
    wasted = 0
    ours_s = best_s = 0.0
    for chunk, imbalance, budget, plan in rows:
        graph = graphs.get((chunk, imbalance))
        if graph is None:
            graph = graphs[(chunk, imbalance)] = build_graph(model, parallel, hardware, imbalance=imbalance,
                                                             chunk=chunk, stage=stage)
        if budget >= graph.unmitigated_bytes and len(plan):
            wasted += 1
        key = (chunk, imbalance, plan.entries)
        if key not in ours:
            ours[key] = evaluate(graph, plan).overhead_s
        ours_s += ours[key]
        key = (chunk, imbalance, budget)
        if key not in clairvoyant:
            solution = greedy.solve(graph, budget)
            clairvoyant[key] = solution.cost.overhead_s if solution.ok else float("inf")
        best_s += clairvoyant[key]
    return len(rows), wasted, ours_s, best_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="paper-gpu")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--presets", nargs="+", default=list(PRESETS))
    parser.add_argument("--downgrade", default="graded", choices=["graded", "paper"])
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                        help="a DecisionPath keyword, e.g. spike_step=0.1 (repeatable)")
    args = parser.parse_args()
    extra = {}
    for item in args.option:
        key, _, value = item.partition("=")
        extra[key] = int(value) if value.isdigit() else float(value)
    hardware = presets.hardware(args.hardware)
    print("| preset | stages | forwards | wasted (share) | overhead / clairvoyant | peak / M_max | decision ms/it |")
    print("|---|---|---|---|---|---|---|")
    for name in args.presets:
        model, parallel = presets.model(name)
        stages = sorted({0, parallel.pp // 2, parallel.pp - 1})
        totals = [0, 0, 0.0, 0.0]
        worst, spent = 0.0, 0.0
        for stage in stages:
            for seed in args.seeds:
                trace = spike_trace(args.iterations * parallel.num_microbatches, spike_rate=0.03,
                                    max_imbalance=2.6, base_imbalance=1.1, base_jitter=0.1, seed=seed) \
                    if NEW else _old_trace(args.iterations * parallel.num_microbatches, seed)
                rows, peak, m_max, seconds = replay(model, parallel, hardware, stage, trace, args.iterations,
                                                    args.downgrade, extra)
                for i, value in enumerate(score(model, parallel, hardware, stage, rows)):
                    totals[i] += value
                worst = max(worst, peak / m_max)
                spent += seconds
            print(f"  {name} stage {stage} done", file=sys.stderr)
        forwards, wasted, ours_s, best_s = totals
        ratio = ours_s / best_s if best_s else (1.0 if not ours_s else float("inf"))
        runs = len(stages) * len(args.seeds) * args.iterations
        print(f"| {name} | {','.join(map(str, stages))} | {forwards} | {wasted} ({wasted / forwards:.2%}) | "
              f"{ratio:.3f} ({ours_s:.2f} s / {best_s:.2f} s) | {worst:.4f} | {spent / runs * 1e3:.2f} |")


def _old_trace(n: int, seed: int):
    """The same trace statistics, drawn with the same generator, for the tree without ``base_jitter``."""
    import random

    rng = random.Random(seed)
    return tuple(round(rng.uniform(1.2, 2.6), 2) if rng.random() < 0.03 else round(rng.uniform(1.0, 1.2), 2)
                 for _ in range(n))


if __name__ == "__main__":
    main()
