"""``bagualu2 demo``: the runtime decision path of one pipeline stage over one iteration with MoE spikes.

Algorithm 1 budgets each forward, the cached greedy planner fits it, the gate reveals the actual imbalance and a
spike downgrades the MoE module to full recompute; the table shows every forward that needed mitigation.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from bagualu2.costmodel import stage_memory
from bagualu2.runtime import replay_iteration

from .common import GIB, HARDWARE_HELP, JSON_HELP, MODEL_HELP, console, echo_json, handle_errors
from .iteration import MAX_IMBALANCE_HELP, SEED_HELP, SPIKE_RATE_HELP, prepare


@handle_errors
def demo(
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)] = "glm-1041b-a35b",
    hardware: Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)] = "paper-gpu",
    stage: Annotated[int, typer.Option("--stage", "-s", help="Pipeline stage (0-based).")] = 0,
    spike_rate: Annotated[float, typer.Option(help=SPIKE_RATE_HELP)] = 0.05,
    max_imbalance: Annotated[Optional[float], typer.Option(help=MAX_IMBALANCE_HELP)] = None,
    seed: Annotated[int, typer.Option(help=SEED_HELP)] = 0,
    json_output: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Replay one iteration of one stage: per-forward budget, plan and deferred MoE downgrade on spikes."""
    run = prepare(model=model, hardware=hardware, stage=stage, seed=seed, spike_rate=spike_rate,
                  max_imbalance=max_imbalance)
    name, hw, trace = run.name, run.hardware, run.trace
    unmitigated = stage_memory(run.model, run.parallel, hw, stage=stage, imbalance=max(trace))
    replay = replay_iteration(run.model, run.parallel, hw, trace, stage=stage)
    if json_output:
        echo_json({"model": name, "hardware": hw.name, "stage": stage, "trace": list(trace),
                   "m_max_bytes": replay.m_max_bytes, "m0_bytes": replay.m0_bytes,
                   "peak_in_flight_bytes": replay.peak_in_flight_bytes, "fits": replay.fits,
                   "unmitigated_peak_bytes": unmitigated.activation_peak_bytes,
                   "cache_hits": replay.cache_hits, "cache_misses": replay.cache_misses,
                   "decision_time_s": replay.decision_time_s,
                   "forwards": [d.__dict__ for d in replay.decisions]})
        return
    out = console()
    out.print(f"[bold]{escape(name)}[/bold] on {escape(hw.name)}, stage {stage}: activation capacity M_max "
              f"{replay.m_max_bytes / GIB:.2f} GiB, floor M0 {replay.m0_bytes / GIB:.3f} GiB per chunk; "
              f"a static plan sized for the worst spike ({max(trace):g}x) would need "
              f"{unmitigated.activation_peak_bytes / GIB:.2f} GiB unmitigated.")
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
    out.print(table)
    total_ms = sum(d.overhead_s for d in replay.decisions) * 1e3
    verdict = "[green]fits[/green]" if replay.fits else "[bold red]OOM[/bold red]"
    out.print(f"{len(replay.decisions)} forwards, peak in flight {replay.peak_in_flight_bytes / GIB:.2f} GiB of "
              f"{replay.m_max_bytes / GIB:.2f} GiB ({verdict}); mitigation overhead {total_ms:.1f} ms (serial); "
              f"plan cache {replay.cache_hits} hits / {replay.cache_misses} misses; decisions took "
              f"{replay.decision_time_s * 1e3:.1f} ms.")
