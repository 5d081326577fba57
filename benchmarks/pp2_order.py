"""The fused order at x - y = 2 and at x - y = 1 against the orders it replaces, per point (the cost model's times).

At x - y = 2 (the first stage of a paired PP=2 pipeline) the offload (of x-1) and the recovery (of y+1) copy the
same micro-batch, so ``dp.solve(chains, pipeline_degree=2)`` orders F and B with the DP and puts O and R at the
point's edges. At x - y = 1 (every point of a paired pipeline's last stage) the forward before F_x is B_y's own
micro-batch, so the point's copies are its own micro-batches': ``dp.solve(chains, pipeline_degree=1)``
(``dp.with_own_copies``) runs them beside their own forward and backward. For a steady point of a few presets cut
to PP=2 (one virtual stage) with greedy plans at two budgets and a plan that offloads the experts' activations,
this prints (default, ``--degree 2``) the makespan of the sequential order, of the degree-2 order and of the DP
without the degree-2 constraint (a lower reference), or (``--degree 1``, the last stage) of the sequential
order, of Megatron-Core's execution with its copies on copy streams (``baselines.megatron_overlapped``, the
copies its own), of the
DP's F and B with the copies after them, and of the degree-1 order:

    python benchmarks/pp2_order.py [--degree 1]
"""

from __future__ import annotations

import argparse
import dataclasses

from bagualu2.costmodel import Plan, build_graph, point_relation, presets
from bagualu2.fusion import Chains, Order, baselines, build_chains, dp, simulate
from bagualu2.mitigation import greedy

PRESETS = ("tiny-moe", "glm-188b-a20b", "glm-1041b-a35b")
HEADERS = {2: ("sequential, ms", "degree-2 order, ms", "ratio", "DP without the constraint, ms"),
           1: ("sequential, ms", "Megatron-Core, ms", "copies after F and B, ms", "degree-1 order, ms")}


def copies_after(chains: Chains) -> int:
    """The DP's order of F and B, then every copy and recovery stage one at a time."""
    core = dp.solve(Chains(chains.forward, chains.backward)).groups
    rest = tuple(((chain.kind, i),) for chain in (chains.offload, chains.recovery) if chain is not None
                 for i in range(len(chain)))
    return simulate(Order(core + rest), chains).makespan_ns


def columns(chains: Chains, degree: int) -> str:
    sequential = baselines.sequential(chains).makespan_ns
    if degree == 2:
        ordered = dp.solve(chains, pipeline_degree=2).makespan_ns
        return (f"{sequential / 1e6:.3f} | {ordered / 1e6:.3f} | {ordered / sequential:.3f} | "
                f"{dp.solve(chains).makespan_ns / 1e6:.3f}")
    times = (sequential, baselines.megatron_overlapped(chains, own=True).makespan_ns, copies_after(chains),
             dp.solve(chains, pipeline_degree=1).makespan_ns)
    return " | ".join(f"{t / 1e6:.3f}" for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--degree", type=int, choices=(1, 2), default=2, help="the points' x - y (default 2)")
    degree = parser.parse_args().degree
    hardware = presets.hardware("paper-gpu")
    stage = 0 if degree == 2 else 1
    where = "PP=2" if degree == 2 else "PP=2, last stage"
    print(f"| preset ({where}) | plan: greedy at a budget share (floor→unmitigated), or offload | chains | "
          + " | ".join(HEADERS[degree]) + " |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name in PRESETS:
        model, parallel = presets.model(name)
        parallel = dataclasses.replace(parallel, pp=2, vp=1, paired=True)
        if point_relation(parallel, stage) != degree:
            raise SystemExit(f"{name}: stage {stage} of a paired PP=2 pipeline is not of relation {degree}")
        graph = build_graph(model, parallel, hardware, stage=stage)
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
            print(f"| {name} | {label} | {kinds} | {columns(chains, degree)} |")


if __name__ == "__main__":
    main()
