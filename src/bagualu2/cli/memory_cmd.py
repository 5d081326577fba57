"""``bagualu2 memory``: static, activation and peak memory of every pipeline stage vs the device capacity."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from bagualu2.costmodel import Hardware, ModelConfig, ParallelConfig, Plan, StageMemory, build_graph, stage_memory

from .common import (GIB, HARDWARE_HELP, IMBALANCE_HELP, JSON_HELP, MIB, MODEL_HELP, PLAN_HELP, CliError, blame,
                     console, echo_json, handle_errors, integer_option, literal, load_hardware, load_model,
                     parse_imbalance, parse_plan)

DEFAULT_MODEL = "glm-423b-a30b"
DEFAULT_HARDWARE = "paper-gpu"


def stage_rows(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, *, plan: Plan,
               imbalance: float, stages: list[int]) -> list[tuple[int, StageMemory]]:
    """``(stage, StageMemory)`` for each of ``stages``; plan errors are blamed on ``--plan``, and so is an op-kind
    entry that names no op of the model (a kind of another model: it would silently change nothing)."""
    with blame("--plan"):
        kinds = {key for key, _ in plan.entries if "/" not in key}
        named = {key.split("/", 1)[0] for key, _ in plan.entries if "/" in key}
        if kinds or named:
            ops = {s: [op for c in range(parallel.vp)
                       for op in build_graph(model, parallel, hardware, imbalance=imbalance, stage=s, chunk=c).ops]
                   for s in range(parallel.pp)}
            present = {op.kind for stage_ops in ops.values() for op in stage_ops}
            if kinds - present:
                raise ValueError(f"op kind(s) {', '.join(sorted(kinds - present))} name no op of this model "
                                 f"(its kinds: {', '.join(sorted(present))})")
            _check_stage_entries(named, {s: {op.name for op in stage_ops} for s, stage_ops in ops.items()}, stages)
        return [(s, stage_memory(model, parallel, hardware, plan=plan, stage=s, imbalance=imbalance))
                for s in stages]


def _check_stage_entries(named: set[str], stage_ops: dict[int, set[str]], stages: list[int]) -> None:
    """OP/TENSOR entries name ops of one stage: one line naming that stage when they are given for others."""
    if not named or all(named <= stage_ops[s] for s in stages):
        return
    owners = sorted(s for s, names in stage_ops.items() if named <= names)
    unknown = named - set().union(*stage_ops.values())
    shown = ", ".join(sorted(unknown or named)[:4]) + (", ..." if len(unknown or named) > 4 else "")
    if unknown:
        raise CliError(f"its OP/TENSOR entries name ops this model does not have ({shown})", "--plan")
    if owners:
        raise CliError(f"its OP/TENSOR entries name ops of stage {owners[0]} only ({shown}): give --stage "
                       f"{owners[0]}", "--plan")
    raise CliError(f"its OP/TENSOR entries name ops of no single stage ({shown}); an op-kind entry "
                   "(e.g. expert_act=RECOMPUTE) applies to every stage", "--plan")


def stage_json(stage: int, mem: StageMemory) -> dict[str, Any]:
    """JSON-ready dict of one stage: integer ``*_bytes`` fields, in-flight counts, ``fits``."""
    return {"stage": stage, "static_bytes": mem.static_bytes, "activation_peak_bytes": mem.activation_peak_bytes,
            "peak_bytes": mem.peak_bytes, "capacity_bytes": mem.capacity_bytes,
            "headroom_bytes": mem.headroom_bytes, "m_max_bytes": mem.m_max_bytes, "m0_bytes": mem.m0_bytes,
            "chunk_bytes": list(mem.chunk_bytes), "inflight_chunks": mem.inflight_chunks,
            "inflight_microbatches": mem.inflight_microbatches, "fits": mem.fits}


def _table(title: str, rows: list[tuple[int, StageMemory]]) -> Table:
    """GiB columns; MiB when every peak is under 1 GiB (tiny test models)."""
    unit, scale = ("GiB", GIB) if max(mem.peak_bytes for _, mem in rows) >= GIB else ("MiB", MIB)
    table = Table(title=title, caption="static = weights + fp32 grads + optimizer states; "
                                       "M0 = full-recompute floor of one chunk")
    for header in ("stage", f"static {unit}", f"act peak {unit}", f"peak {unit}", f"capacity {unit}",
                   f"headroom {unit}", "in-flight µb", "M0 MiB/chunk", "status"):
        table.add_column(header, justify="right")
    for stage, mem in rows:
        status = "[green]OK[/green]" if mem.fits else "[bold red]OOM[/bold red]"
        sizes = (mem.static_bytes, mem.activation_peak_bytes, mem.peak_bytes, mem.capacity_bytes,
                 mem.headroom_bytes)
        table.add_row(str(stage), *(f"{size / scale:.2f}" for size in sizes), f"{mem.inflight_microbatches:g}",
                      f"{mem.m0_bytes / MIB:.2f}", status)
    return table


@handle_errors
def memory(
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)] = DEFAULT_MODEL,
    hardware: Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)] = DEFAULT_HARDWARE,
    imbalance: Annotated[str, typer.Option("--imbalance", "-r", metavar="R", help=IMBALANCE_HELP)] = "1.0",
    plan: Annotated[str, typer.Option("--plan", "-p", metavar="SPEC", help=PLAN_HELP)] = "none",
    stage: Annotated[Optional[int], typer.Option("--stage", "-s", parser=integer_option(),
                                                 help="Only this pipeline stage "
                                                 "(0-based); default: every stage.")] = None,
    json_output: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False,
) -> None:
    """Per-stage memory: static, activation peak and total peak vs HBM capacity (OK / OOM).

    Every micro-batch runs --plan; routed-expert activations scale with --imbalance.
    """
    name, model_config, parallel = load_model(model)
    hw = load_hardware(hardware)
    rate = parse_imbalance(imbalance, parallel, model=model_config)
    mitigation = parse_plan(plan)
    if stage is not None and not 0 <= stage < parallel.pp:
        raise CliError(f"must be in [0, {parallel.pp}) (pp={parallel.pp} for {name}), got {stage}", "--stage")
    stages = list(range(parallel.pp)) if stage is None else [stage]
    rows = stage_rows(model_config, parallel, hw, plan=mitigation, imbalance=rate, stages=stages)
    if json_output:
        echo_json({"model": name, "hardware": hw.name, "imbalance": rate, "plan": str(mitigation),
                   "pp": parallel.pp, "vp": parallel.vp, "num_microbatches": parallel.num_microbatches,
                   "stages": [stage_json(s, mem) for s, mem in rows]})
        return
    oom = sum(not mem.fits for _, mem in rows)
    title = (f"memory per stage: {literal(name)} on {literal(hw.name)}, imbalance {rate:g}, "
             f"plan {literal(str(mitigation))} "
             f"({'all fit' if not oom else f'{oom} OOM'})")
    console().print(_table(title, rows))
