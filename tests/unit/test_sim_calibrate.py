"""Calibration of a hardware profile against a measured run (``bagualu2.sim.calibrate``) and the trainer's metrics
file as a trace (``load_trace``)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bagualu2.costmodel import build_graph, presets, stage_memory
from bagualu2.sim import load_trace, simulate
from bagualu2.sim.calibrate import CPU_OVERLAP, CPU_TIMELINE, Measured, fit_hardware, predict

MODEL, _TINY = presets.model("tiny-moe")
PARALLEL = dataclasses.replace(_TINY, dp=2, ep=2, num_microbatches=4)  # ep=2: imbalances up to 2
BASE = presets.hardware("cpu")
TRACE = ((1.0, 1.2, 1.1, 1.3), (1.5, 1.0, 1.05, 1.1), (1.2, 1.2, 1.0, 1.0))
# a run that offloads: static-under's plan at 60% of the unmitigated in-flight bytes (the cpu profile's copies are
# cheap, so its greedy plan offloads), on balanced routing (it fits: no out-of-memory restart)
COPIES_CAP = int(0.6 * max(stage_memory(MODEL, PARALLEL, BASE, stage=s).inflight_chunks
                           * build_graph(MODEL, PARALLEL, BASE, stage=s).unmitigated_bytes for s in range(PARALLEL.pp)))
COPIES_TRACE = ((1.0,) * 4,) * 3


def _measured(policy: str, hardware, *, trace=TRACE, m_max_bytes=None, **fields) -> Measured:
    parallel = PARALLEL
    result = simulate(MODEL, parallel, hardware, policy, trace, overlap=CPU_OVERLAP, m_max_bytes=m_max_bytes,
                      timeline=CPU_TIMELINE)
    step = sum(it.time_s for it in result.iterations) / len(result.iterations)
    return Measured(policy=policy, trace=trace, step_s=step, tokens_per_s=result.tokens_per_s,
                    peak_activation_bytes=max(max(it.peak_bytes) for it in result.iterations), **fields)


def _copies(hardware) -> Measured:
    return _measured("static-under", hardware, trace=COPIES_TRACE, m_max_bytes=COPIES_CAP)


@pytest.mark.slow
def test_fit_recovers_the_launch_cost_of_a_simulated_run_and_predicts_it_back():
    parallel = PARALLEL
    truth = dataclasses.replace(BASE, kernel_launch_s=3e-4)
    fitted = fit_hardware(MODEL, parallel, BASE, _measured("ideal", truth))
    assert fitted.kernel_launch_s == pytest.approx(3e-4, rel=1e-6)
    assert fitted.name == "cpu-fitted" and fitted.peak_flops == BASE.peak_flops
    other = _measured("static-over", truth)  # a run the fit never saw
    row = predict(MODEL, parallel, fitted, other)
    assert abs(row["tokens_error"]) < 1e-6 and row["peak_error"] == 0 and row["restarts"] == 0
    slower = predict(MODEL, parallel, fitted, other, other_s=row["step_s"])  # as long again outside each step
    assert slower["tokens_per_s"] == pytest.approx(row["tokens_per_s"] / 2, rel=1e-9)
    warm = predict(MODEL, parallel, fitted, other, warmup_s=row["step_s"] * len(TRACE))  # one warm-up: as long again
    assert warm["tokens_per_s"] == pytest.approx(row["tokens_per_s"] / 2, rel=1e-9)


@pytest.mark.slow
def test_fit_recovers_a_separate_copy_cost_from_a_run_that_offloads():
    truth = dataclasses.replace(BASE, kernel_launch_s=3e-4, copy_launch_s=4e-5)
    copies = _copies(truth)
    fitted = fit_hardware(MODEL, PARALLEL, BASE, _measured("ideal", truth), copies=copies,
                          copies_m_max_bytes=COPIES_CAP)
    assert fitted.kernel_launch_s == pytest.approx(3e-4, rel=1e-6)
    assert fitted.copy_launch_s == pytest.approx(4e-5, rel=1e-4)
    row = predict(MODEL, PARALLEL, fitted, _measured("kwai", truth))
    assert abs(row["tokens_error"]) < 1e-6


@pytest.mark.slow
def test_a_copies_run_outside_what_copy_costs_reach_fits_the_nearest_end():
    """Dear copies make the plan recompute instead, so the run's time stops growing with the copy cost: a copies
    run slower than that fits the copy cost where the plateau starts (not the range's top)."""
    truth = dataclasses.replace(BASE, kernel_launch_s=3e-4, copy_launch_s=4e-5)
    copies = _copies(truth)
    slow = dataclasses.replace(copies, step_s=copies.step_s * 100)
    fitted = fit_hardware(MODEL, PARALLEL, BASE, _measured("ideal", truth), copies=slow, copies_m_max_bytes=COPIES_CAP)
    plateau = _copies(dataclasses.replace(fitted, copy_launch_s=1.0)).step_s
    at_fit = _copies(fitted).step_s
    assert at_fit == pytest.approx(plateau, rel=1e-6) and at_fit < slow.step_s
    assert 4e-5 < fitted.copy_launch_s < 1.0
    half = _copies(dataclasses.replace(fitted, copy_launch_s=fitted.copy_launch_s / 2)).step_s
    assert half < at_fit  # the fit is where the plateau starts, not anywhere on it
    fast = dataclasses.replace(copies, step_s=copies.step_s / 100)  # faster than free copies allow: the bottom
    assert fit_hardware(MODEL, PARALLEL, BASE, _measured("ideal", truth), copies=fast,
                        copies_m_max_bytes=COPIES_CAP).copy_launch_s < 1e-9
    with pytest.raises(ValueError, match="above what kernel_launch_s"):  # the launch cost is never clamped
        fit_hardware(MODEL, PARALLEL, BASE, dataclasses.replace(copies, policy="ideal", step_s=1e6))


def test_fit_says_when_no_launch_cost_reaches_the_measurement():
    parallel = PARALLEL
    fast = dataclasses.replace(_measured("ideal", BASE), step_s=1e-12)
    with pytest.raises(ValueError, match="step_s=1e-12 is below"):
        fit_hardware(MODEL, parallel, BASE, fast)


def test_predict_charges_the_measured_restart_seconds_and_lost_steps():
    parallel = PARALLEL
    cap = simulate(MODEL, parallel, BASE, "static-under", (1.0,)).iterations[0].peak_bytes[0]
    run = Measured(policy="static-under", trace=((1.0,) * 4, (2.0,) * 4, (1.0,) * 4), step_s=0.1,
                   tokens_per_s=1.0, peak_activation_bytes=cap, restart_s=10.0, steps_lost=2)
    row = predict(MODEL, parallel, BASE, run, m_max_bytes=cap)
    assert row["restarts"] == 1
    plain = simulate(MODEL, parallel, BASE, "static-under", run.trace, m_max_bytes=cap, restart_s=0.0)
    assert row["tokens_per_s"] < plain.tokens_per_s  # 10 s and two steps more


@pytest.mark.parametrize("fields, match", [({"step_s": 0.0}, "step_s"), ({"tokens_per_s": -1.0}, "tokens_per_s"),
                                           ({"peak_activation_bytes": -1}, "peak_activation_bytes"),
                                           ({"restart_s": float("nan")}, "restart_s"),
                                           ({"steps_lost": -1}, "steps_lost"), ({"trace": ()}, "trace"),
                                           ({"other_s": -0.5}, "other_s"), ({"warmup_s": -1.0}, "warmup_s"),
                                           ({"policy": "foo"}, "policy"), ({"policy": None}, "policy"),
                                           ({"trace": 5}, "trace"), ({"trace": "abc"}, "trace"),
                                           ({"trace": ((1.0, 0.5),)}, r"trace\[0\]"),
                                           ({"trace": (1.0, float("nan"))}, r"trace\[1\]"),
                                           ({"trace": ((),)}, r"trace\[0\]")])
def test_measured_rejects_bad_fields(fields, match):
    good = dict(policy="ideal", trace=TRACE, step_s=0.1, tokens_per_s=10.0, peak_activation_bytes=1)
    with pytest.raises(ValueError, match=match):
        Measured(**{**good, **fields})


def test_load_trace_reads_the_trainers_metrics_file(tmp_path):
    def step(n, rates):  # two stages x two ranks per micro-batch; rates[m] = per-layer list of rank 0 on stage 0
        return {"step": n, "loss": 1.0, "microbatches": [
            {"stage": s, "chunk": 0, "microbatch": m, "imbalance": layers if s == 0 and r == 0 else [0.9, 0.9]}
            for m, layers in enumerate(rates) for s in (0, 1) for r in (0, 1)]}
    lines = [step(0, [[1.2, 1.4], [0.8, 0.9]]), step(1, [[2.0, 1.0], [1.1, 1.1]]),
             {"step": 2, "oom": True, "policy": "static-under"}, step(1, [[1.0, 1.0], [1.5, 1.5]]),
             {"summary": True, "tokens_per_s": 1.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trace = load_trace(path)  # the layer mean, the max over ranks, at least 1; a step's last record wins
    assert [list(rates) for rates in trace] == [pytest.approx([1.3, 1.0]), pytest.approx([1.0, 1.5])]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps(lines[0]) + "\n" + json.dumps({"iteration": 0, "microbatch": 0, "imbalance": 1.0}))
    with pytest.raises(ValueError, match="mixes trace rows"):
        load_trace(mixed)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"step": 0, "loss": 1.0, "microbatches": [{"imbalance": [1.0]}]}) + "\n")
    with pytest.raises(ValueError, match="line 1"):
        load_trace(bad)


def test_a_chunk_without_moe_layers_logs_no_rates_and_reads_as_balanced(tmp_path):
    """The trainer logs ``"imbalance": []`` for a chunk with no MoE layer (a dense model): rate 1; a record with an
    odd ``step`` outside the steps read is no traceback."""
    path = tmp_path / "dense.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in (
        {"step": 0, "microbatches": [{"stage": 0, "chunk": 0, "microbatch": 0, "imbalance": []}]},
        {"step": 1, "microbatches": [{"stage": 0, "chunk": 0, "microbatch": 0}]},
        {"step": [1], "summary": True, "microbatches": []})) + "\n")
    assert load_trace(path) == ((1.0,), (1.0,))


def test_a_metrics_files_layer_mean_stays_finite(tmp_path):
    """Rates whose sum overflows a float read as their mean, not infinity (as the row format reads each rate)."""
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"step": 0, "microbatches": [{"stage": 0, "chunk": 0, "microbatch": 0,
                                                             "imbalance": [1e308, 1e308]}]}) + "\n")
    assert load_trace(path) == ((1e308,),)
