"""``reference_trainer.experiments.compare``: the table over seeds (medians, per-seed ratios on the same trace, sums)
and its flags, checked before any run starts."""

from __future__ import annotations

import pytest

from reference_trainer.experiments import calibrate, compare


def _summary(tokens: float, *, oom: int = 0, restarts: int = 0) -> dict:
    return {"tokens_per_s": tokens, "mfu": tokens / 1e5, "oom_events": oom, "restarts": restarts,
            "restart_s": 10.0 * restarts, "steps_lost": restarts, "reruns": 0, "peak_activation_bytes": 90,
            "memory_cap_bytes": 100, "planning_fraction": 0.001}


RUNS = {"flexible": [_summary(1200), _summary(1000), _summary(1300)],
        "static-over": [_summary(1000), _summary(900), _summary(1000)],
        "kwai": [_summary(900, oom=1, restarts=1), _summary(950), _summary(800, oom=1, restarts=1)],
        "adapipe": [_summary(1100), _summary(700), _summary(700)],
        "ideal": [_summary(1250), _summary(1100), _summary(1300)]}


def test_ratios_are_medians_with_the_range_of_the_per_seed_ratios():
    value, low, high = compare._ratio(RUNS, "flexible", "static-over")
    assert value == pytest.approx(1200 / 1000)
    assert (low, high) == pytest.approx((1000 / 900, 1300 / 1000))
    assert compare._ratio(RUNS, "flexible", "oracle") is None


def test_headline_names_the_best_of_kwai_and_adapipe_by_median():
    line = compare.headline(RUNS)
    assert "0 OOM events" in line and "1.20x static-over" in line and "0.96x ideal" in line
    assert f"{1200 / 900:.2f}x the best of kwai / adapipe (kwai)" in line


def test_table_has_a_row_per_policy_and_sums_restarts_over_seeds():
    block = compare.table(RUNS, ["a note"], "python -m reference_trainer.experiments.compare")
    rows = [line for line in block.splitlines() if line.startswith("| ") and not line.startswith("| policy")
            and not line.startswith("| ---")]
    assert [row.split(" | ")[0][2:] for row in rows] == list(RUNS)
    kwai = next(row for row in rows if row.startswith("| kwai"))
    cells = [cell.strip() for cell in kwai.strip("|").split("|")]
    assert cells[1] == "900.0 (800.0-950.0)" and cells[5:9] == ["2", "2", "20.0", "2"]
    assert block.rstrip().endswith("a note")


def one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines  # no usage block, no traceback
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["--spike-rate", "2"], "--spike-rate"), (["--steps", "0"], "--steps"), (["--recipe", "nope"], "--recipe"),
    (["--seeds", "-1"], "--seeds must be an integer"), (["--seeds", "0", str(2**63)], "--seeds must be an integer"),
    (["--seed", "-1"], "--seed must be an integer"), (["--seeds"], "--seeds: expected at least one argument"),
    (["--recipe", "glm_moe_small"], "runs on CUDA")])
def test_bad_flags_exit_2_with_one_line_before_any_run(argv, message, capsys):
    if message == "runs on CUDA":
        import torch

        if torch.cuda.is_available():
            pytest.skip("a CUDA device is here")
    with pytest.raises(SystemExit) as exit_info:
        compare.main(argv)
    assert exit_info.value.code == 2 and message in one_error_line(capsys)


@pytest.mark.parametrize("argv, message", [(["--fit-steps", "2"], "--fit-steps"), (["--steps", "2"], "--steps"),
                                           (["--spike-max", "0.5"], "--spike-max"),
                                           (["--seed", "-1"], "--seed must be an integer"),
                                           (["--hardware-out", "."], "--hardware-out .: not a regular file"),
                                           (["--hardware-out", "/nonexistent/x.json"], "does not exist")])
def test_calibrate_bad_flags_exit_2_before_any_run(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        calibrate.main(argv)
    assert exit_info.value.code == 2 and message in one_error_line(capsys)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1"), (["--bound-s", "nan"], "--bound-s must be a finite number"),
    (["--seeds", "-1"], "--seeds must be an integer"), (["--spike-rates", "5"], "--spike-rates must be a finite"),
    (["--collective-timeout", "inf"], "--collective-timeout must be a finite"),
    (["--layouts", "nope"], "argument --layouts: invalid choice")])
def test_chaos_bad_flags_exit_2_with_one_line_before_any_launch(argv, message, capsys, monkeypatch):
    from reference_trainer.experiments import chaos

    monkeypatch.setattr(chaos, "run_one", lambda *a, **k: pytest.fail("a run was launched"))
    with pytest.raises(SystemExit) as exit_info:
        chaos.main(argv)
    assert exit_info.value.code == 2 and message in one_error_line(capsys)
