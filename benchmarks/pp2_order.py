"""The fused order at x - y = 2 against the sequential order, per point (the cost model's times).

At x - y = 2 (the first stage of a paired PP=2 pipeline) the offload (of x-1) and the recovery (of y+1) copy the
same micro-batch, so ``dp.solve(chains,
pipeline_degree=2)`` orders F and B with the DP and puts O and R at the point's edges. This prints, for a steady
point of a few presets cut to PP=2 (one virtual stage) with greedy plans at two budgets and a plan that offloads
the experts' activations, the makespan of the sequential order, of the degree-2 order and of the DP without the
degree-2 constraint (a lower reference):

    python benchmarks/pp2_order.py
"""

from __future__ import annotations

import dataclasses

from bagualu2.costmodel import Plan, build_graph, presets
from bagualu2.fusion import baselines, build_chains, dp
from bagualu2.mitigation import greedy

PRESETS = ("tiny-moe", "glm-188b-a20b", "glm-1041b-a35b")


def main() -> None:
    hardware = presets.hardware("paper-gpu")
    print("| preset (PP=2) | plan: greedy at a budget share (floor→unmitigated), or offload | chains | sequential, ms | degree-2 order, ms "
          "| ratio | DP without the constraint, ms |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name in PRESETS:
        model, parallel = presets.model(name)
        parallel = dataclasses.replace(parallel, pp=2, vp=1)
        graph = build_graph(model, parallel, hardware)
        for share in (0.3, 0.6, "offload"):
            if share == "offload":
                plan = Plan.from_str("expert_fc1=OFFLOAD,expert_act=OFFLOAD")
            else:
                budget = graph.floor_bytes + int(share * (graph.unmitigated_bytes - graph.floor_bytes))
                plan = greedy.solve(graph, budget).plan
            chains = build_chains(graph, plan, graph, plan, hardware=hardware)
            sequential = baselines.sequential(chains).makespan_ns
            degree2 = dp.solve(chains, pipeline_degree=2).makespan_ns
            free = dp.solve(chains).makespan_ns
            kinds = "".join(kind for kind, chain in zip("FBOR", (chains.forward, chains.backward, chains.offload,
                                                                  chains.recovery)) if chain is not None)
            label = share if isinstance(share, str) else f"{share:.1f}"
            print(f"| {name} | {label} | {kinds} | {sequential / 1e6:.3f} | {degree2 / 1e6:.3f} | "
                  f"{degree2 / sequential:.3f} | {free / 1e6:.3f} |")


if __name__ == "__main__":
    main()
