"""The fused order at x - y = 1 against Megatron-Core's execution and against the copies run after F and B.

At x - y = 1 (every point of a paired pipeline's last stage; pp = 1 ``paired``) the forward before F_x is B_y's own
micro-batch, so the point's copies are its own micro-batches': ``dp.solve(chains, pipeline_degree=1)``
(``dp.with_own_copies``) runs them beside their own forward and backward. This prints, for a steady point of the
last stage of a few presets cut to PP=2 (one virtual stage) with greedy plans at two budgets and a plan that
offloads the experts' activations, the makespan of the sequential order, of Megatron-Core's execution with its
copies on copy streams (``baselines.megatron_overlapped``), of the DP's F and B with the copies after them, and of
the degree-1 order:

    python benchmarks/degree1_order.py
"""

from __future__ import annotations

import dataclasses

from bagualu2.costmodel import Plan, build_graph, point_relation, presets
from bagualu2.fusion import Chains, Order, baselines, build_chains, dp, simulate
from bagualu2.mitigation import greedy

PRESETS = ("tiny-moe", "glm-188b-a20b", "glm-1041b-a35b")


def copies_after(chains: Chains) -> int:
    """The DP's order of F and B, then every copy and recovery stage one at a time."""
    core = dp.solve(Chains(chains.forward, chains.backward)).groups
    rest = tuple(((chain.kind, i),) for chain in (chains.offload, chains.recovery) if chain is not None
                 for i in range(len(chain)))
    return simulate(Order(core + rest), chains).makespan_ns


def main() -> None:
    hardware = presets.hardware("paper-gpu")
    print("| preset (PP=2, last stage) | plan: greedy at a budget share (floor→unmitigated), or offload | chains "
          "| sequential, ms | Megatron-Core, ms | copies after F and B, ms | degree-1 order, ms |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name in PRESETS:
        model, parallel = presets.model(name)
        parallel = dataclasses.replace(parallel, pp=2, vp=1, paired=True)
        assert point_relation(parallel, 1) == 1
        graph = build_graph(model, parallel, hardware, stage=1)
        for share in (0.3, 0.6, "offload"):
            if share == "offload":
                plan = Plan.from_str("expert_fc1=OFFLOAD,expert_act=OFFLOAD")
            else:
                budget = graph.floor_bytes + int(share * (graph.unmitigated_bytes - graph.floor_bytes))
                plan = greedy.solve(graph, budget).plan
            chains = build_chains(graph, plan, graph, plan, hardware=hardware)
            kinds = "".join(kind for kind, chain in zip("FBOR", (chains.forward, chains.backward, chains.offload,
                                                                  chains.recovery)) if chain is not None)
            label = share if isinstance(share, str) else f"{share:.1f}"
            times = (baselines.sequential(chains).makespan_ns, baselines.megatron_overlapped(chains).makespan_ns,
                     copies_after(chains), dp.solve(chains, pipeline_degree=1).makespan_ns)
            print(f"| {name} | {label} | {kinds} | " + " | ".join(f"{t / 1e6:.3f}" for t in times) + " |")


if __name__ == "__main__":
    main()
