"""``bagualu2 demo``: plan one pipeline stage's iteration with MoE spikes, then train the tiny model on CPU.

Planning: Algorithm 1 budgets each forward, the pre-gate plan is committed, the gate reveals the actual imbalance
and the runtime keeps, absorbs (warmup), re-plans the MoE module or downgrades it; a compact summary (``--details``
lists every forward that mitigated). Training: ``python -m reference_trainer.train`` on the ``glm_moe_debug``
recipe in one process on the bundled corpus for ``--train-steps`` steps under its activation cap, summarised in
one line (0 skips it).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from bagualu2.costmodel import stage_memory
from bagualu2.runtime import replay_iteration

from .common import (GIB, HARDWARE_HELP, JSON_HELP, MIB, MODEL_HELP, CliError, console, echo_json, handle_errors,
                     integer_option, literal, number_in, one_thread_env, progress_bar, require_extra)
from .iteration import MAX_IMBALANCE_HELP, SEED_HELP, SPIKE_RATE_HELP, prepare
from .signals import unwinding

PROGRESS_POLL_S = 0.5  # how often the progress bar reads the trainer's metrics file


@handle_errors
def demo(
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)] = "glm-1041b-a35b",
    hardware: Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)] = "paper-gpu",
    stage: Annotated[int, typer.Option("--stage", "-s", parser=integer_option(), help="Pipeline stage (0-based).")] = 0,
    spike_rate: Annotated[float, typer.Option(parser=number_in("in [0, 1]"), help=SPIKE_RATE_HELP)] = 0.05,
    max_imbalance: Annotated[Optional[float], typer.Option(parser=number_in(">= 1"), help=MAX_IMBALANCE_HELP)] = None,
    seed: Annotated[int, typer.Option(parser=integer_option(), help=SEED_HELP)] = 0,
    train_steps: Annotated[int, typer.Option("--train-steps", parser=integer_option(minimum=0, maximum=10_000),
                                             help="Steps of the tiny CPU training run after the planning, 0 to "
                                             "10000 (0: skip it).")] = 20,
    details: Annotated[bool, typer.Option("--details", help="List every forward that mitigated.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Plan one iteration of one stage with spikes (budget, plan and gate decision per forward), then train the tiny
    reference model on CPU under an activation cap."""
    run = prepare(model=model, hardware=hardware, stage=stage, seed=seed, spike_rate=spike_rate,
                  max_imbalance=max_imbalance)
    name, hw, trace = run.name, run.hardware, run.trace
    unmitigated = stage_memory(run.model, run.parallel, hw, stage=stage, imbalance=max(trace))
    replay = replay_iteration(run.model, run.parallel, hw, trace, stage=stage)
    training = _train(train_steps, seed, quiet=json_output) if train_steps else None
    if json_output:
        echo_json({"model": name, "hardware": hw.name, "stage": stage, "trace": list(trace),
                   "m_max_bytes": replay.m_max_bytes, "m0_bytes": replay.m0_bytes,
                   "peak_in_flight_bytes": replay.peak_in_flight_bytes, "fits": replay.fits,
                   "unmitigated_peak_bytes": unmitigated.activation_peak_bytes,
                   "cache_hits": replay.cache_hits, "cache_misses": replay.cache_misses,
                   "decision_time_s": replay.decision_time_s,
                   "forwards": [d.__dict__ for d in replay.decisions], "training": training})
        return
    out = console()
    out.print(f"[bold]{escape(name)}[/bold] on {literal(hw.name)}, stage {stage}: activation capacity M_max "
              f"{replay.m_max_bytes / GIB:.2f} GiB, floor M0 {replay.m0_bytes / GIB:.3f} GiB per chunk; "
              f"a static plan sized for the worst spike ({max(trace):g}x) would need "
              f"{unmitigated.activation_peak_bytes / GIB:.2f} GiB unmitigated.", soft_wrap=True)
    actions = Counter(d.action for d in replay.decisions)
    label = "gate decisions" if run.model.num_experts else "decisions (a dense model: no gate)"
    out.print(f"{label}: " + ", ".join(f"{action} {count}" for action, count in sorted(actions.items())),
              soft_wrap=True)
    if details:
        out.print(_table(replay))
    total_ms = sum(d.overhead_s for d in replay.decisions) * 1e3
    verdict = "[green]fits[/green]" if replay.fits else "[bold red]OOM[/bold red]"
    out.print(f"{len(replay.decisions)} forwards, peak in flight {replay.peak_in_flight_bytes / GIB:.2f} GiB of "
              f"{replay.m_max_bytes / GIB:.2f} GiB ({verdict}); mitigation overhead {total_ms:.1f} ms (serial); "
              f"decision cache {replay.cache_hits} hits / {replay.cache_misses} misses; decisions took "
              f"{replay.decision_time_s * 1e3:.1f} ms.", soft_wrap=True)
    if training is not None:
        exact = "exactly the predicted bytes" if training["max_prediction_error"] == 0 else \
            f"the predicted bytes within {100 * training['max_prediction_error']:.3f}%"
        out.print(f"trained {literal(str(training['recipe']))} on the bundled corpus (CPU, one process) for "
                  f"{training['steps']} step{'' if training['steps'] == 1 else 's'} in {training['seconds']:.1f} s: "
                  f"loss {training['first_loss']:.3f} -> {training['final_loss']:.3f}; every micro-batch kept {exact}; "
                  "peak "
                  f"{training['peak_activation_bytes'] / MIB:.2f} MiB of the "
                  f"{training['memory_cap_bytes'] / MIB:.2f} MiB cap.", soft_wrap=True)


def _train(steps: int, seed: int, *, quiet: bool = False) -> dict:
    """The debug recipe trained in one process (``python -m reference_trainer.train --pp 1 --dp 1 --ep 1``), its
    summary record; a progress bar on stderr (not with ``quiet``) follows the steps the trainer's metrics file
    records."""
    require_extra("trainer", "--train-steps")
    with unwinding(signal.SIGTERM):  # SIGTERM unwinds: the trainer stops, its folder goes
        with tempfile.TemporaryDirectory(prefix="bagualu2-demo-") as folder:
            metrics = Path(folder) / "metrics.jsonl"
            proc = subprocess.Popen([sys.executable, "-m", "reference_trainer.train", "--recipe", "glm_moe_debug",
                                     "--pp", "1", "--dp", "1", "--ep", "1", "--steps", str(steps), "--seed",
                                     str(seed), "--json", "--metrics-file", str(metrics)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=one_thread_env())
            try:
                out, err = _follow(proc, metrics, steps, quiet)
            except BaseException:  # stopped (Ctrl-C to this process alone, SIGTERM): the trainer stops too
                proc.kill()
                proc.communicate()
                raise
    if proc.returncode != 0:
        last = (err.strip().splitlines() or ["the trainer failed"])[-1]
        raise CliError(last.removeprefix("error: "), "--train-steps")
    record = json.loads([line for line in out.splitlines() if line.startswith("{")][-1])
    record.pop("log", None)
    return record


def _follow(proc: subprocess.Popen, metrics: Path, steps: int, quiet: bool) -> tuple[str, str]:
    """The trainer's output once it ends, a progress bar following the steps its metrics file records."""
    with progress_bar(disable=quiet) as bar:
        task = bar.add_task("training glm_moe_debug", total=steps)
        while True:
            try:
                return proc.communicate(timeout=PROGRESS_POLL_S)
            except subprocess.TimeoutExpired:
                bar.update(task, completed=_steps_logged(metrics))


def _steps_logged(metrics: Path) -> int:
    """The steps the trainer's metrics file holds so far (one record per finished step)."""
    try:
        return metrics.read_text(encoding="utf-8").count('{"step": ')
    except OSError:  # not made yet
        return 0


def _table(replay) -> Table:
    table = Table(title="forwards that needed mitigation (the others keep everything)")
    for header in ("#", "µbatch", "chunk", "phase", "imbalance", "budget GiB", "kept GiB", "overhead ms",
                   "mitigated", "downgraded", "in flight GiB"):
        table.add_column(header, justify="right")
    for d in replay.decisions:
        if d.num_mitigated or d.downgraded:
            table.add_row(str(d.index), str(d.microbatch), str(d.chunk), d.phase, f"{d.imbalance:g}",
                          f"{d.budget_bytes / GIB:.2f}", f"{d.kept_bytes / GIB:.2f}", f"{d.overhead_s * 1e3:.2f}",
                          str(d.num_mitigated), "[red]yes[/red]" if d.downgraded else "",
                          f"{d.in_flight_bytes / GIB:.2f}")
    return table
