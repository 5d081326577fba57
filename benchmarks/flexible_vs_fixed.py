"""flexible against every fixed plan, iteration by iteration, with the plans made for the trace's highest rate.

For each Table II preset at its layout, each hardware profile and each planned imbalance ``p``: a paper trace whose
spikes (on one micro-batch of half the iterations) reach ``p`` and whose ordinary rates lie in [1.0, min(1.2, p)],
every policy's plans made for ``p`` (``simulate(..., plan_imbalance=p)``), so no spike is above what the fixed
plans were made for. Reported per (profile, p): the largest ratio flexible's iteration time / a fixed plan's
(static-under, static-over, kwai, adapipe, L1, L2) over every iteration that neither ran out of memory, and where.
A ratio above 1 is an iteration where a fixed plan was faster than flexible.

Run: ``python benchmarks/flexible_vs_fixed.py [--plans 1.5 2.0 2.6] [--hardware paper-gpu h100 h200]
[--iterations 4] [--seed 1]``.
"""

from __future__ import annotations

import argparse
import time

from bagualu2.costmodel import presets
from bagualu2.sim import paper_trace, simulate

FIXED = ("static-under", "static-over", "kwai", "adapipe", "L1", "L2")


def worst(name: str, hardware, plan: float, iterations: int, seed: int) -> tuple[float, str]:
    """The largest flexible / fixed-plan iteration-time ratio on preset ``name`` and the policy it was against."""
    model, parallel = presets.model(name)
    trace = paper_trace(iterations, seed=seed, base_high=min(1.2, plan), spike_max=plan,
                        spike_share=0.5 if plan > 1.2 else 0.0, num_microbatches=parallel.num_microbatches)
    flexible = simulate(model, parallel, hardware, "flexible", trace, plan_imbalance=plan)
    found = (0.0, "")
    for policy in FIXED:
        fixed = simulate(model, parallel, hardware, policy, trace, plan_imbalance=plan)
        for mine, theirs in zip(flexible.iterations, fixed.iterations):
            if not (mine.oom or theirs.oom) and mine.time_s / theirs.time_s > found[0]:
                found = (mine.time_s / theirs.time_s, policy)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plans", nargs="+", type=float, default=[1.2, 1.5, 2.0, 2.6])
    parser.add_argument("--hardware", nargs="+", default=["paper-gpu", "h100", "h200"])
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    names = [name for name in presets.model_names() if name.startswith("glm-")]
    print("| profile | plans and spikes up to | worst flexible / fixed | against | on |")
    print("| --- | ---: | ---: | --- | --- |")
    started = time.perf_counter()
    for hardware_name in args.hardware:
        hardware = presets.hardware(hardware_name)
        for plan in args.plans:
            ratio, policy, where = 0.0, "", ""
            for name in names:
                found, against = worst(name, hardware, plan, args.iterations, args.seed)
                if found > ratio:
                    ratio, policy, where = found, against, name
            print(f"| {hardware_name} | {plan:g} | {ratio:.4f} | {policy} | {where} |", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
