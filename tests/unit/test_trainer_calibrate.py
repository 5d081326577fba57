"""``reference_trainer.experiments.calibrate``: a measured run as the simulator's calibration takes it, and its table."""

from __future__ import annotations

import json

import pytest

from bagualu2.costmodel import presets
from reference_trainer.experiments.calibrate import measured, table


def _step(n, step_s, peak, rates):
    return {"step": n, "loss": 1.0, "step_s": step_s, "peak_activation_bytes": peak,
            "microbatches": [{"stage": 0, "chunk": 0, "microbatch": m, "imbalance": [r]} for m, r in enumerate(rates)]}


def test_measured_takes_the_last_record_of_each_step_and_the_steps_after_the_first(tmp_path):
    lines = [_step(0, 0.9, 10, [1.0, 1.2]), _step(1, 0.3, 30, [1.1, 1.0]), _step(2, 0.5, 40, [1.0, 1.0]),
             {"step": 3, "oom": True, "policy": "static-under", "peak_activation_bytes": 45},
             _step(2, 0.4, 25, [1.3, 1.0])]
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    summary = {"tokens_per_s": 100.0, "restart_s": 4.0, "steps_lost": 1, "restarts": 1, "seconds": 9.0}
    run = measured("static-under", summary, path)
    assert run.step_s == pytest.approx(0.35) and run.peak_activation_bytes == 45  # the failed launch's, from its record
    without = path.read_text().replace(', "peak_activation_bytes": 45', "")
    path.write_text(without)
    assert measured("static-under", summary, path).peak_activation_bytes == 40  # the first launch's step 2
    assert run.trace == ((1.0, 1.2), (1.1, 1.0), (1.3, 1.0)) and run.other_s == 0.0  # restarted: not measured
    assert run.warmup_s == 0.0  # restarted: its first step is not the warm-up of one launch
    plain = measured("ideal", {**summary, "restarts": 0, "restart_s": 0.0, "steps_lost": 0}, path)
    assert plain.other_s == pytest.approx((9.0 - 0.9 - 0.3 - 0.4) / 3)
    assert plain.warmup_s == pytest.approx(0.9 - 0.35)
    row = {"policy": "ideal", "measured_tokens_per_s": 100.0, "tokens_per_s": 110.0, "tokens_error": 0.1,
           "measured_peak_activation_bytes": 30, "peak_activation_bytes": 30, "peak_error": 0.0,
           "measured_step_s": 0.35, "step_s": 0.3, "measured_restarts": 0, "restarts": 0,
           "kernel_launch_s": 5e-4, "copy_launch_s": 2e-4}
    text = table([row], presets.hardware("cpu"), 8, "each", "python -m reference_trainer.experiments.calibrate")
    assert "| ideal | 100.0 | 110.0 | +10.0% | 30 | 30 | +0.00% | 0.350 | 0.300 | 0 / 0 | 500 / 200 |" in text
    assert "right before each policy's run (`--fit each`) on two 8-step runs" in text
