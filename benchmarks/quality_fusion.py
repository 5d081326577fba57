"""Quality suite of the fusion DP: DP makespan against the CP-SAT optimum, the lower bound and the baselines.

Table II presets x imbalance {1.0, 1.6, 2.6} x 5 budgets between M0 and the unmitigated bytes; each point plans
the micro-batch with the greedy solver and schedules the steady-state point F_x B_y with the same graph and
plan for x and y. Run: ``python benchmarks/quality_fusion.py [--hardware paper-gpu] [--time-limit 10]``.
"""

from __future__ import annotations

import statistics
import time

from bagualu2.fusion import baselines, build_chains, dp, exact
from bagualu2.mitigation import greedy
import suite
from suite import percentile

def run(hardware_name: str, time_limit_s: float, models=suite.TABLE_II, imbalances=(1.0, 1.6, 2.6),
        count: int = 5):
    rows = []
    for name, imbalance, graph, budget in suite.points(hardware_name, models, imbalances, count):
        plan = greedy.solve(graph, budget).plan
        chains = build_chains(graph, plan, graph, plan, hardware=graph.hardware)
        started = time.perf_counter()
        order = dp.solve(chains)
        dp_s = time.perf_counter() - started
        best = exact.solve(chains, time_limit_s=time_limit_s, hint=order)
        rows.append({"model": name, "imbalance": imbalance, "budget": budget, "dp": order.makespan_ns,
                     "exact": best.makespan_ns, "proven": best.solver == "exact", "lower": chains.lower_bound_ns,
                     "dp_s": dp_s, "counts": chains.counts(),
                     **{k: f(chains).makespan_ns for k, f in baselines.BASELINES.items()}})
    return rows


def report(rows) -> str:
    def line(label, values):
        return (f"| {label} | {statistics.median(values):.4f} | {percentile(values, .95):.4f} | {max(values):.4f} | "
                f"{min(values):.4f} |")
    out = ["| ratio | median | p95 | max | min |", "|---|---|---|---|---|",
           line("DP / CP-SAT optimum", [r["dp"] / r["exact"] for r in rows]),
           line("DP / lower bound", [r["dp"] / r["lower"] for r in rows])]
    for key in baselines.BASELINES:
        out.append(line(f"{key} / DP (speedup)", [r[key] / r["dp"] for r in rows]))
    dp_ms = [r["dp_s"] * 1e3 for r in rows]
    out.append("")
    out.append(f"{len(rows)} points; CP-SAT proved {sum(r['proven'] for r in rows)} optimal; DP solve median "
               f"{statistics.median(dp_ms):.2f} ms, max {max(dp_ms):.2f} ms (one run, perf_counter)")
    return "\n".join(out)


if __name__ == "__main__":
    suite.main(__doc__, run, report, default_time_limit_s=10.0)
