"""``bagualu2 plan``: solve the mitigation problem of one chunk for a byte budget and show the plan per tensor."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.markup import escape
from rich.table import Table

from bagualu2.costmodel import OpGraph, Strategy, build_graph, resolve
from bagualu2.costmodel.graph import ITEM_BYTES
from bagualu2.costmodel.strategy import tensor_offload_ns, tensor_quantize_ns
from bagualu2.mitigation import Solution, check_conflicts, greedy

from .common import (GIB, HARDWARE_HELP, IMBALANCE_HELP, JSON_HELP, MIB, MODEL_HELP, CliError, check_graph, console,
                     echo_json, handle_errors, integer_option, literal, load_hardware, load_model, parse_imbalance,
                     parse_number)

DEFAULT_MODEL = "glm-423b-a30b"
DEFAULT_HARDWARE = "paper-gpu"
SOLVERS = ("greedy", "greedy-paper", "exact")
EXIT_NO_PLAN = 1  # INFEASIBLE / TIMEOUT: a normal outcome, but scripts must be able to tell


def plan_rows(graph: OpGraph, solution: Solution) -> list[dict[str, Any]]:
    """One row per (mitigated tensor, strategy): its consumers, bytes freed and the copy/cast time it adds.

    ``added_s`` is None for RECOMPUTE: re-run time is a closure over the whole plan, only its total is exact.
    """
    strategies = resolve(graph, solution.plan)
    groups: dict[tuple[str, Strategy], list[tuple[str, str]]] = {}
    kept: dict[str, set[str]] = {}
    for op, saving in graph.savings:
        strategy = strategies[(op.name, saving.tensor)]
        if strategy is Strategy.KEEP:
            kept.setdefault(saving.tensor, set()).add(saving.dtype)
        else:
            groups.setdefault((saving.tensor, strategy), []).append((op.name, saving.dtype))
    rows, hw = [], graph.hardware
    for (tensor, strategy), users in groups.items():
        spec = graph.tensors[tensor]
        dtypes = sorted({dtype for _, dtype in users} - kept.get(tensor, set()))  # a kept copy frees nothing
        saved = sum(spec.numel * ITEM_BYTES[d] for d in dtypes)
        added_ns: int | None = None
        if strategy is Strategy.OFFLOAD:
            added_ns = sum(sum(tensor_offload_ns(spec, d, hw)) for d in dtypes)
        elif strategy is Strategy.QUANTIZE:
            saved -= spec.numel  # one FP8 byte per element stays on the device
            added_ns = sum(tensor_quantize_ns(spec, hw))
        rows.append({"tensor": tensor, "consumers": [op for op, _ in users], "strategy": strategy.value,
                     "saved_bytes": saved, "added_s": None if added_ns is None else added_ns * 1e-9})
    return rows


def _solve(graph: OpGraph, budget_bytes: int, solver: str, time_limit_s: float) -> Solution:
    if solver == "exact":
        from bagualu2.mitigation import exact  # OR-Tools: loaded for this solver only

        return exact.solve(graph, budget_bytes, time_limit_s=time_limit_s)
    variant = "paper" if solver == "greedy-paper" else "improved"
    return greedy.solve(graph, budget_bytes, config=greedy.GreedyConfig(variant=variant))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _print(graph: OpGraph, solution: Solution, rows: list[dict[str, Any]], violations: list, budget: int,
           header: str) -> None:
    out, cost = console(), solution.cost
    out.print(literal(header), soft_wrap=True)
    if solution.ok:
        table = Table(title="mitigated tensors (recompute time: see the total below)")
        for name, justify in (("tensor", "left"), ("consumers", "left"), ("strategy", "left"),
                              ("saved MiB", "right"), ("added ms", "right")):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for row in rows:
            added = "-" if row["added_s"] is None else _ms(row["added_s"])
            table.add_row(literal(row["tensor"]), literal(", ".join(row["consumers"])), row["strategy"],
                          f"{row['saved_bytes'] / MIB:.2f}", added)
        if rows:
            out.print(table)
        else:
            out.print("nothing to mitigate: every activation is kept")
    if violations:
        bad = Table(title="[bold red]conflicts[/bold red]")
        for name in ("rule", "op/tensor", "message"):
            bad.add_column(name)
        for v in violations:
            bad.add_row(v.rule, literal(f"{v.op}/{v.tensor}"), literal(v.message), style="red")
        out.print(bad)
    colour = "green" if solution.ok else "bold red"
    status = (f"status [{colour}]{solution.status.name}[/{colour}], solver {solution.solver}, "
              f"solve time {solution.solve_time_s * 1e3:.1f} ms")
    overhead = (f"overhead {_ms(cost.overhead_s)} ms = recompute {_ms(cost.recompute_s)} ms "
                f"({cost.num_recomputed_ops} ops re-run) + offload {_ms(cost.offload_s)} ms "
                f"+ quantize {_ms(cost.quantize_s)} ms")
    if not solution.ok:
        out.print(status)
        out.print(f"[red]{escape(solution.reason)}[/red]")
        out.print(f"no plan: the floor plan (full recompute) keeps {cost.activation_bytes / GIB:.3f} GiB, {overhead}")
        return
    kept = cost.activation_bytes
    out.print(f"activation kept {kept / GIB:.3f} GiB of budget {budget / GIB:.3f} GiB "
              f"(saved {(graph.unmitigated_bytes - kept) / GIB:.3f} GiB, host {cost.host_bytes / GIB:.3f} GiB)")
    out.print(overhead)
    out.print(status)
    if solution.reason:  # e.g. CP-SAT's time limit reached: the greedy seed it started from
        out.print(f"[yellow]note: {escape(solution.reason)}[/yellow]", soft_wrap=True)
    out.print(f"plan {literal(str(solution.plan))}", soft_wrap=True)  # Plan.from_str reads it back


@handle_errors
def plan(
    budget_gib: Annotated[Optional[str], typer.Option("--budget-gib", "-b", metavar="X", help="Activation budget "
                          "of one micro-batch of the chunk, in GiB (2**30 bytes); a finite number >= 0. Default: "
                          "the midpoint between the floor M0 and the unmitigated bytes.")] = None,
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)] = DEFAULT_MODEL,
    hardware: Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)] = DEFAULT_HARDWARE,
    imbalance: Annotated[str, typer.Option("--imbalance", "-r", metavar="R", help=IMBALANCE_HELP)] = "1.0",
    solver: Annotated[str, typer.Option("--solver", metavar="NAME", help="greedy (improved Algorithm 2), "
                      "greedy-paper (Algorithm 2 as in the paper) or exact (CP-SAT).")] = "greedy",
    stage: Annotated[int, typer.Option("--stage", "-s", parser=integer_option(), help="Pipeline stage (0-based).")] = 0,
    chunk: Annotated[int, typer.Option("--chunk", "-c", parser=integer_option(),
                                       help="Virtual chunk of the stage (0-based).")] = 0,
    time_limit: Annotated[str, typer.Option("--time-limit", metavar="S", help="Seconds for --solver exact "
                          "(> 0); ignored by the greedy solvers.")] = "10",
    json_output: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Mitigation plan of one micro-batch on one chunk (stage, chunk) for an activation budget.

    One row per mitigated tensor (all its consumers together): strategy, bytes saved and the copy/cast time
    it adds; recompute time is shown as a total. Conflicts of the plan, if any, are listed in red.

    Exit codes: 0 a plan fits (OPTIMAL / FEASIBLE: --solver exact starts from the greedy's plan, which stands if
    its time limit comes first); 1 no plan (INFEASIBLE: budget below the floor M0, or TIMEOUT of --solver exact
    with no plan found), the reason is printed; 2 bad input.
    """
    name, model_config, parallel = load_model(model)
    hw = load_hardware(hardware)
    rate = parse_imbalance(imbalance, parallel, model=model_config)
    if budget_gib is not None:
        budget_gib = parse_number(budget_gib, "--budget-gib", minimum=0.0, what=" (GiB)", maximum=2.0**30)
        budget = int(budget_gib * GIB)
    if solver.lower() not in SOLVERS:
        raise CliError(f"must be one of {', '.join(SOLVERS)}, got {solver!r}", "--solver")
    limit = parse_number(time_limit, "--time-limit", minimum=0.0, strict=True, what=" (seconds)")
    if not 0 <= stage < parallel.pp:
        raise CliError(f"must be in [0, {parallel.pp}) (pp={parallel.pp} for {name}), got {stage}", "--stage")
    if not 0 <= chunk < parallel.vp:
        raise CliError(f"must be in [0, {parallel.vp}) (vp={parallel.vp} for {name}), got {chunk}", "--chunk")
    graph = check_graph(build_graph(model_config, parallel, hw, imbalance=rate, stage=stage, chunk=chunk))
    if budget_gib is None:
        budget = (graph.floor_bytes + graph.unmitigated_bytes) // 2
        budget_gib = budget / GIB
    solution = _solve(graph, budget, solver.lower(), limit)
    rows = plan_rows(graph, solution) if solution.ok else []
    violations = check_conflicts(graph, solution.plan)
    if json_output:
        cost = solution.cost
        echo_json({"inputs": {"model": name, "hardware": hw.name, "stage": stage, "chunk": chunk,
                              "layers": graph.label, "imbalance": rate, "budget_gib": float(budget_gib),
                              "solver": solver.lower(), "time_limit_s": limit},
                   "status": solution.status.name, "solver": solution.solver, "solve_time_s": solution.solve_time_s,
                   "plan": str(solution.plan), "activation_bytes": cost.activation_bytes, "budget_bytes": budget,
                   "unmitigated_bytes": graph.unmitigated_bytes, "floor_bytes": graph.floor_bytes,
                   "host_bytes": cost.host_bytes, "overhead_s": cost.overhead_s, "recompute_s": cost.recompute_s,
                   "offload_s": cost.offload_s, "quantize_s": cost.quantize_s,
                   "num_recomputed_ops": cost.num_recomputed_ops, "rows": rows,
                   "violations": [{"rule": v.rule, "op": v.op, "tensor": v.tensor, "message": v.message}
                                  for v in violations], "reason": solution.reason})
    else:
        header = (f"plan: {name} on {hw.name}, {graph.label}, imbalance {rate:g}, budget {budget / GIB:.3f} GiB, "
                  f"unmitigated {graph.unmitigated_bytes / GIB:.3f} GiB, floor (M0) {graph.floor_bytes / GIB:.3f} GiB")
        _print(graph, solution, rows, violations, budget, header)
    if not solution.ok:
        raise typer.Exit(code=EXIT_NO_PLAN)
