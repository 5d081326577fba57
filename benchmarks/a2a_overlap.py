"""How much of the EP all-to-all time the reference trainer hides under the other micro-batch's compute.

    python benchmarks/a2a_overlap.py --steps 6            # PP2 x DP2 (EP2), glm_moe_debug, runtime vs plain
    python benchmarks/a2a_overlap.py --steps 8 --recipe glm_moe_bench   # the compute-bound recipe, no spikes
    python benchmarks/a2a_overlap.py --steps 12 --paired                 # runtime with --paired (combined 1F1B)

Runs the trainer under torchrun twice, ``--schedule runtime`` (fused F_x B_y points: each all-to-all is issued
asynchronously and the other micro-batch's next stage runs before it is waited for) and ``--schedule plain``
(torch's 1F1B: every all-to-all waited for at once). Every rank records, per exchange (dispatch and combine, forward
and backward), when it was issued, when its thread started waiting and when the wait returned
(``reference_trainer.functions.TIMELINE``). Reported per schedule: the exchanges' total time from issue to done,
the time threads spent blocked in the wait (exposed), and the step time (median over the steps after the first).
The hidden share is ``1 - exposed(runtime) / exposed(plain)``: the blocking time the fused order took off the
same collectives. Steps after the first only (the first traces and plans).
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

from torchrun_worker import worker_argv

ROOT = Path(__file__).resolve().parents[1]


def worker(out: str, argv: list[str]) -> None:
    """torchrun's entry: the trainer with the exchange timeline on, written to ``out.<rank>.json`` at the end."""
    sys.path.insert(0, str(ROOT))
    from reference_trainer import functions
    from reference_trainer.train import main

    functions.TIMELINE = []
    try:
        main(argv)
    finally:
        with open(f"{out}.{os.environ.get('RANK', '0')}.json", "w") as handle:
            json.dump(functions.TIMELINE, handle)


def run(schedule: str, steps: int, layout: list[str], tmp: Path, recipe: str = "glm_moe_debug",
        extra: tuple[str, ...] = ()) -> dict:
    out = tmp / schedule
    metrics = tmp / f"{schedule}.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TOKENIZERS_PARALLELISM": "false"}
    nproc = int(layout[layout.index("--pp") + 1]) * int(layout[layout.index("--dp") + 1])
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
               "--worker", str(out), "--", "--recipe", recipe, "--spike-rate", "0", "--steps", str(steps),
               "--schedule", schedule, "--metrics-file", str(metrics), *layout, *extra]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise SystemExit(f"{schedule} run failed:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps_s = [r["step_s"] for r in records if not r.get("summary") and r["step"] > 0]
    total = exposed = 0.0
    count = 0
    for rank in range(nproc):
        path = Path(f"{out}.{rank}.json")
        if not path.exists():
            continue
        timeline = json.loads(path.read_text())
        start = _after_first_step(timeline, steps)
        for direction, issued, waiting, done in timeline[start:]:
            total += done - issued
            exposed += done - waiting
            count += 1
    return {"schedule": schedule, "exchanges": count, "exchange_s": total, "exposed_s": exposed,
            "step_s": statistics.median(steps_s) if steps_s else None}


def _after_first_step(timeline: list, steps: int) -> int:
    """Index of the first exchange after step 0: the exchanges are the same in number every step."""
    return len(timeline) // steps if steps else 0


def main() -> None:
    found = worker_argv(sys.argv)
    if found is not None:
        worker(*found)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--recipe", default="glm_moe_debug", help="the trainer's recipe (default: glm_moe_debug)")
    parser.add_argument("--layout", default="--pp 2 --dp 2 --ep 2",
                        help="trainer flags of the layout (default: --pp 2 --dp 2 --ep 2)")
    parser.add_argument("--paired", action="store_true",
                        help="run the runtime schedule with --paired (one more warmup forward per stage: every steady "
                        "point pairs two micro-batches, the last stage's too); plain stays torch's 1F1B")
    args = parser.parse_args()
    layout = args.layout.split()
    with tempfile.TemporaryDirectory() as tmp:
        results = [run(schedule, args.steps, layout, Path(tmp), args.recipe,
                       ("--paired",) if args.paired and schedule == "runtime" else ())
                   for schedule in ("runtime", "plain")]
    runtime, plain = results
    for r in results:
        print(f"{r['schedule']:8s} exchanges {r['exchanges']:5d}  issue->done {r['exchange_s']:7.3f} s  "
              f"blocked {r['exposed_s']:7.3f} s  median step {r['step_s']:.3f} s")
    hidden = 1 - runtime["exposed_s"] / plain["exposed_s"] if plain["exposed_s"] else float("nan")
    print(f"hidden share of the all-to-all blocking time: {hidden:.1%} (1 - runtime blocked / plain blocked); "
          f"step time runtime / plain: {runtime['step_s'] / plain['step_s']:.3f}")


if __name__ == "__main__":
    main()
