"""``bagualu2 curve``: the activation-memory curve of one iteration of one stage against its capacity M_max.

The curve is the in-flight activation bytes after each step of the stage's (interleaved) 1F1B schedule
(``DecisionPath.stage_plan()``): a forward adds the bytes its micro-batch keeps, a backward removes them. Policies:
``flexible`` (the runtime decision path: kept bytes of ``replay_iteration``'s decisions), ``static-over`` (full
recompute: every forward keeps its chunk's floor M0) and ``ideal`` (no mitigation: the unmitigated bytes at each
micro-batch's imbalance, may exceed the capacity).
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from bagualu2.fusion.gantt import png_bytes
from bagualu2.runtime import DecisionPath, replay_iteration

from .common import (GIB, HARDWARE_HELP, MODEL_HELP, CliError, console, echo_json, handle_errors, integer_option,
                     json_help, literal, number_in, output_path, progress_bar, write_output)
from .iteration import (DEFAULT_HARDWARE, DEFAULT_MODEL, DOWNGRADE_HELP, MAX_IMBALANCE_HELP, SEED_HELP, SPIKE_HELP,
                        SPIKE_RATE_HELP, STAGE_HELP, Iteration, prepare)

POLICIES = ("flexible", "static-over", "ideal")
BLOCKS = " ▁▂▃▄▅▆▇█"
WIDTH = 96
JSON_DOC = ("JSON (--json): {model, hardware, stage, trace, capacity_bytes (M_max), num_steps, png, policies: "
            "[{policy, in_flight_bytes: [bytes after each schedule step], peak_bytes, exceeds_capacity}]}.")


def curves(run: Iteration, policies: list[str], progress=None) -> tuple[int, dict[str, list[int]]]:
    """``(capacity_bytes, {policy: in-flight bytes after each schedule step})``; ``progress``: called with (forwards
    decided, forwards in all) by the flexible replay."""
    path = DecisionPath(run.model, run.parallel, run.hardware, stage=run.stage, downgrade=run.downgrade)
    memory, steps = path.stage_plan()
    kept_by: dict[str, list[int]] = {}
    if "flexible" in policies:
        replay = replay_iteration(run.model, run.parallel, run.hardware, run.trace, stage=run.stage, path=path,
                                  progress=progress)
        kept_by["flexible"] = [d.kept_bytes for d in replay.decisions]
    forwards = [(mb, chunk) for is_forward, _, mb, chunk, _ in steps if is_forward]
    if "static-over" in policies:
        kept_by["static-over"] = [path.graph(chunk, 1.0).floor_bytes for _, chunk in forwards]
    if "ideal" in policies:
        kept_by["ideal"] = [path.graph(chunk, run.trace[mb]).unmitigated_bytes for mb, chunk in forwards]
    result = {}
    for policy in policies:
        kept, held, curve = kept_by[policy], 0, []
        for is_forward, index, _, _, _ in steps:
            held += kept[index] if is_forward else -kept[index]
            curve.append(held)
        result[policy] = curve
    return memory.m_max_bytes, result


def sparkline(values: list[int], top: int, width: int = WIDTH) -> list[tuple[str, int]]:
    """``(block, column max)`` per column: each of ``width`` columns shows the largest value of its steps, as one
    of 8 block heights relative to ``top`` (rounded; at least one block for a value above 0)."""
    count = len(values)
    width = max(1, min(width, count))
    cells = []
    for column in range(width):
        peak = max(values[column * count // width:max((column + 1) * count // width, column * count // width + 1)])
        level = 0 if peak <= 0 or top <= 0 else max(1, min(8, (peak * 16 + top) // (2 * top)))  # rounded
        cells.append((BLOCKS[level], peak))
    return cells


def curve_png(capacity: int, result: dict[str, list[int]], title: str) -> bytes:
    """A step plot of every policy's curve (GiB) with the capacity line, as PNG bytes (matplotlib, Agg)."""
    from matplotlib.figure import Figure  # lazy: no pyplot, no global backend state

    figure = Figure(figsize=(10, 4), dpi=100)
    axes = figure.add_subplot()
    for policy, curve in result.items():
        axes.step(range(1, len(curve) + 1), [v / GIB for v in curve], where="post", label=policy, linewidth=1.2)
    axes.axhline(capacity / GIB, color="black", linestyle="--", linewidth=1, label="capacity M_max")
    axes.set_xlabel("schedule step (forward or backward)")
    axes.set_ylabel("in-flight activations (GiB)")
    axes.set_title(title, fontsize=10)
    axes.set_ylim(bottom=0)
    axes.legend(loc="center", fontsize=8)
    return png_bytes(figure)


def _print(run: Iteration, capacity: int, result: dict[str, list[int]], png: Any) -> None:
    out = console()
    top = max([capacity, *(max(c) for c in result.values())])
    steps = len(next(iter(result.values())))
    out.print(f"curve: {literal(run.name)} on {literal(run.hardware.name)}, stage {run.stage}: in-flight activation "
              f"bytes after each of {steps} schedule steps, {min(WIDTH, steps)} columns (each its steps' max); "
              f"█ = {top / GIB:.2f} GiB, capacity M_max {capacity / GIB:.2f} GiB", soft_wrap=True)
    label = max(len(p) for p in result) + 1
    for policy, curve in result.items():
        line = "".join(f"[red]{block}[/red]" if peak > capacity else block for block, peak in sparkline(curve, top))
        peak = max(curve)
        verdict = "[green]fits[/green]" if peak <= capacity else "[bold red]exceeds capacity[/bold red]"
        out.print(f"{policy:<{label}}|{line}| peak {peak / GIB:.2f} GiB ({verdict})", soft_wrap=True)
    if png is not None:
        out.print(f"wrote the curve to {literal(str(png))}", soft_wrap=True)


@handle_errors
def curve(
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)] = DEFAULT_MODEL,
    hardware: Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)] = DEFAULT_HARDWARE,
    stage: Annotated[int, typer.Option("--stage", "-s", parser=integer_option(), help=STAGE_HELP)] = 0,
    seed: Annotated[int, typer.Option(parser=integer_option(), help=SEED_HELP)] = 0,
    spike_rate: Annotated[float, typer.Option(parser=number_in("in [0, 1]"), help=SPIKE_RATE_HELP)] = 0.05,
    max_imbalance: Annotated[Optional[float], typer.Option(parser=number_in(">= 1"), help=MAX_IMBALANCE_HELP)] = None,
    spike: Annotated[Optional[list[str]], typer.Option("--spike", metavar="AT=R", help=SPIKE_HELP)] = None,
    downgrade: Annotated[str, typer.Option(metavar="graded|paper", help=DOWNGRADE_HELP)] = "graded",
    policy: Annotated[Optional[list[str]], typer.Option("--policy", metavar="NAME", help="flexible (the runtime "
                      "decision path), static-over (full recompute: M0 per forward) or ideal (no mitigation); "
                      "repeatable; default: all three.")] = None,
    png: Annotated[Optional[str], typer.Option("--png", metavar="PATH", help="Also write the curves as a PNG "
                   "file (written atomically; never onto anything but a regular file).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help=json_help(JSON_DOC))] = False,
) -> None:
    """Activation-memory curve of one iteration of one stage vs its capacity, per policy (sparkline, PNG).

    In-flight activation bytes after each schedule step: a forward adds what its micro-batch keeps, a backward
    frees it. Spikes as in `bagualu2 budget`.
    """
    chosen = [p.lower() for p in (policy or POLICIES)]
    for name in chosen:
        if name not in POLICIES:
            raise CliError(f"must be one of {', '.join(POLICIES)}, got {name!r}", "--policy")
    chosen = list(dict.fromkeys(chosen))
    png_path = output_path(png, inputs={"--model": model, "--hardware": hardware})
    run = prepare(model=model, hardware=hardware, stage=stage, seed=seed, spike_rate=spike_rate,
                  max_imbalance=max_imbalance, spikes=spike, downgrade=downgrade)
    with progress_bar(disable=json_output) as bar:
        task = bar.add_task("deciding", total=run.parallel.num_microbatches * run.parallel.vp)
        capacity, result = curves(run, chosen, progress=lambda done, _: bar.update(task, completed=done))
    if png_path is not None:
        title = (f"{run.name} on {run.hardware.name}, stage {run.stage}: in-flight activations, "
                 f"spikes up to {max(run.trace):g}x")
        write_output(png_path, curve_png(capacity, result, title))
    if json_output:
        echo_json({"model": run.name, "hardware": run.hardware.name, "stage": run.stage, "trace": list(run.trace),
                   "capacity_bytes": capacity, "num_steps": len(next(iter(result.values()))),
                   "png": None if png_path is None else str(png_path),
                   "policies": [{"policy": name, "in_flight_bytes": values, "peak_bytes": max(values),
                                 "exceeds_capacity": max(values) > capacity} for name, values in result.items()]})
        return
    _print(run, capacity, result, png_path)
