"""``bagualu2 schedule``: the fused dual-batch order of one steady-state scheduling point F_x B_y, its Gantt chart,
and how the DP compares with the exact CP-SAT schedule and the baseline orders."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from bagualu2.costmodel import build_graph, point_relation
from bagualu2.fusion import CHAIN_KINDS, Chains, Order, Timeline, build_chains, dp, simulate
from bagualu2.fusion.baselines import BASELINES
from bagualu2.fusion.gantt import gantt_png_bytes, gantt_text
from bagualu2.mitigation import greedy

from .common import (GIB, HARDWARE_HELP, IMBALANCE_HELP, JSON_HELP, MODEL_HELP, CliError, check_graph, console,
                     echo_json, handle_errors, integer_option, literal, load_hardware, load_model, output_path,
                     parse_imbalance, parse_number, write_output)

DEFAULT_MODEL = "glm-1041b-a35b"
DEFAULT_HARDWARE = "paper-gpu"
GANTT_WIDTH = 100


def solve_orders(chains: Chains, time_limit_s: float) -> dict[str, Order]:
    """The DP order, the exact CP-SAT order (seeded with the DP's; absent when the time limit stopped CP-SAT before
    any schedule) and the baseline orders, by name."""
    from bagualu2.fusion import exact  # OR-Tools: loaded by this command only

    dp_order = dp.solve(chains)
    orders = {"dp": dp_order}
    try:
        orders["exact"] = exact.solve(chains, time_limit_s=time_limit_s, hint=dp_order)
    except RuntimeError:  # only a search stopped by the time limit (an invalid model is a ValueError)
        pass
    orders.update((name, baseline(chains)) for name, baseline in BASELINES.items())
    return orders


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.4g}"


def _ms(ns: int) -> str:
    return f"{ns * 1e-6:.3f}"


def _print(header: str, chains: Chains, orders: dict[str, Order], timelines: dict[str, Timeline],
           png: Path | None) -> None:
    out = console()
    out.print(literal(header), soft_wrap=True)
    out.print("DP order: " + literal(str(orders["dp"])), soft_wrap=True)
    out.print(gantt_text(timelines["dp"], chains, width=GANTT_WIDTH), markup=False, highlight=False, soft_wrap=True)
    table = Table(title="orders, costed by the simulator")
    for name, justify in (("order", "left"), ("solver", "left"), ("makespan ms", "right"), ("vs DP", "right"),
                          ("exposed mitigation ms", "right")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    reference = timelines["dp"].makespan_ns
    for name, order in orders.items():
        timeline = timelines[name]
        ratio = timeline.makespan_ns / reference if reference else 1.0
        table.add_row(name, order.solver, _ms(timeline.makespan_ns), f"{ratio:.3f}",
                      _ms(timeline.exposed_mitigation_ns))
    out.print(table)
    bound = chains.lower_bound_ns
    ratio = reference / bound if bound else 1.0
    out.print(f"lower bound {_ms(bound)} ms (busiest resource or longest chain); DP / lower bound {ratio:.3f}")
    if png is not None:
        out.print(f"wrote the DP order's Gantt chart to {literal(str(png))}")


@handle_errors
def schedule(
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)] = DEFAULT_MODEL,
    hardware: Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)] = DEFAULT_HARDWARE,
    budget_gib: Annotated[Optional[str], typer.Option("--budget-gib", "-b", metavar="X", help="Activation budget "
                          "of one micro-batch of the chunk, in GiB (2**30 bytes), planned with the greedy solver; "
                          "default: midway between the floor M0 and the unmitigated bytes.")] = None,
    imbalance: Annotated[str, typer.Option("--imbalance", "-r", metavar="R", help=IMBALANCE_HELP)] = "1.0",
    stage: Annotated[int, typer.Option("--stage", "-s", parser=integer_option(), help="Pipeline stage (0-based).")] = 0,
    chunk: Annotated[int, typer.Option("--chunk", "-c", parser=integer_option(),
                                       help="Virtual chunk of the stage (0-based).")] = 0,
    time_limit: Annotated[str, typer.Option("--time-limit", metavar="S", help="Seconds for the exact CP-SAT "
                          "schedule (> 0).")] = "10",
    png: Annotated[Optional[str], typer.Option("--png", metavar="PATH", help="Also write the DP order's "
                   "Gantt chart as a PNG file (written atomically; never onto anything but a regular file).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Fused dual-batch order of one steady-state scheduling point F_x B_y (paper §V-B).

    Plans the chunk's micro-batch for the budget, builds the F, B, O, R chains (x and y share the plan), solves
    the DP and the exact CP-SAT schedule, and compares them with the sequential, Megatron-Core and
    Megatron-Kwai orders. Shows the DP order's text Gantt chart (one row per resource).

    Exit codes: 0 done; 2 bad input (including a budget below the floor M0).
    """
    name, model_config, parallel = load_model(model)
    hw = load_hardware(hardware)
    rate = parse_imbalance(imbalance, parallel, model=model_config)
    requested = None if budget_gib is None else parse_number(budget_gib, "--budget-gib", minimum=0.0, what=" (GiB)",
                                                                maximum=2.0**30)
    limit = parse_number(time_limit, "--time-limit", minimum=0.0, strict=True, what=" (seconds)")
    if not 0 <= stage < parallel.pp:
        raise CliError(f"must be in [0, {parallel.pp}) (pp={parallel.pp} for {name}), got {stage}", "--stage")
    if not 0 <= chunk < parallel.vp:
        raise CliError(f"must be in [0, {parallel.vp}) (vp={parallel.vp} for {name}), got {chunk}", "--chunk")
    png_path = output_path(png, inputs={"--model": model, "--hardware": hardware})
    graph = check_graph(build_graph(model_config, parallel, hw, imbalance=rate, stage=stage, chunk=chunk))
    budget = (graph.floor_bytes + graph.unmitigated_bytes) // 2 if requested is None else int(requested * GIB)
    if budget < graph.floor_bytes:
        raise CliError(f"{requested:g} GiB is below the floor M0 (full recompute) of "
                       f"{_gib(graph.floor_bytes)} GiB for {name} {graph.label}", "--budget-gib")
    solution = greedy.solve(graph, budget)
    if not solution.ok:
        raise CliError(f"no plan fits: {solution.reason}", "--budget-gib")
    chains = build_chains(graph, solution.plan, graph, solution.plan, hardware=hw)
    orders = solve_orders(chains, limit)
    timelines = {key: simulate(order, chains) for key, order in orders.items()}
    if png_path is not None:
        write_output(png_path, gantt_png_bytes(timelines["dp"], title=f"DP order: {name} on {hw.name}, "
                     f"{graph.label}, imbalance {rate:g}, budget {_gib(budget)} GiB"))
    counts = dict(zip(CHAIN_KINDS, chains.counts()))
    if json_output:
        result: dict[str, Any] = {
            "inputs": {"model": name, "hardware": hw.name, "stage": stage, "chunk": chunk, "layers": graph.label,
                       "imbalance": rate, "budget_gib": budget / GIB, "budget_bytes": budget,
                       "time_limit_s": limit},
            "plan": str(solution.plan), "floor_bytes": graph.floor_bytes,
            "unmitigated_bytes": graph.unmitigated_bytes, "counts": counts,
            "orders": {key: {"order": str(order), "solver": order.solver,
                             "makespan_s": timelines[key].makespan_s,
                             "exposed_mitigation_s": timelines[key].exposed_mitigation_ns * 1e-9}
                       for key, order in orders.items()},
            "lower_bound_s": chains.lower_bound_ns * 1e-9, "png": None if png_path is None else str(png_path)}
        echo_json(result)
        return
    stages = ", ".join(f"{kind} {count}" for kind, count in counts.items())
    header = (f"schedule: {name} on {hw.name}, {graph.label}, imbalance {rate:g}, budget {_gib(budget)} GiB "
              f"(floor M0 {_gib(graph.floor_bytes)}, unmitigated {_gib(graph.unmitigated_bytes)} GiB; "
              f"plan kept {_gib(solution.cost.activation_bytes)} GiB)\nstages per chain: {stages}")
    relation = point_relation(parallel, stage)
    if parallel.pp == 1 and not parallel.paired:
        header += ("\nnote: pp=1: F_i and B_i are one micro-batch, so at runtime the sequential order runs instead "
                   "of the DP's (shown for analysis)")
    elif relation == 1:
        header += (f"\nnote: stage {stage}: offload and recovery would copy the micro-batches F and B run, so at "
                   "runtime the copies are their own, beside F and B (fusion.dp.with_own_copies)")
    elif relation == 2:
        header += (f"\nnote: stage {stage}: offload and recovery copy the same micro-batch, so at runtime F and B "
                   "run in the DP's order with O and R at the point's edges")
    if "exact" not in orders:
        header += f"\nnote: CP-SAT found no schedule within {limit:g} s (--time-limit); the exact order is left out"
    _print(header, chains, orders, timelines, png_path)
