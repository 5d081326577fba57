"""Calibrating a hardware profile against a measured training run, and predicting other runs with it.

:func:`fit_hardware` takes a short measured run (its imbalance trace and mean step seconds; the trainer's
``ideal`` policy: no mitigation, no cap) and fits the profile's ``kernel_launch_s`` — the fixed cost the cost model
charges per op launch, copy and collective — so that the simulated mean iteration equals the measured one. On a
small model on a CPU that fixed cost stands for everything per op that is not arithmetic (the Python dispatch,
autograd, hooks), which is where the time goes; every other field keeps the base profile's value.
:func:`predict` then simulates a run of any policy on the fitted profile (its own trace, cap and measured restart
seconds) for comparison with what it measured: tokens/s (effective, restarts included) and the activation peak.

Pure: never imports torch (``reference_trainer.calibrate`` measures and reports).
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

from ..costmodel import Hardware, ModelConfig, ParallelConfig
from ..costmodel.config import HARDWARE_RANGES
from ..costmodel.validate import require_int, require_number
from .simulate import SimResult, simulate

FIT_STEPS = 60  # bisection steps on log(kernel_launch_s)


@dataclass(frozen=True, kw_only=True)
class Measured:
    """One measured run. policy: the policy it ran (``POLICIES``); trace: per step, one imbalance per micro-batch
    (``load_trace`` of its metrics file); step_s: mean seconds of its steps after the first (the first one
    warms up) that had no restart (> 0);
    tokens_per_s: effective tokens/s (restarts and lost steps included, > 0); peak_activation_bytes: the largest
    in-flight activation bytes of any rank (>= 0); restart_s: seconds its restarts cost in all (>= 0);
    steps_lost: steps it ran again after its restarts (>= 0)."""

    policy: str
    trace: tuple
    step_s: float
    tokens_per_s: float
    peak_activation_bytes: int
    restart_s: float = 0.0
    steps_lost: int = 0

    def __post_init__(self) -> None:
        require_int("steps_lost", self.steps_lost, 0)
        require_number("step_s", self.step_s, 0, low_open=True)
        require_number("tokens_per_s", self.tokens_per_s, 0, low_open=True)
        require_int("peak_activation_bytes", self.peak_activation_bytes, 0)
        require_number("restart_s", self.restart_s, 0)
        if not self.trace:
            raise ValueError("trace must have at least one step")


def _run(model, parallel, hardware, run: Measured, m_max_bytes, *, restart_s: float | None = None) -> SimResult:
    return simulate(model, parallel, hardware, run.policy, run.trace, m_max_bytes=m_max_bytes,
                    restart_s=run.restart_s if restart_s is None else restart_s)


def _mean_s(result: SimResult) -> float:
    return statistics.fmean(it.time_s - it.lost_s for it in result.iterations)


def fit_hardware(model: ModelConfig, parallel: ParallelConfig, base: Hardware, fit: Measured, *,
                 m_max_bytes: int | None = None, name: str | None = None) -> Hardware:
    """``base`` with ``kernel_launch_s`` fitted so the simulated mean iteration of ``fit`` equals its measured
    mean step (bisection; the iteration time grows with it). One-line ``ValueError`` when even the range's
    bounds cannot reach the measured time."""
    low, high = HARDWARE_RANGES["kernel_launch_s"]
    low = max(low, 1e-12)

    def seconds(launch_s: float) -> float:
        hardware = dataclasses.replace(base, kernel_launch_s=launch_s)
        return _mean_s(_run(model, parallel, hardware, fit, m_max_bytes, restart_s=0.0))

    if seconds(low) > fit.step_s:
        raise ValueError(f"step_s={fit.step_s:g} is below what {base.name} computes with no launch cost "
                         f"({seconds(low):g} s): fit the arithmetic rates first")
    if seconds(high) < fit.step_s:
        raise ValueError(f"step_s={fit.step_s:g} is above what kernel_launch_s={high:g} gives")
    for _ in range(FIT_STEPS):
        middle = (low * high) ** 0.5
        low, high = (middle, high) if seconds(middle) < fit.step_s else (low, middle)
    return dataclasses.replace(base, kernel_launch_s=(low * high) ** 0.5, name=name or f"{base.name}-fitted")


def predict(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, run: Measured, *,
            m_max_bytes: int | None = None) -> dict:
    """The simulator's numbers for ``run`` beside the measured ones: tokens/s (effective: each simulated restart
    costs the run's measured restart seconds plus its re-run steps at the simulated step time, shared over the
    simulated restarts — docs/sim.md: ``restart_s`` stands for all a restart loses), mean step seconds, the
    activation peak (max over stages and steps), and the relative error of each."""
    plain = _run(model, parallel, hardware, run, m_max_bytes, restart_s=0.0)
    lost_s = run.restart_s + run.steps_lost * _mean_s(plain)
    result = _run(model, parallel, hardware, run, m_max_bytes, restart_s=lost_s / max(1, plain.restarts))
    peak = max(max(it.peak_bytes) for it in result.iterations)
    tokens = result.tokens_per_s
    step = _mean_s(result)
    return {"policy": run.policy, "tokens_per_s": tokens, "measured_tokens_per_s": run.tokens_per_s,
            "tokens_error": tokens / run.tokens_per_s - 1, "step_s": step, "measured_step_s": run.step_s,
            "peak_activation_bytes": peak, "measured_peak_activation_bytes": run.peak_activation_bytes,
            "peak_error": peak / run.peak_activation_bytes - 1 if run.peak_activation_bytes else float("nan"),
            "restarts": result.restarts, "oom_events": result.oom_events}
