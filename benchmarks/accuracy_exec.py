"""Cost-model accuracy on CPU: predicted vs measured activation bytes of the reference model, per configuration.

Each row runs ``python -m reference_trainer.experiments.measure`` (EP=1) or ``torchrun --nproc_per_node=N ... --ep N`` (gloo)
for one configuration — dense and MoE, EP 1/2/4, imbalance 1.0–2.6, sequence lengths 32 and 64, FP32 and BF16,
plans with each strategy, a full recompute and a deferred downgrade — and prints a markdown table with the
relative error ``(measured - predicted) / predicted`` and its mean and max magnitude.

Run: ``python benchmarks/accuracy_exec.py`` (about two minutes on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
FULL_DENSE = "FULL"  # every non-pinned saving RECOMPUTE (expanded below)

# (preset, ep, imbalance, seq length, dtype, plan, extra arguments)
CONFIGS = [
    ("tiny-dense", 1, 1.0, 64, "fp32", "none", ()),
    ("tiny-dense", 1, 1.0, 32, "bf16", "core_attn=RECOMPUTE,mlp_act=RECOMPUTE", ()),
    ("tiny-dense", 1, 1.0, 64, "fp32", "norm=OFFLOAD,mlp_fc1=QUANTIZE", ()),
    ("tiny-dense", 1, 1.0, 32, "fp32", FULL_DENSE, ()),
    ("tiny-moe", 1, 1.0, 64, "fp32", "none", ()),
    ("tiny-moe", 1, 1.0, 32, "bf16", "expert_act=RECOMPUTE,core_attn=OFFLOAD", ()),
    ("tiny-moe", 1, 1.0, 64, "bf16", "expert_fc1=QUANTIZE,norm=RECOMPUTE", ()),
    ("tiny-moe", 2, 1.0, 64, "fp32", "none", ()),
    ("tiny-moe", 2, 1.5, 64, "fp32", "expert_act=RECOMPUTE", ()),
    ("tiny-moe", 2, 2.0, 32, "bf16", "core_attn=OFFLOAD,expert_fc1=QUANTIZE", ()),
    ("tiny-moe", 2, 2.0, 64, "fp32", "none", ("--budget-bytes", "2074624")),  # deferred downgrade of a spike
    ("tiny-moe", 4, 2.6, 64, "fp32", "none", ()),
    ("tiny-moe", 4, 2.0, 32, "fp32", "expert_act=RECOMPUTE,core_attn=RECOMPUTE", ()),
    ("tiny-moe", 4, 3.0, 64, "bf16", "norm=OFFLOAD,expert_fc2=QUANTIZE", ()),
]


def _full_plan(preset: str, seq_length: int, dtype: str) -> str:
    from bagualu2.costmodel import ParallelConfig, build_graph, presets

    model, _ = presets.model(preset)
    graph = build_graph(model.replace(seq_length=seq_length, dtype=dtype), ParallelConfig(),
                        presets.hardware("cpu"))
    return ",".join(f"{op}/{tensor}=RECOMPUTE" for op, tensor in graph.decisions)


def measure(preset: str, ep: int, imbalance: float, seq_length: int, dtype: str, plan: str, extra) -> dict:
    if plan == FULL_DENSE:
        plan = _full_plan(preset, seq_length, dtype)
    args = ["-m", "reference_trainer.experiments.measure", "--preset", preset, "--ep", str(ep), "--imbalance", str(imbalance),
            "--seq-length", str(seq_length), "--dtype", dtype, "--plan", plan, "--json", *extra]
    command = ([str(TORCHRUN), "--standalone", f"--nproc_per_node={ep}", *args] if ep > 1
               else [sys.executable, *args])
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:8])} ... failed:\n{proc.stderr[-2000:]}")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][0])


def _strategies(record: dict) -> str:
    plan = record.get("effective_plan", record["plan"])
    if plan == "none":
        return "none"
    used = sorted({entry.split("=")[1] for entry in plan.split(",")})
    return "+".join(used) + (" (deferred)" if "budget_bytes" in record else "")


def main() -> None:
    rows = []
    for config in CONFIGS:
        record = measure(*config)
        rows.append(record)
        print(f"  {config[0]} ep={config[1]} R={config[2]} s={config[3]} {config[4]}: "
              f"{100 * record['rel_error']:+.3f}%", file=sys.stderr)
    print("| model | dtype | seq | EP | R (realised) | plan | strategies | predicted B | measured B | error |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (preset, ep, imbalance, seq, dtype, plan, _), r in zip(CONFIGS, rows):
        realised = r.get("realised_imbalance", r["imbalance"])
        shown = "full recompute" if plan == FULL_DENSE else plan if len(plan) < 48 else plan[:45] + "..."
        print(f"| {preset} | {dtype} | {seq} | {ep} | {imbalance:g} ({realised:g}) | `{shown}` | {_strategies(r)} | "
              f"{r['predicted_bytes']:,} | {r['measured_bytes']:,} | {100 * r['rel_error']:+.3f}% |")
    errors = [abs(r["rel_error"]) for r in rows]
    print(f"\n{len(rows)} configurations: mean |error| {100 * sum(errors) / len(errors):.3f}%, "
          f"max |error| {100 * max(errors):.3f}%")


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # no options; --help says what runs
    main()
