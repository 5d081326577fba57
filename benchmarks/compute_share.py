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

When the ranks outnumber the cores, an op's wall time also holds the time its thread was runnable but had no core,
and a rank's wall time the time it waited for one. So a second run counts CPU time instead: a dispatch mode reads
the thread's CPU clock (``time.thread_time_ns``) around every aten and c10d op, forward and backward, and the groups
are divided by the process's CPU time over the same steps (``getrusage``: every thread, gloo's included; what no op
covers is Python, hooks, the schedule, gloo's threads and the mode's own overhead). ``machine busy`` is the ranks'
CPU time over the cores' time (``os.sched_getaffinity``) over the median rank's window.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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


def process_cpu_s() -> float:
    """CPU seconds of every thread of this process so far (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def op_clock(totals: dict[str, float]):
    """A dispatch mode adding each op's thread CPU seconds to ``totals[name]`` (names as the profiler's)."""
    from torch.utils._python_dispatch import TorchDispatchMode  # private torch API (no public one); benchmark only

    class OpClock(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            started = time.thread_time_ns()
            result = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket).replace(".", "::", 1)
            totals[name] = totals.get(name, 0.0) + (time.thread_time_ns() - started) / 1e9
            return result

    return OpClock()


def worker(out: str, argv: list[str]) -> None:
    """torchrun's entry: the trainer, measured from its second step on the clock ``COMPUTE_SHARE_CLOCK`` (``wall``:
    the profiler; ``cpu``: :func:`op_clock`), the group totals to ``out.<rank>.json``."""
    sys.path.insert(0, str(ROOT))
    import torch
    from torch.profiler import ProfilerActivity, profile

    from reference_trainer import session
    from reference_trainer.train import main

    clock = os.environ.get("COMPUTE_SHARE_CLOCK", "wall")
    state: dict = {"profiler": None, "started": None, "cpu_s": None, "ops": {}}
    run_step = session.Session._run_step

    def profiled_step(self, step: int):
        if state["profiler"] is None and step >= 1:
            state["profiler"] = (profile(activities=[ProfilerActivity.CPU]) if clock == "wall"
                                 else op_clock(state["ops"]))
            state["profiler"].__enter__()
            state["started"], state["cpu_s"] = time.perf_counter(), process_cpu_s()
        return run_step(self, step)

    session.Session._run_step = profiled_step
    try:
        main(argv)
    finally:
        totals = dict.fromkeys(GROUPS, 0.0)
        others: dict[str, float] = {}
        wall_s = cpu_s = 0.0
        prof = state["profiler"]
        if prof is not None:
            wall_s, cpu_s = time.perf_counter() - state["started"], process_cpu_s() - state["cpu_s"]
            prof.__exit__(None, None, None)
            ops = state["ops"] if clock == "cpu" else {
                event.key: event.self_cpu_time_total / 1e6 for event in prof.key_averages()}
            for name, seconds in ops.items():
                group = group_of(name)
                if group is not None:
                    totals[group] += seconds
                if group == "other ops":
                    others[name] = seconds
        with open(f"{out}.{os.environ.get('RANK', '0')}.json", "w") as handle:
            json.dump({"wall_s": wall_s, "threads": torch.get_num_threads(), "cpu_s": cpu_s, **totals,
                       "top_other_ops": sorted(others.items(), key=lambda kv: -kv[1])[:8]}, handle)


def measure(recipe: str, steps: int, extra: list[str], tmp: Path, clock: str) -> list[dict]:
    """Run the trainer measured on ``clock`` (``wall`` or ``cpu``); one dict of group seconds, wall and CPU seconds
    per rank."""
    sys.path.insert(0, str(ROOT))
    from reference_trainer.train import parse_args

    nproc = parse_args(["--recipe", recipe, *extra])[0].world_size
    out = tmp / f"share-{clock}"
    env = {**os.environ, "COMPUTE_SHARE_CLOCK": clock, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
               "--worker", str(out), "--", "--recipe", recipe, "--steps", str(steps), *extra]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"the profiled run failed:\n{proc.stderr[-3000:]}")
    return [json.loads(Path(f"{out}.{rank}.json").read_text()) for rank in range(nproc)]


def table(ranks: list[dict], clock: str) -> str:
    """Markdown: each group's share of the rank's wall time (``wall``) or of its process's CPU time (``cpu``)."""
    of, rest = {"wall": ("wall_s", "Python, hooks, schedule, idle"),
                "cpu": ("cpu_s", "the rest: Python, hooks, gloo's threads, the clock")}[clock]
    timed = [r for r in ranks if r[of] > 0]
    lines = [f"| share of a step's {'wall' if clock == 'wall' else 'CPU'} time | median over ranks | range |",
             "| --- | --- | --- |"]
    shares = {group: [r[group] / r[of] for r in timed] for group in GROUPS}
    shares["matmul + attention"] = [a + b for a, b in zip(shares["matmul"], shares["attention"])]
    shares[rest] = [max(1 - sum(r[g] for g in GROUPS) / r[of], 0.0) for r in timed]
    for name, values in shares.items():
        lines.append(f"| {name} | {statistics.median(values):.1%} | {min(values):.1%} - {max(values):.1%} |")
    if clock == "cpu":
        cores = len(os.sched_getaffinity(0))
        busy = sum(r["cpu_s"] for r in timed) / (cores * statistics.median(r["wall_s"] for r in timed))
        lines.append(f"\nmachine busy: {busy:.1%} of {cores} cores (the ranks' CPU time / (cores x wall time))")
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
        runs = {clock: measure(args.recipe, args.steps, extra, Path(tmp), clock) for clock in ("wall", "cpu")}
    layout = f" --layout '{args.layout}'" if args.layout else ""
    print(f"`python benchmarks/compute_share.py --recipe {args.recipe} --steps {args.steps} --policy {args.policy} "
          f"--schedule {args.schedule}{layout}` ({len(runs['wall'])} ranks, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '1')})\n")
    for clock, ranks in runs.items():
        print(table(ranks, clock))
        print(f"\nthe largest other ops ({clock} seconds, rank 0):",
              ", ".join(f"{name} {sec:.2f}" for name, sec in ranks[0]["top_other_ops"]), "\n")


if __name__ == "__main__":
    main()
