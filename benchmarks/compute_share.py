"""Where a reference-trainer step spends its time on CPU: matmuls, attention, the rest (``torch.profiler``).

    python benchmarks/compute_share.py --recipe glm_moe_bench --steps 4 [--policy ideal] [--schedule plain]
        [--layout '--pp 1 --dp 1 --ep 1']

Runs the trainer under torchrun (the recipe's layout or ``--layout``'s flags, ``OMP_NUM_THREADS=1``, no spikes)
with ``torch.profiler`` (CPU activities) from the second step on; the first step traces and plans. The profiler
follows the rank's main thread, so the default schedule is ``plain`` (under ``runtime`` the fused points run on the
dual-batch executor's worker threads, which it misses). Per rank, the self time of each aten op is summed into
groups — ``matmul`` (mm, addmm, bmm, baddbmm), ``attention`` (scaled-dot-product attention kernels, forward and
backward), ``collectives`` (c10d ops: the time their calls take, waits included), ``other ops`` (every other aten
op) — and divided by the rank's profiled wall time. What no op covers is Python, hooks, the schedule and the time
the rank waits (for a core, a peer or a pipeline bubble). Printed: a markdown table, one row per group, the share's
median and range over the ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchrun_worker import worker_argv

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("matmul", "attention", "collectives", "other ops")
MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_addmm_activation", "aten::addbmm")


def group_of(name: str) -> str | None:
    """The group of an op's self time (None: not an aten op, e.g. a ``record_function`` range)."""
    if name in MATMUL:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    if name.startswith("c10d::") or "all_to_all" in name or "allreduce" in name or "all_reduce" in name \
            or name.startswith("gloo:") or name.startswith("nccl:"):
        return "collectives"
    if name.startswith("aten::"):
        return "other ops"
    return None


def worker(out: str, argv: list[str]) -> None:
    """torchrun's entry: the trainer, profiled from its second step, the group totals to ``out.<rank>.json``."""
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.profiler import ProfilerActivity, profile

    from reference_trainer import session
    from reference_trainer.train import main

    state: dict = {"profiler": None, "started": None}
    run_step = session.Session._run_step

    def profiled_step(self, step: int):
        if state["profiler"] is None and step >= 1:
            state["profiler"] = profile(activities=[ProfilerActivity.CPU])
            state["profiler"].__enter__()
            state["started"] = time.perf_counter()
        return run_step(self, step)

    session.Session._run_step = profiled_step
    try:
        main(argv)
    finally:
        totals = dict.fromkeys(GROUPS, 0.0)
        wall_s = 0.0
        prof = state["profiler"]
        if prof is not None:
            wall_s = time.perf_counter() - state["started"]
            prof.__exit__(None, None, None)
            for event in prof.key_averages():
                group = group_of(event.key)
                if group is not None:
                    totals[group] += event.self_cpu_time_total / 1e6
        with open(f"{out}.{os.environ.get('RANK', '0')}.json", "w") as handle:
            json.dump({"wall_s": wall_s, "threads": torch.get_num_threads(), **totals}, handle)


def measure(recipe: str, steps: int, extra: list[str], tmp: Path) -> list[dict]:
    """Run the trainer under the profiler; one dict of group seconds and wall seconds per rank."""
    sys.path.insert(0, str(ROOT))
    from reference_trainer.train import parse_args

    nproc = parse_args(["--recipe", recipe, *extra])[0].world_size
    out = tmp / "share"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
               "--worker", str(out), "--", "--recipe", recipe, "--steps", str(steps), *extra]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"the profiled run failed:\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(nproc)]


def table(ranks: list[dict]) -> str:
    lines = ["| share of a step (steps after the first) | median over ranks | range |", "| --- | --- | --- |"]
    shares = {group: [r[group] / r["wall_s"] for r in ranks if r["wall_s"] > 0] for group in GROUPS}
    shares["matmul + attention"] = [a + b for a, b in zip(shares["matmul"], shares["attention"])]
    covered = [sum(r[g] for g in GROUPS) / r["wall_s"] for r in ranks if r["wall_s"] > 0]
    shares["Python, hooks, schedule, idle"] = [max(1 - c, 0.0) for c in covered]
    for name, values in shares.items():
        lines.append(f"| {name} | {statistics.median(values):.1%} | {min(values):.1%} - {max(values):.1%} |")
    return "\n".join(lines)


def main() -> None:
    found = worker_argv(sys.argv)
    if found is not None:
        worker(*found)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="glm_moe_bench")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--policy", default="ideal")
    parser.add_argument("--schedule", default="plain",
                        help="plain (default): every op on the rank's main thread, which the profiler follows")
    parser.add_argument("--layout", default="", help="trainer flags of another layout, e.g. '--pp 1 --dp 1 --ep 1'")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be >= 2 (the first step is not profiled)")
    extra = ["--policy", args.policy, "--schedule", args.schedule, "--spike-rate", "0", *args.layout.split()]
    with tempfile.TemporaryDirectory() as tmp:
        ranks = measure(args.recipe, args.steps, extra, Path(tmp))
    layout = f" --layout '{args.layout}'" if args.layout else ""
    print(f"`python benchmarks/compute_share.py --recipe {args.recipe} --steps {args.steps} --policy {args.policy} "
          f"--schedule {args.schedule}{layout}` ({len(ranks)} ranks, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '1')})\n")
    print(table(ranks))


if __name__ == "__main__":
    main()
