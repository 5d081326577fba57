"""The chaos run: every policy x seeds x layouts x spike rates under torchrun, each with a wall-clock bound.

    python -m reference_trainer.experiments.chaos                        # the full grid (long: hours on 2 cores)
    python -m reference_trainer.experiments.chaos --policies flexible --seeds 1 --layouts pp1-dp2-ep2 --spike-rates 0.15 --steps 2

Every run is ``torchrun --max-restarts`` of the reference trainer (checkpoints every step, the collective checker
on, ``--collective-timeout`` short) and ends in one of three ways: ``finished`` (exit 0, OOM restarts included),
``error`` (a non-zero exit whose stderr names the failure in ``error:`` lines and holds no Python traceback of the
trainer's) or ``hang`` (the wall-clock bound passed: the launcher and its workers are killed). A traceback is its
own outcome, ``traceback``. The table is printed (rich) and, with ``--write-docs``, written into docs/trainer.md
between the ``chaos`` markers; ``--json`` prints the rows.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..policies import POLICIES
from ..recipes import recipe
from .args import OneLineParser

ROOT = Path(__file__).resolve().parents[2]
LAYOUTS = {  # name -> (trainer flags, processes)
    "pp2-dp2-ep2": (["--pp", "2", "--dp", "2", "--ep", "2"], 4),
    "pp4": (["--pp", "4", "--dp", "1", "--ep", "1", "--num-microbatches", "8"], 4),
    "pp1-dp2-ep2": (["--pp", "1", "--dp", "2", "--ep", "2"], 2),
    "pp2-dp2-ep2-vp2": (["--pp", "2", "--dp", "2", "--ep", "2", "--vp", "2"], 4),
}
SPIKE_RATES = (0.05, 0.15, 0.3)
TRACEBACK_LINE = re.compile(r'^\s+File ".*/(reference_trainer|bagualu2)/[^"]*", line \d+, in ', re.MULTILINE)
MARK_BEGIN, MARK_END = "<!-- chaos:begin -->", "<!-- chaos:end -->"


@dataclass
class Outcome:
    policy: str
    layout: str
    seed: int
    spike_rate: float
    outcome: str  # finished | error | hang | traceback
    seconds: float
    restarts: int
    detail: str


def _expert_parallel(layout: str) -> bool:
    flags = LAYOUTS[layout][0]
    return int(flags[flags.index("--ep") + 1]) > 1


def run_one(policy: str, layout: str, seed: int, spike_rate: float, *, steps: int, bound_s: float,
            timeout_s: float, max_restarts: int) -> Outcome:
    """One bounded run (module docstring). Without expert parallelism there are no spikes: rate 0."""
    flags, nproc = LAYOUTS[layout]
    rate = spike_rate if _expert_parallel(layout) else 0.0
    with tempfile.TemporaryDirectory(prefix="bagualu2-chaos-") as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        command = [str(Path(sys.executable).with_name("torchrun")), "--standalone", f"--nproc_per_node={nproc}",
                   f"--max-restarts={max_restarts}", "--monitor-interval=0.2", "-m", "reference_trainer.train",
                   *flags, "--policy", policy, "--seed", str(seed), "--steps", str(steps), "--spike-rate",
                   str(rate), "--spike-max", "2.6", "--checkpoint-dir", str(Path(tmp) / "ckpt"),
                   "--checkpoint-every", "1", "--metrics-file", str(metrics), "--collective-timeout",
                   str(timeout_s)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
               "BAGUALU2_CHECK_COLLECTIVES": "1"}
        started = time.monotonic()
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            _, stderr = proc.communicate(timeout=bound_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            _kill_workers(tmp)
            return Outcome(policy, layout, seed, rate, "hang", time.monotonic() - started, 0,
                           f"no end within {bound_s:g} s")
        except BaseException:  # stopped (Ctrl-C, SIGTERM): the run it launched stops too
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _kill_workers(tmp)
            raise
        seconds = time.monotonic() - started
        summary = _summary(metrics)
        restarts = int(summary.get("restarts", 0)) if summary else 0
        lines = [line for line in stderr.splitlines() if line.startswith("error:")]
        trainer_traceback = has_traceback(stderr)
        if proc.returncode == 0 and summary is not None:
            return Outcome(policy, layout, seed, rate, "finished", seconds, restarts, "")
        if trainer_traceback or not lines:
            tail = [line for line in stderr.splitlines() if line.strip()][-1:] or ["(no output)"]
            return Outcome(policy, layout, seed, rate, "traceback", seconds, restarts, tail[0][:200])
        return Outcome(policy, layout, seed, rate, "error", seconds, restarts, lines[-1][:200])


def _terminated(signum, frame) -> None:
    """SIGTERM: unwind (the current run's process group is killed and its folder removed on the way out)."""
    raise SystemExit(128 + signum)


def has_traceback(stderr: str) -> bool:
    """Whether ``stderr`` holds a Python traceback through the trainer's or the library's code (the watchdog's
    stack dumps, in faulthandler's format, do not count; torchrun's own report of a failed worker does not)."""
    return TRACEBACK_LINE.search(stderr) is not None


def _kill_workers(marker: str) -> None:
    """SIGKILL every process whose command line names this run's directory (workers in sessions of their own)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def _summary(metrics: Path) -> dict | None:
    if not metrics.is_file():
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return rows[-1] if rows and rows[-1].get("summary") else None


def markdown(rows: list[Outcome], command: str) -> str:
    """The table for docs/trainer.md: outcomes per layout x policy, then every run that did not finish."""
    lines = [f"Produced by `{command}`.", ""]
    counts = {kind: sum(r.outcome == kind for r in rows) for kind in ("finished", "error", "hang", "traceback")}
    lines.append(f"{len(rows)} runs: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()) + ".")
    lines += ["", "| layout | policy | runs | finished | error | hang | traceback | restarts | median s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for layout, policy in itertools.product(dict.fromkeys(r.layout for r in rows),
                                            dict.fromkeys(r.policy for r in rows)):
        group = [r for r in rows if r.layout == layout and r.policy == policy]
        if not group:
            continue
        seconds = sorted(r.seconds for r in group)[len(group) // 2]
        lines.append(f"| {layout} | {policy} | {len(group)} | "
                     + " | ".join(str(sum(r.outcome == k for r in group))
                                  for k in ("finished", "error", "hang", "traceback"))
                     + f" | {sum(r.restarts for r in group)} | {seconds:.0f} |")
    others = [r for r in rows if r.outcome != "finished"]
    if others:
        lines += ["", "| policy | layout | seed | spike rate | outcome | line |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r.policy} | {r.layout} | {r.seed} | {r.spike_rate:g} | {r.outcome} | `{r.detail}` |"
                  for r in others]
    return "\n".join(lines)


def write_docs(text: str, path: Path = ROOT / "docs" / "trainer.md") -> None:
    """Replace the section between the chaos markers of ``path`` (atomically)."""
    page = path.read_text()
    if MARK_BEGIN not in page or MARK_END not in page:
        raise ValueError(f"{path}: no {MARK_BEGIN} ... {MARK_END} section to write the table into")
    head, rest = page.split(MARK_BEGIN, 1)
    _, tail = rest.split(MARK_END, 1)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(f"{head}{MARK_BEGIN}\n{text}\n{MARK_END}{tail}")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m reference_trainer.experiments.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--spike-rates", nargs="+", type=float, default=list(SPIKE_RATES))
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--bound-s", type=float, default=600.0, help="wall-clock bound of one run")
    parser.add_argument("--collective-timeout", type=float, default=60.0)
    parser.add_argument("--max-restarts", type=int, default=3)
    parser.add_argument("--write-docs", action="store_true", help="write the table into docs/trainer.md")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    for name in ("steps", "max_restarts"):
        if getattr(args, name) < (1 if name == "steps" else 0):
            parser.error(f"--{name.replace('_', '-')} must be >= {1 if name == 'steps' else 0}")
    if not (math.isfinite(args.bound_s) and args.bound_s > 0):
        parser.error(f"--bound-s must be a finite number of seconds > 0, got {args.bound_s}")
    try:  # what every run's trainer would refuse, refused once before any launch
        for seed, rate in itertools.product(args.seeds, args.spike_rates):
            recipe("glm_moe_debug").with_overrides(seed=seed, spike_rate=rate, steps=args.steps,
                                                   collective_timeout_s=args.collective_timeout)
    except ValueError as exc:  # the trainer's flags, named as this command's
        parser.error(str(exc).replace("--seed ", "--seeds ", 1).replace("--spike-rate ", "--spike-rates ", 1))
    signal.signal(signal.SIGTERM, _terminated)  # a stopped chaos run stops the run it launched, and cleans up
    grid = []
    for layout, policy, seed in itertools.product(args.layouts, args.policies, args.seeds):
        rates = args.spike_rates if _expert_parallel(layout) else [0.0]
        grid += [(policy, layout, seed, rate) for rate in rates]
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    console = Console(stderr=True)
    rows: list[Outcome] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("chaos runs", total=len(grid))
        for policy, layout, seed, rate in grid:
            progress.update(task, description=f"{policy} {layout} seed {seed} rate {rate:g}")
            rows.append(run_one(policy, layout, seed, rate, steps=args.steps, bound_s=args.bound_s,
                                timeout_s=args.collective_timeout, max_restarts=args.max_restarts))
            progress.advance(task)
    table = Table(title="chaos runs")
    for column in ("policy", "layout", "seed", "spike rate", "outcome", "s", "restarts", "line"):
        table.add_column(column)
    for r in rows:
        table.add_row(r.policy, r.layout, str(r.seed), f"{r.spike_rate:g}", r.outcome, f"{r.seconds:.0f}",
                      str(r.restarts), r.detail)
    Console().print(table)
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    if args.write_docs:
        write_docs(markdown(rows, "python -m reference_trainer.experiments.chaos " + " ".join(argv if argv is not None
                                                                                  else sys.argv[1:])))
    return 0 if all(r.outcome in ("finished", "error") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
