"""``bagualu2 budget``: Algorithm 1's budget, the bytes kept and the after-gate decision of every forward of one
iteration of one pipeline stage, with random and forced (``--spike AT=R``) imbalance spikes."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from bagualu2.costmodel import Plan
from bagualu2.runtime import ForwardDecision, IterationReplay, replay_iteration

from .common import (GIB, HARDWARE_HELP, MODEL_HELP, console, echo_json, handle_errors, integer_option, json_help,
                     literal, number_in, progress_bar)
from .iteration import (DEFAULT_HARDWARE, DEFAULT_MODEL, DOWNGRADE_HELP, MAX_IMBALANCE_HELP, SEED_HELP, SPIKE_HELP,
                        SPIKE_RATE_HELP, STAGE_HELP, Iteration, prepare)

FORWARD_FIELDS = ("index", "microbatch", "chunk", "phase", "imbalance", "budget_bytes", "kept_bytes", "action",
                  "overhead_s", "in_flight_bytes", "plan")
JSON_DOC = ("JSON (--json): {model, hardware, stage, downgrade, trace: [imbalance per micro-batch], "
            "spikes: {AT: R}, m_max_bytes (activation capacity), m0_bytes (full-recompute floor of one chunk), "
            "peak_in_flight_bytes, fits (peak <= m_max), total_overhead_s, forwards: [{index, microbatch, chunk, "
            "phase (warmup|steady), imbalance, budget_bytes, kept_bytes, action (keep|absorb|replan|downgrade), "
            "overhead_s, in_flight_bytes (after this forward), plan (text form)}]}; forwards lists every forward, "
            "with or without --all.")


def notable(decision: ForwardDecision) -> bool:
    """Shown in the compact view: the forward mitigated something, or the gate absorbed / re-planned."""
    return decision.plan != "none" or decision.action != "keep"


def budget_json(run: Iteration, replay: IterationReplay, spikes: dict[int, float]) -> dict[str, Any]:
    """The ``--json`` object (see ``JSON_DOC``)."""
    return {"model": run.name, "hardware": run.hardware.name, "stage": run.stage, "downgrade": run.downgrade,
            "trace": list(run.trace), "spikes": {str(k): v for k, v in sorted(spikes.items())},
            "m_max_bytes": replay.m_max_bytes, "m0_bytes": replay.m0_bytes,
            "peak_in_flight_bytes": replay.peak_in_flight_bytes, "fits": replay.fits,
            "total_overhead_s": sum(d.overhead_s for d in replay.decisions),
            "forwards": [{field: getattr(d, field) for field in FORWARD_FIELDS} for d in replay.decisions]}


def _table(replay: IterationReplay, show_all: bool) -> Table:
    shown = [d for d in replay.decisions if show_all or notable(d)]
    title = ("every forward" if show_all else
             f"{len(shown)} of {len(replay.decisions)} forwards mitigated, absorbed or re-planned (--all: every one)")
    table = Table(title=title)
    for header in ("#", "µbatch", "chunk", "phase", "imbalance", "budget GiB", "kept GiB", "action", "overhead ms",
                   "in flight GiB", "tensors", "plan"):
        table.add_column(header, justify="left" if header in ("phase", "action", "plan") else "right")
    for d in shown:
        action = {"downgrade": "[red]downgrade[/red]", "replan": "[yellow]replan[/yellow]"}.get(d.action, d.action)
        plan = d.plan if len(d.plan) <= 40 else d.plan[:37] + "..."
        table.add_row(str(d.index), str(d.microbatch), str(d.chunk), d.phase, f"{d.imbalance:g}",
                      f"{d.budget_bytes / GIB:.3f}", f"{d.kept_bytes / GIB:.3f}", action, f"{d.overhead_s * 1e3:.2f}",
                      f"{d.in_flight_bytes / GIB:.2f}", str(len(Plan.from_str(d.plan))), literal(plan))
    return table


@handle_errors
def budget(
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)] = DEFAULT_MODEL,
    hardware: Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)] = DEFAULT_HARDWARE,
    stage: Annotated[int, typer.Option("--stage", "-s", parser=integer_option(), help=STAGE_HELP)] = 0,
    seed: Annotated[int, typer.Option(parser=integer_option(), help=SEED_HELP)] = 0,
    spike_rate: Annotated[float, typer.Option(parser=number_in("in [0, 1]"), help=SPIKE_RATE_HELP)] = 0.05,
    max_imbalance: Annotated[Optional[float], typer.Option(parser=number_in(">= 1"), help=MAX_IMBALANCE_HELP)] = None,
    spike: Annotated[Optional[list[str]], typer.Option("--spike", metavar="AT=R", help=SPIKE_HELP)] = None,
    downgrade: Annotated[str, typer.Option(metavar="graded|paper", help=DOWNGRADE_HELP)] = "graded",
    show_all: Annotated[bool, typer.Option("--all", help="Show every forward, not only those that mitigated, "
                                           "absorbed or re-planned.")] = False,
    json_output: Annotated[bool, typer.Option("--json", help=json_help(JSON_DOC))] = False,
) -> None:
    """Per-micro-batch budgets, kept bytes and after-gate decisions over one iteration of one stage.

    Algorithm 1 hands each forward a budget, the runtime plans it and, once the MoE gate measured the imbalance,
    keeps, absorbs (warmup), re-plans the MoE module or downgrades it. Spikes come from a seeded trace
    (--spike-rate, --max-imbalance, --seed) and from --spike AT=R. Default view: a summary and only the forwards
    that mitigated, absorbed or re-planned.
    """
    run = prepare(model=model, hardware=hardware, stage=stage, seed=seed, spike_rate=spike_rate,
                  max_imbalance=max_imbalance, spikes=spike, downgrade=downgrade)
    spikes = run.spikes
    with progress_bar(disable=json_output) as bar:
        task = bar.add_task("deciding", total=run.parallel.num_microbatches * run.parallel.vp)
        replay = replay_iteration(run.model, run.parallel, run.hardware, run.trace, stage=run.stage,
                                  downgrade=run.downgrade, progress=lambda done, _: bar.update(task, completed=done))
    if json_output:
        echo_json(budget_json(run, replay, spikes))
        return
    out = console()
    counts: dict[str, int] = {}
    for d in replay.decisions:
        counts[d.action] = counts.get(d.action, 0) + 1
    verdict = "[green]fits[/green]" if replay.fits else "[bold red]OOM[/bold red]"
    spiked = ", ".join(f"{i}={r:g}" for i, r in sorted(spikes.items())) or "none"
    out.print(f"budget: {literal(run.name)} on {literal(run.hardware.name)}, stage {run.stage}, downgrade "
              f"{run.downgrade}: M_max {replay.m_max_bytes / GIB:.2f} GiB, M0 {replay.m0_bytes / GIB:.3f} GiB per "
              f"chunk; spikes (micro-batch=imbalance) {spiked}", soft_wrap=True)
    out.print(_table(replay, show_all))
    actions = ", ".join(f"{name} {counts[name]}" for name in ("keep", "absorb", "replan", "downgrade")
                        if name in counts)
    total_ms = sum(d.overhead_s for d in replay.decisions) * 1e3
    out.print(f"{len(replay.decisions)} forwards ({actions}); peak in flight {replay.peak_in_flight_bytes / GIB:.2f} "
              f"GiB of {replay.m_max_bytes / GIB:.2f} GiB ({verdict}); mitigation overhead {total_ms:.1f} ms",
              soft_wrap=True)
