"""A routing spike inside torchtitan's own trainer, per policy of the bagualu2 converter.

torchtitan's DeepSeek-V3 debug model cut to 4 layers, pipeline degree 2 (1F1B, 4 micro-batches a step) x expert
parallelism 2 (borrowed from FSDP's data-parallel shard degree 2): 4 processes on the CPU with gloo, the grouped-GEMM
experts, the test harness's CPU shims (``tests/integration/torchtitan_harness.py``). From step 2 on, the first half
of every MoE layer's experts (those of expert-parallel rank 0) win every pick: rank 0's experts receive every routed
copy of the group, twice the balanced load. Runs, same seed, same cap per pipeline stage:

* ``plain``         no converter (the reference for the gradients);
* ``flexible``      per-micro-batch budgets, plans and the gate's re-plan;
* ``static-under``  one plan fixed for balanced routing (also run without the spike: it must fit there);
* ``static-over``   one plan fixed for the most a rank's experts can receive.

Per run: whether it finished or ran out of memory, its wall time, and from the converter's report the most a stage
held in flight, the micro-batches re-planned at the gate, whether every micro-batch kept exactly what ``evaluate``
predicts, and whether the gradients are the plain run's bit for bit.

    python benchmarks/torchtitan_spike.py --steps 20 --cap-mib 16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))

from test_torchtitan import MICROBATCHES, launch, make_assets  # noqa: E402

from bagualu2.integrations.torchtitan_stage import read_report  # noqa: E402

SPIKE = {"BAGUALU2_PROBE_GROUPED_MM": "1", "BAGUALU2_PROBE_BIAS": "10"}
CALM = {"BAGUALU2_PROBE_GROUPED_MM": "1"}
NUM_PROCESSES = 4


def layout(steps: int) -> tuple[str, ...]:
    return ("--model.name", "deepseek_v3", "--model.flavor", "debugmodel_4l", "--training.local_batch_size",
            str(MICROBATCHES), "--training.seq_len", "64", "--training.steps", str(steps),
            "--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B",
            "--parallelism.pipeline_parallel_microbatch_size", "1", "--parallelism.data_parallel_shard_degree", "2",
            "--parallelism.expert_parallel_degree", "2")


def summary(out: Path, output: str, plain: list | None, seconds: float) -> dict:
    grads = [out / f"grads.{rank}.json" for rank in range(NUM_PROCESSES)]
    steps = [json.loads(path.read_text()) if path.exists() else [] for path in grads]
    finished = min(len(s) for s in steps)
    row = {"finished_steps": finished, "oom": "ActivationOutOfMemoryError" in output, "wall_s": round(seconds, 1),
           "gradients_bitwise": None if plain is None or finished < len(plain[0]) else steps == plain}
    reports = [out / f"report.{rank}.jsonl" for rank in range(NUM_PROCESSES)]
    if all(path.exists() for path in reports):
        held, replanned, exact = {}, 0, True
        for path in reports:
            report = read_report(path)
            stage, in_flight = report["stage"], 2 - report["stage"]
            for rows in report["steps"]:
                kept = [r["kept_bytes"] for r in rows]
                window = max(sum(kept[i:i + in_flight]) for i in range(len(kept) - in_flight + 1))
                held[stage] = max(held.get(stage, 0), window)
                replanned += sum(bool(r["downgraded_layers"]) for r in rows)
                exact &= all(r["kept_bytes"] == r["predicted_bytes"] for r in rows)
        row.update({f"stage{s}_most_in_flight_mib": round(b / 2**20, 3) for s, b in sorted(held.items())})
        row.update({"replanned_microbatches": replanned, "kept_equals_predicted": exact})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--cap-mib", type=float, default=16.0)
    parser.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary folder)")
    args = parser.parse_args()
    if args.steps < 2 or args.cap_mib <= 0:
        parser.error("--steps must be >= 2 (the spike starts at step 2) and --cap-mib > 0")
    root = Path(tempfile.mkdtemp(prefix="bagualu2-torchtitan-")) if args.out is None else args.out
    root.mkdir(parents=True, exist_ok=True)
    tokenizer, data = make_assets(root / "assets")
    planned = ("--bagualu2.memory_cap_mib", str(args.cap_mib), "--bagualu2.no-quantize")
    runs = [("plain", SPIKE, args.steps, ("--model.converters", "probe")),
            ("flexible", SPIKE, args.steps, ("--model.converters", "bagualu2,probe", *planned)),
            ("static-under (no spike)", CALM, min(args.steps, 4),
             ("--model.converters", "bagualu2,probe", "--bagualu2.policy", "static-under", *planned)),
            ("static-under", SPIKE, args.steps,
             ("--model.converters", "bagualu2,probe", "--bagualu2.policy", "static-under", *planned)),
            ("static-over", SPIKE, args.steps,
             ("--model.converters", "bagualu2,probe", "--bagualu2.policy", "static-over", *planned))]
    results, plain = {}, None
    for index, (name, env, steps, flags) in enumerate(runs):
        out = root / f"run{index}"
        report = ("--bagualu2.report_path", str(out / "report.{rank}.jsonl")) if "bagualu2,probe" in flags else ()
        print(f"[{index + 1}/{len(runs)}] {name}: {steps} steps ...", flush=True)
        start = time.perf_counter()
        output = launch(out, tokenizer, data, NUM_PROCESSES, layout(steps), *flags, *report, env=env, ok=None)
        results[name] = summary(out, output, plain if steps == args.steps else None, time.perf_counter() - start)
        if name == "plain":
            plain = [json.loads((out / f"grads.{rank}.json").read_text()) for rank in range(NUM_PROCESSES)]
        print(f"    {json.dumps(results[name])}", flush=True)
    print(json.dumps({"steps": args.steps, "cap_mib": args.cap_mib, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
