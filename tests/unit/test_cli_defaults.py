"""Every ``bagualu2`` command runs on its defaults and its ``--json`` holds the fields docs/cli.md documents."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bagualu2.cli import app

FIELDS = {
    "presets": {"models", "hardware"},
    "memory": {"model", "hardware", "imbalance", "plan", "pp", "vp", "num_microbatches", "stages"},
    "plan": {"inputs", "status", "plan", "activation_bytes", "budget_bytes", "unmitigated_bytes", "floor_bytes",
             "overhead_s", "rows", "violations"},
    "schedule": {"inputs", "plan", "counts", "orders", "lower_bound_s"},
    "budget": {"m_max_bytes", "m0_bytes", "peak_in_flight_bytes", "fits", "forwards"},
    "curve": {"capacity_bytes", "policies"},
    "compare": {"inputs", "points", "summary"},
    "demo": {"m_max_bytes", "peak_in_flight_bytes", "fits", "forwards", "training"},
}


@pytest.mark.launch
@pytest.mark.parametrize("command", sorted(FIELDS))
def test_command_runs_on_its_defaults(command):
    result = CliRunner().invoke(app, [command, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert FIELDS[command] <= set(data), set(FIELDS[command]) - set(data)


@pytest.mark.slow
def test_simulate_runs_on_its_defaults():
    result = CliRunner().invoke(app, ["simulate", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert len(rows) == 7
    assert all({"policy", "mfu", "oom_events", "restarts", "tokens_per_s"} <= set(row) for row in rows)


@pytest.mark.launch
def test_train_on_its_defaults_is_one_torchrun_command():
    result = CliRunner().invoke(app, ["train", "--dry-run", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["command"][-2:] == ["-m", "reference_trainer.train"]
