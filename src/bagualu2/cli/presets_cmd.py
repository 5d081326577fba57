"""``bagualu2 presets``: the model presets (paper Table II + tiny test models) and hardware profiles."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

import typer
from rich.table import Table

from bagualu2.costmodel import Hardware, num_parameters, presets as costmodel_presets

from .common import GIB, JSON_HELP, console, echo_json, handle_errors


def _billions(count: int) -> str:
    billions = count / 1e9
    return f"{billions:.1f}" if billions >= 1 else f"{billions:.2g}"


def model_rows() -> list[dict[str, Any]]:
    """One JSON-ready dict per model preset: name, parameter counts, world size, full configs."""
    rows = []
    for name in costmodel_presets.model_names():
        model, parallel = costmodel_presets.model(name)
        total, active = num_parameters(model)
        rows.append({"name": name, "total_params": total, "active_params": active,
                     "world_size": parallel.world_size, "model": dataclasses.asdict(model),
                     "parallel": dataclasses.asdict(parallel)})
    return rows


def hardware_profiles() -> list[Hardware]:
    """The hardware presets, in preset order."""
    return [costmodel_presets.hardware(name) for name in costmodel_presets.hardware_names()]


def _models_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="model presets")
    for header in ("name", "layers", "hidden", "experts", "top-k", "total B", "active B", "dp/tp/ep/pp/vp", "GPUs"):
        table.add_column(header, justify="left" if header == "name" else "right")
    for row in rows:
        m, p = row["model"], row["parallel"]
        layout = "/".join(str(p[k]) for k in ("dp", "tp", "ep", "pp", "vp"))
        table.add_row(row["name"], str(m["num_layers"]), str(m["hidden_size"]), str(m["num_experts"]),
                      str(m["top_k"]), _billions(row["total_params"]), _billions(row["active_params"]), layout,
                      str(row["world_size"]))
    return table


def _hardware_table(profiles: list[Hardware]) -> Table:
    table = Table(title="hardware presets")
    for header in ("name", "peak TFLOP/s", "GEMM/attention eff.", "HBM GiB", "HBM TB/s", "h2d/d2h GB/s",
                   "intra/inter GB/s"):
        table.add_column(header, justify="left" if header == "name" else "right")
    for hw in profiles:
        table.add_row(hw.name, f"{hw.peak_flops / 1e12:g}", f"{hw.matmul_efficiency:g}/{hw.attention_share:g}",
                      f"{hw.hbm_bytes / GIB:.1f}", f"{hw.hbm_bytes_per_s / 1e12:g}",
                      f"{hw.h2d_bytes_per_s / 1e9:g}/{hw.d2h_bytes_per_s / 1e9:g}",
                      f"{hw.intra_node_bytes_per_s / 1e9:g}/{hw.inter_node_bytes_per_s / 1e9:g}")
    return table


@handle_errors
def presets(json_output: Annotated[bool, typer.Option("--json", help=JSON_HELP)] = False) -> None:
    """List the model presets and hardware profiles."""
    models, hardware = model_rows(), hardware_profiles()
    if json_output:
        echo_json({"models": models, "hardware": [dataclasses.asdict(hw) for hw in hardware]})
        return
    out = console()
    out.print(_models_table(models))
    out.print(_hardware_table(hardware))
