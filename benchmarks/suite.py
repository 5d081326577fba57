"""Shared plumbing of the quality-suite scripts: a percentile and the command-line entry point."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Iterator

from bagualu2.costmodel import OpGraph, build_graph, presets


TABLE_II = tuple(name for name in presets.model_names() if name.startswith("glm-"))


def points(hardware_name: str, models, imbalances, count: int) -> Iterator[tuple[str, float, OpGraph, int]]:
    """``(model, imbalance, graph of stage 0 chunk 0, budget)`` for ``count`` budgets from M0 to unmitigated."""
    hardware = presets.hardware(hardware_name)
    for name in models:
        model, parallel = presets.model(name)
        for imbalance in imbalances:
            graph = build_graph(model, parallel, hardware, imbalance=imbalance)
            lo, hi = graph.floor_bytes, graph.unmitigated_bytes
            for step in range(count):
                yield name, imbalance, graph, lo + (hi - lo) * step // (count - 1)
            print(f"  {name} r={imbalance} done", file=sys.stderr)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile ``q`` in [0, 1] of ``values``."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main(doc: str, run: Callable[[str, float], list], report: Callable[[list], str], *,
         default_time_limit_s: float) -> None:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--hardware", default="paper-gpu")
    parser.add_argument("--time-limit", type=float, default=default_time_limit_s)
    args = parser.parse_args()
    started = time.perf_counter()
    rows = run(args.hardware, args.time_limit)
    print(report(rows))
    print(f"\n({len(rows)} instances in {time.perf_counter() - started:.0f} s on {args.hardware})", file=sys.stdout)
