"""Every policy side by side on one model, data, cap and spike trace per seed (the paper's comparative claim, on CPU).

    python -m reference_trainer.experiments.compare [--recipe glm_moe_bench] [--seeds 0 1 2] [--steps N]
        [--spike-rate R] [--spike-max M] [--schedule runtime] [--policies ...] [--write docs/trainer.md]

Each policy runs, for every seed, as ``torchrun --standalone --nproc_per_node=W --max-restarts 1 -m
reference_trainer.train --recipe RECIPE --policy P --seed S ...`` with checkpoints every ``--checkpoint-every``
steps, so ``static-under``'s out-of-memory error is a real elastic restart that resumes as ``static-over``. Steps
and spikes default to the recipe's. The runs go seed by seed (every policy of a seed back to back, each seed
starting one policy later than the one before), so a drift of the machine's speed touches the policies alike. The
table, per policy: effective tokens/s (restarts and lost steps included), its median over the seeds and range; the
ratios of the medians to ``static-over`` and to ``ideal`` (the range: the same ratio per seed, on the same trace);
MFU; OOM events, restarts, restart seconds and steps lost summed over the seeds; safety-net re-runs; the largest
peak activation bytes over the cap; planning overhead. A summary line sets flexible beside static-over, the best of
kwai / adapipe and ideal. The notes list each fixed policy's plan stage by stage
(``reference_trainer.policies.describe``). ``--write`` replaces the block between ``<!-- compare:begin -->`` and
``<!-- compare:end -->`` of that file (a temporary file, then renamed).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from ..policies import POLICIES, describe
from .args import OneLineParser, error_line
from ..recipes import RECIPES, default_cap, recipe

BEGIN, END = "<!-- compare:begin -->", "<!-- compare:end -->"
DEFAULT_RECIPE = "glm_moe_bench"


def run_policy(policy: str, args, workdir: Path, seed: int | None = None) -> dict:
    """One policy's run under torchrun; its summary record plus ``spikes`` and ``microbatches`` counts."""
    seed = args.seed if seed is None else seed
    config = recipe(args.recipe)
    metrics = workdir / f"{policy}.s{seed}.jsonl"
    command = [str(Path(sys.executable).with_name("torchrun")), "--standalone",
               f"--nproc_per_node={config.world_size}", "--max-restarts", "1", "-m", "reference_trainer.train",
               "--recipe", args.recipe, "--policy", policy, "--seed", str(seed), "--schedule", args.schedule,
               "--checkpoint-dir", str(workdir / f"{policy}.s{seed}"), "--checkpoint-every",
               str(args.checkpoint_every), "--metrics-file", str(metrics)]
    for flag, value in (("--steps", args.steps), ("--spike-rate", args.spike_rate), ("--spike-max", args.spike_max)):
        if value is not None:
            command += [flag, str(value)]
    proc = subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    summary = next((r for r in reversed(records) if r.get("summary")), None)
    if proc.returncode != 0 or summary is None:
        raise SystemExit(f"error: policy {policy} (seed {seed}) failed (exit {proc.returncode}): "
                         f"{error_line(proc.stderr)}")
    steps = [r for r in records if not r.get("summary") and "loss" in r]
    summary["spikes"] = sum(1 for r in steps for mb in r["microbatches"] if max(mb["imbalance"] or [0]) >= 1.75)
    summary["microbatches"] = sum(len(r["microbatches"]) for r in steps)
    return summary


def _ratio(runs: dict[str, list[dict]], policy: str, base: str) -> tuple[float, float, float] | None:
    """``(ratio of the medians, lowest, highest per-seed ratio)`` of tokens/s, or None without both policies."""
    if policy not in runs or base not in runs:
        return None
    per_seed = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs[policy], runs[base])]
    medians = _median(runs[policy]) / _median(runs[base])
    return medians, min(per_seed), max(per_seed)


def _median(runs: list[dict], key: str = "tokens_per_s") -> float:
    return statistics.median(r[key] for r in runs)


def _show(ratio) -> str:
    if ratio is None:
        return "n/a"
    value, low, high = ratio
    return f"{value:.2f}x ({low:.2f}-{high:.2f})"


def table(runs: dict[str, list[dict]], notes: list[str], command: str) -> str:
    """The markdown block: ``runs`` maps each policy to its summaries, one per seed, in seed order."""
    lines = [f"Command: `{command}`", "",
             "| policy | tokens/s median (range) | vs static-over | vs ideal | MFU | OOM events | restarts | restart s "
             "| steps lost | re-runs | peak / cap | planning |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for policy, summaries in runs.items():
        tokens = [r["tokens_per_s"] for r in summaries]
        lines.append(
            f"| {policy} | {_median(summaries):.1f} ({min(tokens):.1f}-{max(tokens):.1f}) | "
            f"{_show(_ratio(runs, policy, 'static-over'))} | {_show(_ratio(runs, policy, 'ideal'))} | "
            f"{_median(summaries, 'mfu'):.2%} | {sum(r['oom_events'] for r in summaries)} | "
            f"{sum(r['restarts'] for r in summaries)} | {sum(r['restart_s'] for r in summaries):.1f} | "
            f"{sum(r['steps_lost'] for r in summaries)} | {sum(r['reruns'] for r in summaries)} | "
            f"{max(r['peak_activation_bytes'] / r['memory_cap_bytes'] for r in summaries):.2f} | "
            f"{_median(summaries, 'planning_fraction'):.2%} |")
    lines += ["", headline(runs)]
    return "\n".join(lines + [""] + notes) + "\n"


def headline(runs: dict[str, list[dict]]) -> str:
    """flexible's median tokens/s over static-over's, the best of kwai / adapipe's, and ideal's."""
    if "flexible" not in runs:
        return "No flexible run."
    parts = [f"flexible, median over {len(runs['flexible'])} seed(s): "
             f"{sum(r['oom_events'] for r in runs['flexible'])} OOM events"]
    for label, base in (("static-over", "static-over"), ("ideal", "ideal")):
        ratio = _ratio(runs, "flexible", base)
        if ratio is not None:
            parts.append(f"{ratio[0]:.2f}x {label}")
    baselines = [p for p in ("kwai", "adapipe") if p in runs]
    if baselines:
        best = max(baselines, key=lambda p: _median(runs[p]))
        parts.append(f"{_median(runs['flexible']) / _median(runs[best]):.2f}x the best of kwai / adapipe ({best})")
    return "; ".join(parts) + "."


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
    """The flags of the policy runs (:func:`run_policy`), shared with ``reference_trainer.experiments.calibrate``;
    ``--steps``, ``--spike-rate`` and ``--spike-max`` default to the recipe's."""
    parser.add_argument("--recipe", default=DEFAULT_RECIPE, choices=tuple(RECIPES))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--spike-rate", type=float, default=None)
    parser.add_argument("--spike-max", type=float, default=None)
    parser.add_argument("--schedule", choices=("plain", "runtime"), default="runtime")
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))


def check_run_arguments(parser: argparse.ArgumentParser, args, seeds: Sequence[int] = ()) -> None:
    """One line and exit code 2 for a flag the runs would reject (before any run starts): ``--seed`` and every
    one of ``seeds`` included, and a CUDA recipe where torch sees no CUDA device."""
    flag = "--seed"
    try:
        for flag, seed in (("--seed", args.seed), *(("--seeds", seed) for seed in seeds)):
            config = recipe(args.recipe).with_overrides(**{k: v for k, v in (
                ("steps", args.steps), ("spike_rate", args.spike_rate), ("spike_max", args.spike_max))
                if v is not None}, checkpoint_every=args.checkpoint_every, checkpoint_dir="runs",  # each run's own
                seed=seed)
    except ValueError as exc:
        parser.error(str(exc).replace("--seed ", f"{flag} ", 1))
    if config.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error(f"--recipe {args.recipe} runs on CUDA, and torch sees no CUDA device here")


def main(argv=None) -> None:
    parser = OneLineParser(prog="python -m reference_trainer.experiments.compare",
                           description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="one run of every policy per seed (default: 0 1 2); --seed is ignored")
    parser.add_argument("--write", type=Path, help="the markdown file whose compare block is replaced")
    args = parser.parse_args(argv)
    check_run_arguments(parser, args, args.seeds)
    if args.write is not None and not args.write.is_file():
        parser.error(f"--write {args.write}: not an existing regular file")
    config = recipe(args.recipe)
    cap = default_cap(config)
    runs: dict[str, list[dict]] = {policy: [] for policy in args.policies}
    with tempfile.TemporaryDirectory() as tmp:
        for index, seed in enumerate(args.seeds):  # each seed starts one policy later: drift spreads over all
            shift = index % len(args.policies)
            for policy in args.policies[shift:] + args.policies[:shift]:
                print(f"running {policy}, seed {seed} ...", file=sys.stderr, flush=True)
                runs[policy].append(run_policy(policy, args, Path(tmp), seed))
    first = runs[args.policies[0]]
    notes = [f"Recipe `{args.recipe}`, cap {cap / 2**20:.2f} MiB per rank (its default), seeds "
             f"{' '.join(map(str, args.seeds))}; {first[0]['microbatches']} micro-batches per run; spikes (device "
             f"imbalance >= 1.75) seen by flexible per seed: "
             f"{', '.join(str(r['spikes']) for r in runs.get('flexible', [])) or 'n/a'}. Plans of the fixed policies:"]
    for policy in ("static-under", "static-over", "kwai", "adapipe"):
        for where, plan in describe(config.with_overrides(policy=policy), cap).items():
            counts: dict[str, int] = {}
            for entry in plan.split(",") if plan != "none" else ():
                strategy = entry.rsplit("=", 1)[1].lower()
                counts[strategy] = counts.get(strategy, 0) + 1
            summary = " ".join(f"{k}={v}" for k, v in sorted(counts.items())) or "none"
            notes.append(f"- {policy}, {where}: {summary}")
    command = "python -m reference_trainer.experiments.compare " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    block = table(runs, notes, command.strip())
    print(block)
    if args.write is not None:
        write_block(args.write, block)


if __name__ == "__main__":
    main()
