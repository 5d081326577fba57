"""``bagualu2 simulate``: whole training iterations of every pipeline stage under each policy, with OOMs, restarts
and MFU, on the paper's imbalance trace (or the trainer's JSONL log)."""

from __future__ import annotations

import math
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from bagualu2.costmodel import imbalance_limit
from bagualu2.costmodel.validate import number_text
from bagualu2.fusion.gantt import png_bytes
from bagualu2.sim import (ABLATION, ON_OOM, OVERLAP, POLICIES, PaperTrace, SimResult, load_trace, paper_trace,
                          simulate)
from bagualu2.sim.simulate import MAX_ITERATIONS, MAX_RESTART_S

from .common import (HARDWARE_HELP, MODEL_HELP, CliError, blame, check_device_room, console, echo_json, handle_errors,
                     integer_option, json_help, literal, load_hardware, load_model, number_in, output_path,
                     progress_bar, rate_range, write_output)

DEFAULT_MODEL = "glm-423b-a30b"
DEFAULT_ITERATIONS = 200
SEED_LIMIT = 2**63
JSON_LEAD = "Print the results as JSON on stdout instead of tables."
JSON_DOC = ("JSON (--json): a list, one object per policy: {policy, model, hardware, iterations, mfu (per-iteration MFU "
            "averaged, restarts included), tokens_per_s, oom_events, restarts, time_lost_s, total_time_s}.")


def result_json(result: SimResult, model: str, hardware: str) -> dict[str, Any]:
    return {"model": model, "hardware": hardware, **result.summary()}


def simulate_png(rates, results: list[SimResult], title: str) -> bytes:
    """The iterations' imbalance (max over micro-batches) above, each policy's MFU per iteration below (restarts
    show as drops), as PNG bytes (matplotlib, Agg)."""
    from matplotlib.figure import Figure  # lazy: no pyplot, no global backend state

    figure = Figure(figsize=(10, 5), dpi=100)
    top, bottom = figure.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [1, 2]})
    steps = range(1, len(rates) + 1)
    top.plot(steps, [max(r) if isinstance(r, (tuple, list)) else r for r in rates], color="gray", linewidth=0.8)
    top.set_ylabel("imbalance")
    top.set_title(title, fontsize=10)
    for result in results:
        bottom.plot(steps, [it.mfu for it in result.iterations[:len(rates)]], label=result.policy, linewidth=0.9)
    bottom.set_xlabel("iteration")
    bottom.set_ylabel("MFU")
    bottom.set_ylim(bottom=0)
    bottom.legend(loc="lower right", fontsize=8, ncol=4)
    return png_bytes(figure)


@handle_errors
def simulate_cmd(
    ctx: typer.Context,
    model: Annotated[str, typer.Option("--model", "-m", help=MODEL_HELP)] = DEFAULT_MODEL,
    hardware: Annotated[str, typer.Option("--hardware", "-H", help=HARDWARE_HELP)] = "paper-gpu",
    iterations: Annotated[int, typer.Option("--iterations", "-n", parser=integer_option(),
                                            help="Iterations of the paper trace, 1 to "
                                            f"{MAX_ITERATIONS:,}.")
                          ] = DEFAULT_ITERATIONS,
    seed: Annotated[int, typer.Option(parser=integer_option(),
                                      help="Seed of the paper trace (an integer in [0, 2**63)).")] = 0,
    policy: Annotated[Optional[list[str]], typer.Option("--policy", "-p", help="Policy; repeatable; default: all "
                                                        f"of {', '.join(POLICIES)}; also the ablation levels "
                                                        f"{', '.join(ABLATION)} (Fig. 11).")] = None,
    restart_s: Annotated[float, typer.Option("--restart-s", parser=number_in("in [0, 1e9] (seconds)"),
                                              help="Seconds one OOM restart costs (in [0, 1e9]).")
                         ] = 284.0,
    on_oom: Annotated[str, typer.Option("--on-oom", help="What a fixed plan restarts with after an OOM: fallback "
                                        "(static-over, the trainer's) or replan (the crashed iteration on its "
                                        "own plans re-made for its imbalance, then the normal plans again; the "
                                        "paper's §VI-A baselines).")] = "fallback",
    plan_imbalance: Annotated[float, typer.Option("--plan-imbalance", parser=number_in(">= 1"),
                                                  help="Imbalance the plans fixed before training are made for "
                                                  "(>= 1).")] = 1.0,
    trace: Annotated[Optional[str], typer.Option("--trace", metavar="FILE", help="The trainer's JSONL imbalance "
                                                 'log ({"iteration", "microbatch", "imbalance"} a line) instead '
                                                 "of the paper trace.")] = None,
    spike_microbatches: Annotated[int, typer.Option("--spike-microbatches", parser=integer_option(),
                                                    help="Micro-batches of a spike "
                                                    "iteration the spike hits (paper trace; 0: every one, the "
                                                    "worst case for memory).")] = 1,
    overlap: Annotated[str, typer.Option("--overlap", help="Execution model: real (every policy the overlap of its "
                                         "real system), released (the baselines without Megatron-Core's "
                                         "all-to-all overlap, as their 2024 releases ran), fused-only (only "
                                         "flexible's fused pairs overlap) or none (all serial).")] = "real",
    hidden_copies: Annotated[Optional[bool], typer.Option("--hidden-copies/--full-copies", help="Flexible also "
                                                          "plans with offload copies priced by what they leave "
                                                          "exposed beside compute, or prices every copy in full "
                                                          "(Algorithm 2 alone). Default: hidden under --overlap "
                                                          "real and released.", show_default=False)] = None,
    png: Annotated[Optional[str], typer.Option("--png", metavar="PATH", help="Also plot the imbalance and every "
                                               "policy's MFU per iteration (PNG, written atomically).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help=json_help(JSON_DOC, lead=JSON_LEAD))] = False,
) -> None:
    """Mean MFU, tokens/s, OOM events, restarts and time lost per policy over a trace of iterations.

    The default trace has the paper's statistics (97.1% of iterations at 1.0-1.2x, 2.9% spikes up to 2.6x, each
    on one micro-batch of its iteration); static-under restarts as static-over after its first OOM. docs/sim.md
    has the execution model and its constants.
    """
    if trace is not None:
        for param, flag in (("iterations", "--iterations"), ("seed", "--seed"),
                            ("spike_microbatches", "--spike-microbatches")):
            if getattr(ctx.get_parameter_source(param), "name", None) == "COMMANDLINE":  # typer's own click
                raise CliError("shapes the paper trace only; --trace gives the iterations (drop one of the two)",
                               flag)
    png_path = output_path(png, inputs={"--model": model, "--hardware": hardware, "--trace": trace})
    name, model_config, parallel = load_model(model)
    hw = load_hardware(hardware)
    check_device_room(model_config, parallel, hw)
    named = {name.lower(): name for name in POLICIES + ABLATION}  # any case, as the other commands take names
    for value in policy or ():
        if value.lower() not in named:
            raise CliError(f"must be one of {', '.join(POLICIES + ABLATION)}, got {value!r}", "--policy")
    policies = list(dict.fromkeys(named[value.lower()] for value in policy)) if policy else list(POLICIES)
    on_oom, overlap = on_oom.lower(), overlap.lower()
    if on_oom not in ON_OOM:
        raise CliError(f"must be one of {', '.join(ON_OOM)}, got {on_oom!r}", "--on-oom")
    limit = imbalance_limit(model_config, parallel)
    if not 1 <= plan_imbalance <= limit:
        raise CliError(f"must be a number {rate_range(model_config, parallel)}, got {plan_imbalance!r}",
                       "--plan-imbalance")
    if not 1 <= iterations <= MAX_ITERATIONS:
        raise CliError(f"must be an integer in [1, {MAX_ITERATIONS}], got {iterations}", "--iterations")
    if not 0 <= seed < SEED_LIMIT:
        raise CliError(f"must be an integer in [0, 2**63), got {seed}", "--seed")
    if not 0 <= restart_s <= MAX_RESTART_S:
        raise CliError(f"must be a finite number in [0, {MAX_RESTART_S:.0e}] (seconds), got {restart_s!r}",
                       "--restart-s")
    if overlap not in OVERLAP:
        raise CliError(f"must be one of {', '.join(OVERLAP)}, got {overlap!r}", "--overlap")
    if not 0 <= spike_microbatches <= parallel.num_microbatches:
        raise CliError(f"must be an integer in [0, num_microbatches={parallel.num_microbatches}], got "
                       f"{spike_microbatches}", "--spike-microbatches")
    if trace is not None:
        with blame("--trace"):
            rates = load_trace(trace)
            if len(rates[0]) != parallel.num_microbatches:
                raise ValueError(f"{trace}: iterations have {len(rates[0])} micro-batch(es), {name} has "
                                 f"num_microbatches={parallel.num_microbatches}")
            for i, rates_i in enumerate(rates):
                for m, rate in enumerate(rates_i):
                    if rate > limit:
                        raise ValueError(f"{trace}: iteration {i}, micro-batch {m}: imbalance {number_text(rate)} "
                                         f"above what {name} takes: must be {rate_range(model_config, parallel)}")
        source = f"{literal(trace)} ({len(rates)} iterations)"
    else:
        highest = PaperTrace(num_iterations=1).spike_max
        if limit < highest and not model_config.num_experts:
            raise CliError(f"{name} is a dense model (no experts, imbalance 1 only): the paper trace's spikes "
                           f"need a MoE model; use --trace with rates of 1", "--model")
        if limit < highest:
            raise CliError(f"{name} takes imbalances {rate_range(model_config, parallel)}, below the paper "
                           f"trace's largest rate {highest:g}; use --trace or a model with ep >= "
                           f"{math.ceil(highest)} and num_experts / top_k >= {highest:g}", "--model")
        rates = (paper_trace(iterations, seed=seed) if spike_microbatches == 0 else
                 paper_trace(iterations, seed=seed, num_microbatches=parallel.num_microbatches,
                             spike_microbatches=spike_microbatches))
        source = f"paper trace, {iterations} iterations, seed {seed}"
    results = []
    progress = progress_bar(disable=json_output)
    with progress:
        task = progress.add_task("simulating", total=len(policies) * len(rates))
        for k, value in enumerate(policies):
            progress.update(task, description=literal(value))
            with blame("--trace" if trace is not None else "--model"):
                results.append(simulate(model_config, parallel, hw, value, rates, restart_s=restart_s,
                                        on_oom=on_oom, plan_imbalance=plan_imbalance, overlap=overlap,
                                        hidden_copies=hidden_copies, progress=lambda done, k=k: progress.update(
                                            task, completed=k * len(rates) + done)))
    if png_path is not None:
        write_output(png_path, simulate_png(rates, results, f"{name} on {hw.name}: {source}"))
    if json_output:
        echo_json([result_json(r, name, hw.name) for r in results])
        return
    table = Table(title=f"{literal(name)} on {literal(hw.name)}: {source}, restart {restart_s:g} s")
    for header in ("policy", "mean MFU", "tokens/s", "OOM events", "restarts", "time lost s", "total time s"):
        table.add_column(header, justify="left" if header == "policy" else "right")
    for r in results:
        table.add_row(r.policy, f"{r.mean_mfu:.4f}", f"{r.tokens_per_s:,.0f}", str(r.oom_events), str(r.restarts),
                      f"{r.time_lost_s:.1f}", f"{r.total_time_s:.1f}")
    console().print(table)
    if png_path is not None:
        console().print(f"wrote the MFU plot to {literal(str(png_path))}", soft_wrap=True)
