"""``bagualu2 compare``: the fast solvers against their exact CP-SAT baselines over a small suite.

For every preset x imbalance x budget (``--budgets`` budgets evenly between the floor M0 and the unmitigated bytes of
stage 0, chunk 0): greedy vs exact mitigation (overhead ratio, ``mitigation.greedy.solve`` / ``exact.solve``) and the
fusion DP vs the exact schedule (makespan ratio, ``fusion.dp.solve`` / ``fusion.exact.solve`` on
``build_chains(graph, plan, graph, plan)`` with the greedy plan). Ratios >= 1 when the exact solver proved its
optimum; below 1 only when its time limit stopped it first (its status says so).
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import numpy as np
import typer
from rich.table import Table

from bagualu2.costmodel import Hardware, ModelConfig, OpGraph, ParallelConfig, build_graph, imbalance_limit
from bagualu2.costmodel.validate import require_int
from bagualu2.fusion import build_chains, dp
from bagualu2.mitigation import greedy

from .common import (HARDWARE_HELP, CliError, blame, check_graph, console, echo_json, handle_errors, integer_option,
                     json_help, literal, load_hardware, load_model, parse_imbalance, parse_number, progress_bar)

DEFAULT_MODELS = ("glm-188b-a20b", "glm-1041b-a35b")
DEFAULT_IMBALANCES = ("1.0", "2.0")
MAX_BUDGETS = 50
JSON_DOC = ("JSON (--json): {inputs: {models, hardware, imbalances, budgets, time_limit_s}, points: [{model, "
            "imbalance, budget_fraction, budget_bytes, floor_bytes, unmitigated_bytes, greedy_overhead_s, "
            "exact_overhead_s, exact_status, mitigation_ratio (greedy/exact; null without an exact plan), "
            "dp_makespan_s, exact_makespan_s (null with none), exact_schedule (exact|exact-feasible|none), "
            "fusion_ratio (dp/exact; null with none)}], "
            "summary: {num_points, mitigation: {median, p95, max}, fusion: {median, p95, max}}}.")


def _ratio(fast: float, best: float) -> float:
    return 1.0 if best <= 0 and fast <= 0 else fast / best if best > 0 else float("inf")


def compare_point(graph: OpGraph, hardware: Hardware, budget_bytes: int, time_limit_s: float) -> dict[str, Any]:
    """Greedy vs exact plan and DP vs exact schedule for one graph and budget."""
    from bagualu2.fusion import exact as exact_schedule  # OR-Tools: loaded by this command only
    from bagualu2.mitigation import exact

    fast = greedy.solve(graph, budget_bytes)
    best = exact.solve(graph, budget_bytes, time_limit_s=time_limit_s)
    chains = build_chains(graph, fast.plan, graph, fast.plan, hardware=hardware)
    order = dp.solve(chains)
    try:
        optimum = exact_schedule.solve(chains, time_limit_s=time_limit_s, hint=order)
    except RuntimeError:  # no schedule within the time limit: this point has no fusion ratio
        optimum = None
    return {"budget_bytes": budget_bytes, "floor_bytes": graph.floor_bytes,
            "unmitigated_bytes": graph.unmitigated_bytes, "greedy_overhead_s": fast.cost.overhead_s,
            "exact_overhead_s": best.cost.overhead_s if best.ok else None, "exact_status": best.status.name,
            "mitigation_ratio": _ratio(fast.cost.overhead_s, best.cost.overhead_s) if best.ok else None,
            "dp_makespan_s": order.makespan_s, "exact_makespan_s": None if optimum is None else optimum.makespan_s,
            "exact_schedule": "none" if optimum is None else optimum.solver,
            "fusion_ratio": None if optimum is None else _ratio(order.makespan_ns, optimum.makespan_ns)}


def summary(values: list[float]) -> dict[str, float | None]:
    """Median, 95th percentile and max of ``values`` (None for none)."""
    if not values:
        return {"median": None, "p95": None, "max": None}
    data = np.asarray(values, dtype=float)
    return {"median": float(np.median(data)), "p95": float(np.percentile(data, 95)), "max": float(data.max())}


def _suite(models: list[str], imbalances: list[str] | None, hardware: Hardware
           ) -> list[tuple[str, ModelConfig, ParallelConfig, float]]:
    """Every model at every imbalance; the default imbalances stop at each model's ``imbalance_limit`` (the busiest
    of ``ep`` devices holds at most ``min(ep, num_experts / top_k)`` times the mean), a given one above it is an
    error."""
    suite, seen = [], set()
    for value in models:
        name, model, parallel = load_model(value)
        texts = imbalances or [text for text in DEFAULT_IMBALANCES if float(text) <= imbalance_limit(model, parallel)]
        for text in texts:
            try:
                rate = parse_imbalance(text, parallel, model=model)
            except CliError as error:  # several models: the line says which one the rate does not fit
                raise CliError(f"for {name}: {error}" if len(models) > 1 else str(error), error.option) from None
            if (model, parallel, rate) not in seen:  # a model or rate given twice (-r 1 -r 1.0) is one point
                seen.add((model, parallel, rate))
                suite.append((name, model, parallel, rate))
    return suite


@handle_errors
def compare(
    model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="Model preset or a model JSON file "
                     "(*.json, as --model of plan); repeatable; default: "
                     + ", ".join(DEFAULT_MODELS) + ".")] = None,
    hardware: Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)] = "paper-gpu",
    imbalance: Annotated[Optional[list[str]], typer.Option("--imbalance", "-r", metavar="R", help="Imbalance "
                         "(max/mean device load, in [1, min(ep, num_experts / top_k)]); repeatable; default: "
                         + ", ".join(DEFAULT_IMBALANCES) + " (those up to the model's imbalance limit).")] = None,
    budgets: Annotated[int, typer.Option("--budgets", metavar="N", parser=integer_option(),
                                         help="Budgets per model and imbalance, evenly between the floor M0 and "
                                         f"the unmitigated bytes (1 to {MAX_BUDGETS}).")] = 3,
    time_limit: Annotated[str, typer.Option("--time-limit", metavar="S", help="Seconds per CP-SAT solve "
                          "(> 0, at most 600).")] = "2",
    json_output: Annotated[bool, typer.Option("--json", help=json_help(JSON_DOC))] = False,
) -> None:
    """Greedy vs exact mitigation and DP vs exact fusion over presets x imbalances x budgets.

    Each point solves stage 0, chunk 0 of a preset at an imbalance for one budget with both mitigation solvers and
    schedules the greedy plan's scheduling point with the DP and CP-SAT. The table summarises the ratios (median,
    p95, max); a progress bar runs on stderr (not with --json).
    """
    hw = load_hardware(hardware)
    with blame("--budgets"):
        count = require_int("budgets", budgets, 1, MAX_BUDGETS, high_open=False)
    limit = parse_number(time_limit, "--time-limit", minimum=0.0, strict=True, what=" (seconds)", maximum=600.0)
    suite = _suite(list(model or DEFAULT_MODELS), list(imbalance) if imbalance else None, hw)
    graphs = [(name, rate, check_graph(build_graph(m, p, hw, imbalance=rate))) for name, m, p, rate in suite]
    points: list[dict[str, Any]] = []
    progress = progress_bar(disable=json_output)
    with progress:
        task = progress.add_task("comparing", total=len(graphs) * count)
        for name, rate, graph in graphs:
            for k in range(1, count + 1):
                fraction = k / (count + 1)
                budget = graph.floor_bytes + int(fraction * (graph.unmitigated_bytes - graph.floor_bytes))
                progress.update(task, description=f"{literal(name)} r={rate:g} budget {k}/{count}")
                points.append({"model": name, "imbalance": rate, "budget_fraction": fraction,
                               **compare_point(graph, hw, budget, limit)})
                progress.advance(task)
    mitigation = [p["mitigation_ratio"] for p in points if p["mitigation_ratio"] is not None]
    fusion = [p["fusion_ratio"] for p in points if p["fusion_ratio"] is not None]
    result = {"num_points": len(points), "mitigation": summary(mitigation), "fusion": summary(fusion)}
    if json_output:
        echo_json({"inputs": {"models": sorted({p["model"] for p in points}, key=[p["model"] for p in points].index),
                              "hardware": hw.name, "imbalances": sorted({p["imbalance"] for p in points}),
                              "budgets": count, "time_limit_s": limit},
                   "points": points, "summary": result})
        return
    _print(points, result, hw, limit)


def _print(points: list[dict[str, Any]], result: dict[str, Any], hw: Hardware, limit: float) -> None:
    out = console()
    counted = f"{len(points)} point{'s' if len(points) != 1 else ''}"
    table = Table(title=f"fast vs exact on {literal(hw.name)} ({counted}, CP-SAT limit {limit:g} s each)")
    for header in ("model", "r", "budget", "greedy ovh ms", "exact ovh ms", "status", "greedy/exact",
                   "DP span ms", "exact span ms", "DP/exact"):
        table.add_column(header, justify="left" if header in ("model", "status") else "right")
    for p in points:
        exact_ms = "-" if p["exact_overhead_s"] is None else f"{p['exact_overhead_s'] * 1e3:.3f}"
        ratio = "-" if p["mitigation_ratio"] is None else f"{p['mitigation_ratio']:.4f}"
        table.add_row(literal(p["model"]), f"{p['imbalance']:g}", f"{p['budget_fraction']:.2f}",
                      f"{p['greedy_overhead_s'] * 1e3:.3f}", exact_ms, p["exact_status"], ratio,
                      f"{p['dp_makespan_s'] * 1e3:.3f}",
                      "-" if p["exact_makespan_s"] is None else f"{p['exact_makespan_s'] * 1e3:.3f}",
                      "-" if p["fusion_ratio"] is None else f"{p['fusion_ratio']:.4f}")
    out.print(table)
    stats = Table(title="ratios (1 = the fast solver is optimal)")
    for header in ("comparison", "median", "p95", "max"):
        stats.add_column(header, justify="left" if header == "comparison" else "right")
    for key, label in (("mitigation", "greedy / exact overhead"), ("fusion", "DP / exact makespan")):
        row = result[key]
        stats.add_row(label, *("-" if row[k] is None else f"{row[k]:.4f}" for k in ("median", "p95", "max")))
    out.print(stats)
