"""Shared inputs of the commands that replay one iteration of one stage (``demo``, ``budget``, ``curve``):
model, hardware, stage, a seeded spike trace with forced spikes (``--spike AT=R``), the downgrade mode, and the
checks that the replay can run (the stage fits under full recompute; durations within the solvers' range)."""

from __future__ import annotations

from dataclasses import dataclass

from bagualu2.costmodel import Hardware, ModelConfig, ParallelConfig, build_graph, imbalance_limit, stage_memory
from bagualu2.costmodel.validate import parse_float, parse_int, require_int
from bagualu2.runtime import DOWNGRADES, spike_trace

from .common import CliError, blame, check_graph, check_index, check_rate, load_hardware, load_model, rate_range

DEFAULT_MODEL = "glm-1041b-a35b"
DEFAULT_HARDWARE = "paper-gpu"
BASE_IMBALANCE = 1.1   # most micro-batches (paper: 97% below 1.2x)
MAX_IMBALANCE = 2.6    # the paper's largest spike
SEED_LIMIT = 2**63

STAGE_HELP = "Pipeline stage (0-based)."
SEED_HELP = "Seed of the spike trace (an integer in [0, 2**63))."
SPIKE_RATE_HELP = "Share of micro-batches with a random imbalance spike, in [0, 1]."
MAX_IMBALANCE_HELP = (f"Largest random spike (max/mean device load), in [1, min(ep, num_experts / top_k)]; "
                      f"default {MAX_IMBALANCE:g} (or that limit if smaller).")
SPIKE_HELP = ("Force micro-batch AT (0-based) to imbalance R, e.g. --spike 10=2.6; repeatable. R is in [1, "
              "min(ep, num_experts / top_k)] (ep: expert-parallel degree of --model).")
DOWNGRADE_HELP = "After-gate decision: graded (absorb / re-plan the MoE module / full downgrade) or paper."


@dataclass(frozen=True, kw_only=True)
class Iteration:
    """What a replay command runs: the model, its layout, the hardware, the stage and the imbalance per
    micro-batch (``trace``)."""

    name: str
    model: ModelConfig
    parallel: ParallelConfig
    hardware: Hardware
    stage: int
    trace: tuple[float, ...]
    downgrade: str = "graded"
    base_imbalance: float = 1.0  # the rate of the micro-batches that are no spike

    @property
    def spikes(self) -> dict[int, float]:
        """The micro-batches above the base imbalance: ``{micro-batch: imbalance}``."""
        return {i: r for i, r in enumerate(self.trace) if r > self.base_imbalance}


def parse_spikes(values: list[str], parallel: ParallelConfig, model: ModelConfig | None = None) -> dict[int, float]:
    """``--spike AT=R`` entries as ``{micro-batch: imbalance}``; AT in [0, num_microbatches), R in [1, ep] (with
    ``model``: in [1, ``imbalance_limit``])."""
    spikes: dict[int, float] = {}
    count = parallel.num_microbatches
    for text in values:
        at, sep, rate = text.partition("=")
        try:
            index, value = parse_int(at), parse_float(rate)
        except ValueError:
            raise CliError(f"must be AT=R with AT a micro-batch in [0, {count}) and R an imbalance "
                           f"{rate_range(model, parallel)}, got {text!r}", "--spike") from None
        if not 0 <= index < count:
            raise CliError(f"micro-batch must be in [0, {count}) (num_microbatches={count}), got {text!r}",
                           "--spike")
        if index in spikes:
            raise CliError(f"micro-batch {index} is given twice", "--spike")
        try:
            spikes[index] = check_rate(value, parallel, "--spike", model)
        except CliError as exc:
            raise CliError(f"imbalance of {text!r} {exc}", "--spike") from None
    return spikes


def check_downgrade_option(value: str) -> str:
    if value.lower() not in DOWNGRADES:
        raise CliError(f"must be one of {', '.join(DOWNGRADES)}, got {value!r}", "--downgrade")
    return value.lower()


def prepare(*, model: str, hardware: str, stage: int, seed: int, spike_rate: float, max_imbalance: float | None,
            spikes: list[str] | None = None, downgrade: str = "graded") -> Iteration:
    """Validate every input (one line naming its option) and build the trace; checks the replay can run."""
    name, model_config, parallel = load_model(model)
    hw = load_hardware(hardware)
    check_index(stage, parallel.pp, "--stage", f"pp={parallel.pp} for {name}")
    with blame("--seed"):
        seed = require_int("seed", seed, 0, SEED_LIMIT)
    limit = imbalance_limit(model_config, parallel)
    largest = min(MAX_IMBALANCE, limit) if max_imbalance is None else max_imbalance
    largest = check_rate(largest, parallel, "--max-imbalance", model_config)
    forced = parse_spikes(spikes or [], parallel, model_config)
    mode = check_downgrade_option(downgrade)
    base = min(BASE_IMBALANCE, largest)
    with blame("--spike-rate"):
        trace = list(spike_trace(parallel.num_microbatches, spike_rate=spike_rate, max_imbalance=largest,
                                 base_imbalance=base, seed=seed))
    for index, rate in forced.items():
        trace[index] = rate
    worst = max(trace)
    for chunk in range(parallel.vp):  # durations grow with the imbalance: the worst micro-batch bounds them
        check_graph(build_graph(model_config, parallel, hw, imbalance=worst, stage=stage, chunk=chunk))
    memory = stage_memory(model_config, parallel, hw, stage=stage, imbalance=worst)
    with blame("--hardware"):
        memory.check_room(hw, stage)
    return Iteration(name=name, model=model_config, parallel=parallel, hardware=hw, stage=stage,
                     trace=tuple(trace), downgrade=mode, base_imbalance=base)
