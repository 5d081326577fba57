"""The simulator calibrated against this trainer on CPU, then checked against every policy's measured run.

    python -m reference_trainer.experiments.calibrate [--fit each|once] [--fit-steps 8] [--steps N]
                                          [--hardware-out cpu-fitted.json] [--write docs/trainer.md]

1. **Fit** (a short measurement): ``ideal`` (no cap, no mitigation) and ``kwai`` without spikes (its plans offload)
   run ``--fit-steps`` steps each under torchrun as ``reference_trainer.experiments.compare`` runs every policy
   (``--recipe``, default ``glm_moe_bench``: PP=2 x DP=2, EP=2); their mean steps and imbalance traces fit the
   ``cpu`` profile's per-op launch cost and its per-copy cost (``bagualu2.sim.calibrate.fit_hardware``; the copy
   cost stays the profile's when the recipe's cap needs no offload). With ``--fit each`` (default) the two fit runs
   are made again right before every policy's run, so that each prediction uses a profile measured minutes, not half
   an hour, earlier (a shared machine's speed drifts by 10-20% between runs); ``--fit once`` fits before the first
   policy only. The fitted profile (the median of the fits' values) is written as Hardware JSON (``--hardware-out``;
   usable as ``bagualu2 ... -H FILE``).
2. **Check**: every policy runs ``--steps`` steps (as ``reference_trainer.experiments.compare``, spikes and a real torchrun
   restart for ``static-under``); the simulator predicts each run from its own imbalance trace, the recipe's cap and
   its measured restart seconds (``bagualu2.sim.calibrate.predict``) on the profile fitted before it, and the table
   sets predicted beside measured tokens/s (effective) and peak activation bytes.

``--write`` replaces the block between ``<!-- calibrate:begin -->`` and ``<!-- calibrate:end -->`` of that file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

from bagualu2.costmodel import presets
from bagualu2.sim import load_trace
from bagualu2.sim.calibrate import Measured, fit_hardware, predict

from .args import OneLineParser, check_output_file
from .compare import add_run_arguments, check_run_arguments, run_policy, write_block
from ..policies import describe
from ..recipes import default_cap, recipe

BEGIN, END = "<!-- calibrate:begin -->", "<!-- calibrate:end -->"
FIT_POLICIES = ("ideal", "kwai")  # no host copies (fits the launch cost); offloads without spikes (the copy cost)


def measured(policy: str, summary: dict, metrics: Path) -> Measured:
    """A run as the simulator's calibration takes it: the last record of each step (a restart re-runs steps), the
    mean of the steps after the first (it warms up) and the first's excess over it, the peak of every step of
    every launch (a failed launch's completed steps from its OOM record)."""
    steps: dict[int, dict] = {}
    peak = 0  # of every launch: the steps a restart re-ran keep their first launch's peak too
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if "loss" in record and not record.get("summary"):
            steps[record["step"]] = record
        if "loss" in record or record.get("oom"):  # an OOM record: the failed launch's peak (0 if not known)
            peak = max(peak, record.get("peak_activation_bytes", 0))
    ordered = [steps[k] for k in sorted(steps)]
    other_s = 0.0
    if not summary["restarts"]:  # the loop's seconds beyond its steps' (checkpoints, metrics), per step
        other_s = max(summary["seconds"] - sum(r["step_s"] for r in ordered), 0.0) / len(ordered)
    step_s = statistics.fmean(r["step_s"] for r in ordered[1:] or ordered)
    return Measured(policy=policy, trace=load_trace(metrics), other_s=other_s, step_s=step_s,
                    warmup_s=max(ordered[0]["step_s"] - step_s, 0.0) if not summary["restarts"] else 0.0,
                    tokens_per_s=summary["tokens_per_s"],
                    peak_activation_bytes=peak,
                    restart_s=summary["restart_s"], steps_lost=summary["steps_lost"])


def kwai_offloads(config, cap: int) -> bool:
    """Do kwai's plans under ``cap`` offload anything (else its fit run says nothing of the copy cost)?"""
    return any("OFFLOAD" in plan for plan in describe(config.with_overrides(policy="kwai"), cap).values())


def fit(config, base, args, folder: Path, cap: int, offloads: bool):
    """Run the two fit policies for ``--fit-steps`` steps in ``folder``; returns ``(fitted profile, ideal run)``.
    ``offloads``: :func:`kwai_offloads` (else the copies run does not fit the copy cost)."""
    model, parallel = config.model, config.parallel
    folder.mkdir(exist_ok=True)
    runs = {}
    for policy in FIT_POLICIES:  # the copies' run without spikes: no out-of-memory restart inside a fit
        fit_args = argparse.Namespace(**{**vars(args), "steps": args.fit_steps,
                                         **({"spike_rate": 0.0} if policy == "kwai" else {})})
        runs[policy] = measured(policy, run_policy(policy, fit_args, folder), folder / f"{policy}.s{args.seed}.jsonl")
    hardware = fit_hardware(model, parallel, base, runs["ideal"], copies=runs["kwai"] if offloads else None,
                            copies_m_max_bytes=cap, plan_hardware=base)  # planned with the recipe's profile
    return hardware, runs["ideal"]


def table(rows: list[dict], hardware, fit_steps: int, mode: str, command: str, offloads: bool = True) -> str:
    when = "right before each policy's run" if mode == "each" else "once, before the first policy's run"
    copies_text = ("(its plans offload) `copy_launch_s`, the cost per host copy" if offloads else
                   "nothing more (its plans do not offload under this cap: a host copy costs a launch, "
                   "`copy_launch_s` unset)")
    lines = [f"Command: `{command}`", "",
             f"Fitted {when} (`--fit {mode}`) on two {fit_steps}-step runs: `ideal` (its mean step after the "
             "first) gives `kernel_launch_s`, the cost per op launch or collective, `kwai` without spikes "
             f"{copies_text} (columns *fit*; medians "
             f"{hardware.kernel_launch_s * 1e6:.1f} us and {hardware.copy_setup_s * 1e6:.1f} us); the `cpu` "
             "profile's other fields unchanged; the `ideal` fit run's seconds per step outside the steps "
             "(checkpoints every `--checkpoint-every` steps, metrics) are added to every predicted step, its first "
             "step's warm-up (its excess over the others) once per run. Every "
             "policy below is a separate run of `--steps` steps.", "",
             "| policy | tokens/s measured | predicted | error | peak activation B measured | predicted | error "
             "| mean step s measured | predicted | restarts measured / predicted | fit launch / copy us |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['measured_tokens_per_s']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{r['tokens_error']:+.1%} | {r['measured_peak_activation_bytes']:,} | "
                     f"{r['peak_activation_bytes']:,} | {r['peak_error']:+.2%} | {r['measured_step_s']:.3f} | "
                     f"{r['step_s']:.3f} | {r['measured_restarts']} / {r['restarts']} | "
                     f"{r['kernel_launch_s'] * 1e6:.0f} / {r['copy_launch_s'] * 1e6:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = OneLineParser(prog="python -m reference_trainer.experiments.calibrate",
                           description=__doc__.splitlines()[0])
    parser.add_argument("--fit", choices=("each", "once"), default="each",
                        help="fit right before every policy's run (default) or once before the first")
    parser.add_argument("--fit-steps", type=int, default=8)
    add_run_arguments(parser)
    parser.add_argument("--hardware-out", type=Path, help="write the fitted profile here (Hardware JSON)")
    parser.add_argument("--write", type=Path, help="the markdown file whose calibrate block is replaced")
    parser.add_argument("--keep", type=Path, help="keep every run's metrics file in this (existing) folder")
    args = parser.parse_args(argv)
    if args.fit_steps < 3 or (args.steps is not None and args.steps < 3):
        parser.error("--fit-steps and --steps must be at least 3")
    if args.write is not None and not args.write.is_file():
        parser.error(f"--write {args.write}: not an existing regular file")
    check_output_file(parser, "--hardware-out", args.hardware_out)
    if args.keep is not None and not args.keep.is_dir():
        parser.error(f"--keep {args.keep}: not an existing folder")
    check_run_arguments(parser, args)
    config = recipe(args.recipe)
    cap = default_cap(config)
    offloads = kwai_offloads(config, cap)
    model, parallel, base = config.model, config.parallel, presets.hardware(config.hardware)
    rows, profiles = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) if args.keep is None else args.keep
        for policy in args.policies:
            if args.fit == "each" or not profiles:
                print(f"fitting on {' and '.join(FIT_POLICIES)} ...", file=sys.stderr, flush=True)
                profiles.append(fit(config, base, args, work / f"fit-{policy}", cap, offloads))
            hardware, ideal = profiles[-1]
            print(f"running {policy} ...", file=sys.stderr, flush=True)
            summary = run_policy(policy, args, work)
            run = measured(policy, summary, work / f"{policy}.s{args.seed}.jsonl")
            row = predict(model, parallel, hardware, run, m_max_bytes=None if policy == "ideal" else cap,
                          other_s=ideal.other_s, warmup_s=ideal.warmup_s, plan_hardware=base,
                          downgrade=config.downgrade)
            rows.append({**row, "measured_restarts": summary["restarts"], "kernel_launch_s": hardware.kernel_launch_s,
                         "copy_launch_s": hardware.copy_setup_s})
    hardware = dataclasses.replace(base, name=f"{base.name}-fitted",
                                   kernel_launch_s=statistics.median(h.kernel_launch_s for h, _ in profiles),
                                   copy_launch_s=statistics.median(h.copy_setup_s for h, _ in profiles))
    if args.hardware_out is not None:  # temp file + rename: never half-written
        fd, tmp = tempfile.mkstemp(dir=args.hardware_out.parent, prefix=f".{args.hardware_out.name}.")
        with os.fdopen(fd, "w") as handle:
            handle.write(hardware.to_json() + "\n")
        os.replace(tmp, args.hardware_out)
    command = "python -m reference_trainer.experiments.calibrate " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    block = table(rows, hardware, args.fit_steps, args.fit, command.strip(), offloads)
    print(block)
    if args.write is not None:
        write_block(args.write, block, BEGIN, END)


if __name__ == "__main__":
    main()
