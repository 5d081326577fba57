"""Calibrating a hardware profile against a measured training run, and predicting other runs with it.

:func:`fit_hardware` takes a short measured run (its imbalance trace and mean step seconds; the trainer's
``ideal`` policy: no mitigation, no cap) and fits the profile's ``kernel_launch_s`` — the fixed cost the cost model
charges per op launch and collective — so that the simulated mean iteration equals the measured one; given a
second short run that offloads (``static-over``), it fits ``copy_launch_s``, the fixed cost of one host copy, the
same way. On a small model on a CPU these fixed costs stand for everything per op that is not arithmetic (the
Python dispatch, autograd, hooks), which is where the time goes; every other field keeps the base profile's
value.
:func:`predict` then simulates a run of any policy on the fitted profile (its own trace, cap and measured restart
seconds) for comparison with what it measured: tokens/s (effective, restarts included) and the activation peak.
Both simulate with ``overlap=CPU_OVERLAP`` (``"fused-only"``): on a CPU the copy and communication "streams" share
the cores, so only the fused steady pairs the trainer's dual-batch executor runs are overlapped; and with
``timeline=CPU_TIMELINE`` (False: the busiest stage plus the bubble): the calibration runs four ranks, on the
2-core machines it was made on more ranks than cores, so while a rank waits for its neighbour another one
computes and a wait costs no time (with a core per rank, the trainer's fused points at one chunk per stage wait as
the timeline says: docs/trainer.md).

Pure: never imports torch (``reference_trainer.experiments.calibrate`` measures and reports).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from ..costmodel import Hardware, ModelConfig, ParallelConfig
from ..costmodel.config import HARDWARE_RANGES
from ..costmodel.validate import require_int, require_number
from .policies import ABLATION, POLICIES
from .simulate import SimResult, simulate

FIT_STEPS = 60  # bisection steps on log(kernel_launch_s)


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One measured run. policy: the policy it ran (``POLICIES``); trace: per step, one imbalance per micro-batch
    (``load_trace`` of its metrics file); step_s: mean seconds of its steps after the first (the first one
    warms up) that had no restart (> 0);
    tokens_per_s: effective tokens/s (restarts and lost steps included, > 0); peak_activation_bytes: the largest
    in-flight activation bytes of any rank (>= 0); restart_s: seconds its restarts cost in all (>= 0);
    steps_lost: steps it ran again after its restarts (>= 0); warmup_s: how much longer its first step took than
    the mean of the others (>= 0; the simulator has no warm-up); other_s: mean seconds per step the run spent
    outside its steps (checkpoints, metrics; >= 0)."""

    policy: str
    trace: tuple
    step_s: float
    tokens_per_s: float
    peak_activation_bytes: int
    restart_s: float = 0.0
    steps_lost: int = 0
    other_s: float = 0.0
    warmup_s: float = 0.0

    def __post_init__(self) -> None:
        require_number("other_s", self.other_s, 0)
        require_number("warmup_s", self.warmup_s, 0)
        require_int("steps_lost", self.steps_lost, 0)
        require_number("step_s", self.step_s, 0, low_open=True)
        require_number("tokens_per_s", self.tokens_per_s, 0, low_open=True)
        require_int("peak_activation_bytes", self.peak_activation_bytes, 0)
        require_number("restart_s", self.restart_s, 0)
        if self.policy not in POLICIES + ABLATION:
            raise ValueError(f"policy must be one of {', '.join(POLICIES + ABLATION)}, got {self.policy!r}")
        if isinstance(self.trace, (str, bytes, dict)) or not isinstance(self.trace, Sequence) or not self.trace:
            raise ValueError(f"trace must be a non-empty sequence of steps (a rate, or one rate per micro-batch "
                             f"each), got {self.trace!r:.60}")
        for i, step in enumerate(self.trace):
            rates = step if isinstance(step, Sequence) and not isinstance(step, (str, bytes)) else (step,)
            if not rates:
                raise ValueError(f"trace[{i}] must be an imbalance rate >= 1 or a non-empty sequence of them")
            for rate in rates:
                require_number(f"trace[{i}] (an imbalance rate)", rate, 1)


CPU_OVERLAP = "fused-only"
CPU_TIMELINE = False  # more ranks than cores: while one rank waits for a neighbour another computes


def _run(model, parallel, hardware, run: Measured, m_max_bytes, *, restart_s: float | None = None,
         plan_hardware: Hardware | None = None, downgrade: str = "graded") -> SimResult:
    return simulate(model, parallel, hardware, run.policy, run.trace, m_max_bytes=m_max_bytes,
                    restart_s=run.restart_s if restart_s is None else restart_s, plan_hardware=plan_hardware,
                    downgrade=downgrade, overlap=CPU_OVERLAP, hidden_copies=False, timeline=CPU_TIMELINE)


def _mean_s(result: SimResult) -> float:
    return statistics.fmean(it.time_s - it.lost_s for it in result.iterations)


def _bisect(seconds_of, target_s: float, field_name: str, base_name: str, *, clamp: bool = False) -> float:
    """The value in ``HARDWARE_RANGES["kernel_launch_s"]`` (log-bisection) at which ``seconds_of`` (non-decreasing)
    reaches ``target_s``; one-line ``ValueError`` when the range's bounds cannot reach it — except with ``clamp``:
    below the range's bottom, the bottom; above its top, the value where ``seconds_of`` reaches its plateau."""
    low, high = HARDWARE_RANGES["kernel_launch_s"]
    low = max(low, 1e-12)
    if seconds_of(low) > target_s:
        if clamp:
            return low
        raise ValueError(f"step_s={target_s:g} is below what {base_name} computes with {field_name}=0 "
                         f"({seconds_of(low):g} s)")
    top_s = seconds_of(high)
    if top_s < target_s:
        if not clamp:
            raise ValueError(f"step_s={target_s:g} is above what {field_name}={high:g} gives")
        target_s = top_s * (1 - 1e-9)
    for _ in range(FIT_STEPS):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if seconds_of(middle) < target_s else (low, middle)
    return (low * high) ** 0.5


def fit_hardware(model: ModelConfig, parallel: ParallelConfig, base: Hardware, fit: Measured, *,
                 m_max_bytes: int | None = None, copies: Measured | None = None,
                 copies_m_max_bytes: int | None = None, name: str | None = None,
                 plan_hardware: Hardware | None = None) -> Hardware:
    """``base`` with ``kernel_launch_s`` fitted so the simulated mean iteration of ``fit`` (a run without host
    copies, e.g. ``ideal``) equals its measured mean step; then, given ``copies`` (a run that offloads, e.g.
    ``static-over``, at the cap ``copies_m_max_bytes``), ``copy_launch_s`` fitted the same way with the kernels'
    cost fixed; ``plan_hardware`` (default: each candidate profile) is the profile the runs were planned with.
    Bisection: the iteration time grows with either. Planned with each candidate profile, the copies run's time
    stops growing once a copy costs more than recomputing (its plan then recomputes): a run slower than that
    plateau (or, with ``plan_hardware``, than the range's top) fits the copy cost where
    the plateau starts; a run no slower than free copies allow (two short runs differ by the machine's noise)
    fits the range's bottom. The launch cost is never clamped: a one-line ``ValueError`` when even the range's
    bounds cannot reach the measured time."""
    def seconds(run: Measured, cap, hardware: Hardware) -> float:
        return _mean_s(_run(model, parallel, hardware, run, cap, restart_s=0.0, plan_hardware=plan_hardware))

    kernel = _bisect(lambda v: seconds(fit, m_max_bytes, dataclasses.replace(base, kernel_launch_s=v)),
                     fit.step_s, "kernel_launch_s", base.name)
    hardware = dataclasses.replace(base, kernel_launch_s=kernel, name=name or f"{base.name}-fitted")
    if copies is not None:
        copy = _bisect(lambda v: seconds(copies, copies_m_max_bytes, dataclasses.replace(hardware, copy_launch_s=v)),
                       copies.step_s, "copy_launch_s", base.name, clamp=True)
        hardware = dataclasses.replace(hardware, copy_launch_s=copy)
    return hardware


def predict(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, run: Measured, *,
            m_max_bytes: int | None = None, other_s: float = 0.0, warmup_s: float = 0.0,
            plan_hardware: Hardware | None = None,
            downgrade: str = "graded") -> dict:
    """The simulator's numbers for ``run`` beside the measured ones: tokens/s (effective: each simulated restart
    costs the run's measured restart seconds plus its re-run steps at the simulated step time, shared over the
    simulated restarts — docs/sim.md: ``restart_s`` stands for all a restart loses), mean step seconds, the
    activation peak (max over stages and steps), and the relative error of each. ``other_s``: seconds per step
    outside the steps (checkpoints, metrics) that the simulator does not model, measured on the fit run
    (``Measured.other_s``), added to every simulated step; ``warmup_s``: the first step's excess over the others
    (``Measured.warmup_s`` of the fit run), added once. ``plan_hardware``: the profile the trainer planned the
    run with (its recipe's; default ``hardware``) — the simulator makes the trainer's plans with it and times
    them on ``hardware``; ``downgrade``: the gate the trainer's flexible policy ran (its ``--downgrade``)."""
    plain = _run(model, parallel, hardware, run, m_max_bytes, restart_s=0.0, plan_hardware=plan_hardware,
                 downgrade=downgrade)
    lost_s = run.restart_s + run.steps_lost * _mean_s(plain)
    result = _run(model, parallel, hardware, run, m_max_bytes, restart_s=lost_s / max(1, plain.restarts),
                  plan_hardware=plan_hardware, downgrade=downgrade)
    peak = max(max(it.peak_bytes) for it in result.iterations)
    other_s = require_number("other_s", other_s, 0)
    warmup_s = require_number("warmup_s", warmup_s, 0)
    tokens = result.tokens_per_iteration * len(result.iterations) / (result.total_time_s
                                                                      + other_s * len(result.iterations) + warmup_s)
    step = _mean_s(result)
    return {"policy": run.policy, "tokens_per_s": tokens, "measured_tokens_per_s": run.tokens_per_s,
            "tokens_error": tokens / run.tokens_per_s - 1, "step_s": step, "measured_step_s": run.step_s,
            "peak_activation_bytes": peak, "measured_peak_activation_bytes": run.peak_activation_bytes,
            "peak_error": peak / run.peak_activation_bytes - 1 if run.peak_activation_bytes else float("nan"),
            "restarts": result.restarts, "oom_events": result.oom_events}
