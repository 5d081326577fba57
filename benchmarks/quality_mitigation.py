"""Quality suite of the mitigation solvers: greedy overhead / exact overhead over the paper's presets.

Table II presets x imbalance {1.0, 1.2, 1.6, 2.0, 2.6} x 10 budgets from M0 to the unmitigated bytes (stage 0,
chunk 0). Prints the ratio distribution of both greedy variants against CP-SAT, exact statuses and solve
times as Markdown. Run: ``python benchmarks/quality_mitigation.py [--hardware paper-gpu] [--time-limit 5]``.
"""

from __future__ import annotations

import statistics

from bagualu2.mitigation import exact, greedy
from bagualu2.mitigation.greedy import GreedyConfig
import suite
from suite import percentile

IMBALANCES = (1.0, 1.2, 1.6, 2.0, 2.6)


def run(hardware_name: str, time_limit_s: float, models=suite.TABLE_II, imbalances=IMBALANCES, count: int = 10):
    rows = []
    for name, imbalance, graph, budget in suite.points(hardware_name, models, imbalances, count):
        best = exact.solve(graph, budget, time_limit_s=time_limit_s, num_workers=1, seed=0)
        fast = greedy.solve(graph, budget)
        paper = greedy.solve(graph, budget, config=GreedyConfig(variant="paper"))
        rows.append({"model": name, "imbalance": imbalance, "budget": budget, "exact": best, "greedy": fast,
                     "paper": paper})
    return rows


def ratios(rows, key: str) -> list[float]:
    return [r[key].cost.overhead_ns / r["exact"].cost.overhead_ns for r in rows if r["exact"].cost.overhead_ns]


def report(rows) -> str:
    lines = ["| solver | instances | median | p95 | max | share ≤ 1.01 |", "|---|---|---|---|---|---|"]
    for key, label in (("greedy", "greedy (improved)"), ("paper", "greedy (paper)")):
        values = ratios(rows, key)
        lines.append(f"| {label} | {len(values)} | {statistics.median(values):.4f} | {percentile(values, .95):.4f} "
                     f"| {max(values):.4f} | {sum(v <= 1.01 for v in values) / len(values):.0%} |")
    statuses: dict[str, int] = {}
    for row in rows:
        statuses[row["exact"].status.name] = statuses.get(row["exact"].status.name, 0) + 1
    exact_s = [r["exact"].solve_time_s for r in rows]
    greedy_ms = [r["greedy"].solve_time_s * 1e3 for r in rows]
    lines += ["", f"exact statuses: {statuses}; exact solve time median {statistics.median(exact_s):.3f} s, "
              f"p95 {percentile(exact_s, .95):.3f} s, max {max(exact_s):.3f} s; "
              f"greedy median {statistics.median(greedy_ms):.3f} ms, max {max(greedy_ms):.3f} ms "
              "(solve_time_s, one run, includes the final evaluate)"]
    return "\n".join(lines)


if __name__ == "__main__":
    suite.main(__doc__, run, report, default_time_limit_s=5.0)
