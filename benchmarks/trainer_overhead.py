"""Planning overhead of the distributed reference trainer on CPU: budget + plan + order per step over step time.

Launches ``torchrun --standalone --nproc_per_node=4 -m reference_trainer.train`` for each layout (the
``glm_moe_debug`` recipe, its default activation cap) and reads the JSONL metrics: per step, ``planning_s`` is the
largest of the ranks' planning seconds (budgets, pre-gate plans, gate bookkeeping, fused orders; the EP agreement
all-reduce is communication and reported apart as ``agree_s``), ``step_s`` the slowest rank's step.

Run: ``python benchmarks/trainer_overhead.py [--steps 50] [--layouts pp2dp2 pp4dp1]``; one table line per layout:
total planning / total step time, the same over the last quarter of the steps (the after-gate decisions are
memoised: a run pays for each distinct one once), the median step's share, the EP agreement's share, first -> last
loss.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = {"pp2dp2": ["--pp", "2", "--dp", "2", "--ep", "2"], "pp4dp1": ["--pp", "4", "--dp", "1", "--ep", "1"],
           "pp2dp2-plain": ["--pp", "2", "--dp", "2", "--ep", "2", "--schedule", "plain"]}


def measure(layout: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        torchrun = Path(sys.executable).with_name("torchrun")
        proc = subprocess.run([str(torchrun), "--standalone", "--nproc_per_node=4", "-m", "reference_trainer.train",
                               "--steps", str(steps), "--metrics-file", str(metrics), *LAYOUTS[layout]],
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.stderr[-3000:])
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps_ = [r for r in records if not r.get("summary")]
    step_s = sum(r["step_s"] for r in steps_)
    last = steps_[len(steps_) * 3 // 4:]  # the last quarter: most gate decisions are memoised by then
    return {"layout": layout, "steps": len(steps_),
            "planning": sum(r["planning_s"] for r in steps_) / step_s,
            "last": sum(r["planning_s"] for r in last) / sum(r["step_s"] for r in last),
            "median": statistics.median(r["planning_s"] / r["step_s"] for r in steps_),
            "agree": sum(r["agree_s"] for r in steps_) / step_s,
            "step_s": statistics.median(r["step_s"] for r in steps_),
            "loss": (steps_[0]["loss"], steps_[-1]["loss"]),
            "exact": all(mb["kept_bytes"] == mb["predicted_bytes"] for r in steps_ for mb in r["microbatches"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--layouts", nargs="+", default=["pp2dp2", "pp4dp1"], choices=sorted(LAYOUTS))
    args = parser.parse_args()
    print("| layout | steps | planning / step time | last quarter | median step | EP agreement | median step s | "
          "loss | kept == predicted |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for layout in args.layouts:
        r = measure(layout, args.steps)
        print(f"| {layout} | {r['steps']} | {r['planning']:.2%} | {r['last']:.2%} | {r['median']:.2%} | "
              f"{r['agree']:.2%} | "
              f"{r['step_s']:.3f} | {r['loss'][0]:.3f} -> {r['loss'][1]:.3f} | {r['exact']} |", flush=True)


if __name__ == "__main__":
    main()
