"""Every policy side by side on one model, data, seed, cap and spike trace (the paper's comparative claim, on CPU).

    python -m reference_trainer.experiments.compare [--steps 30] [--spike-rate 0.05] [--spike-max 2.6] [--write docs/trainer.md]

Each policy runs as ``torchrun --standalone --nproc_per_node=4 --max-restarts 1 -m reference_trainer.train
--recipe glm_moe_debug --policy P ...`` (PP=2 x DP=2, EP=2) with checkpoints every ``--checkpoint-every`` steps,
so ``static-under``'s out-of-memory error is a real elastic restart that resumes as ``static-over``. The table:
effective tokens/s (restarts and lost steps included) and its ratio to ``static-over``, MFU, OOM events, restarts,
restart seconds, steps lost, safety-net re-runs, peak activation bytes over the cap, planning overhead; the notes
list each fixed policy's plan stage by stage (``reference_trainer.policies.describe``). ``--write`` replaces the
block between ``<!-- compare:begin -->`` and ``<!-- compare:end -->`` of that file (written to a temporary file,
then renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from ..policies import POLICIES, describe
from ..recipes import default_cap, recipe

BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"


def run_policy(policy: str, args, workdir: Path) -> dict:
    metrics = workdir / f"{policy}.jsonl"
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node=4",
               "--max-restarts", "1", "-m", "reference_trainer.train", "--recipe", "glm_moe_debug", "--policy", policy,
               "--steps", str(args.steps), "--seed", str(args.seed), "--spike-rate", str(args.spike_rate),
               "--spike-max", str(args.spike_max), "--schedule", args.schedule, "--checkpoint-dir",
               str(workdir / policy), "--checkpoint-every", str(args.checkpoint_every), "--metrics-file", str(metrics)]
    proc = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    summary = next((r for r in reversed(records) if r.get("summary")), None)
    if proc.returncode != 0 or summary is None:
        raise SystemExit(f"error: policy {policy} failed (exit {proc.returncode}): "
                         f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    steps = [r for r in records if not r.get("summary") and "loss" in r]
    summary["spikes"] = sum(1 for r in steps for mb in r["microbatches"] if max(mb["imbalance"] or [0]) >= 1.75)
    summary["microbatches"] = sum(len(r["microbatches"]) for r in steps)
    return summary


def table(results: dict[str, dict], notes: list[str], command: str) -> str:
    base = results.get("static-over", {}).get("tokens_per_s")
    lines = [f"Command: `{command}`", "",
             "| policy | tokens/s (effective) | vs static-over | MFU | OOM events | restarts | restart s | steps lost "
             "| re-runs | peak / cap | planning |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for policy, r in results.items():
        ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "n/a"
        lines.append(f"| {policy} | {r['tokens_per_s']:.1f} | {ratio} | {r['mfu']:.2%} | {r['oom_events']} | "
                     f"{r['restarts']} | {r['restart_s']:.1f} | {r['steps_lost']} | {r['reruns']} | "
                     f"{r['peak_activation_bytes'] / r['memory_cap_bytes']:.2f} | {r['planning_fraction']:.2%} |")
    return "\n".join(lines + [""] + notes) + "\n"


def write_block(path: Path, block: str, begin: str = BEGIN, end: str = END) -> None:
    """Replace the text between ``begin`` and ``end`` of ``path`` (appended when missing) atomically."""
    text = path.read_text()
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + block + end + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + f"\n\n{begin}\n{block}{end}\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the policy runs (:func:`run_policy`), shared with ``reference_trainer.experiments.calibrate``."""
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spike-rate", type=float, default=0.05)
    parser.add_argument("--spike-max", type=float, default=2.6)
    parser.add_argument("--schedule", choices=("plain", "runtime"), default="plain")
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m reference_trainer.experiments.compare", description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--write", type=Path, help="the markdown file whose compare block is replaced")
    args = parser.parse_args(argv)
    if args.write is not None and not args.write.is_file():
        parser.error(f"--write {args.write}: not an existing regular file")
    config = recipe("glm_moe_debug")
    cap = default_cap(config)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies:
            print(f"running {policy} ...", file=sys.stderr, flush=True)
            results[policy] = run_policy(policy, args, Path(tmp))
    notes = [f"Cap {cap / 2**20:.2f} MiB per rank (the recipe's default); {results[args.policies[0]]['microbatches']}"
             f" micro-batches per run; spikes (device imbalance >= 1.75) seen by the flexible run: "
             f"{results.get('flexible', {}).get('spikes', 'n/a')}. Plans of the fixed policies:"]
    for policy in ("static-under", "static-over", "kwai", "adapipe"):
        for where, plan in describe(config.with_overrides(policy=policy), cap).items():
            counts: dict[str, int] = {}
            for entry in plan.split(",") if plan != "none" else ():
                strategy = entry.rsplit("=", 1)[1].lower()
                counts[strategy] = counts.get(strategy, 0) + 1
            summary = " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"
            notes.append(f"- {policy}, {where}: {summary}")
    command = "python -m reference_trainer.experiments.compare " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    block = table(results, notes, command.strip())
    print(block)
    if args.write is not None:
        write_block(args.write, block)


if __name__ == "__main__":
    main()
