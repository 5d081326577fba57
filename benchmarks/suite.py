"""Shared plumbing of the quality-suite scripts: a percentile and the command-line entry point."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable


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
