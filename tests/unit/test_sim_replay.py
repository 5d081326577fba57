"""The per-iteration decision path: budgets, cached plans and deferred downgrades keep a stage within M_max."""

import json

import pytest
from typer.testing import CliRunner

from bagualu2.cli import app
from bagualu2.costmodel import presets
from bagualu2.sim import replay_iteration, spike_trace


@pytest.mark.parametrize("name", ["glm-1041b-a35b", "glm-423b-a30b", "glm-188b-a20b"])
def test_replay_with_spikes_fits_and_downgrades_spikes(name):
    model, parallel = presets.model(name)
    hw = presets.hardware("paper-gpu")
    trace = list(spike_trace(parallel.num_microbatches, spike_rate=0.03, seed=1))
    trace[1] = trace[-1] = 2.6  # one spike in warmup, one in the steady phase
    replay = replay_iteration(model, parallel, hw, trace)
    assert replay.fits and replay.peak_in_flight_bytes <= replay.m_max_bytes
    assert len(replay.decisions) == parallel.num_microbatches * parallel.vp
    for decision in replay.decisions:
        assert decision.kept_bytes <= decision.budget_bytes
        assert decision.budget_bytes >= replay.m0_bytes
    spiked = [d for d in replay.decisions if d.imbalance == 2.6]
    assert spiked and all(d.downgraded or d.kept_bytes <= d.budget_bytes for d in spiked)
    assert replay.cache_hits > replay.cache_misses


def test_spike_trace_validates_and_is_seeded():
    assert spike_trace(100, seed=4) == spike_trace(100, seed=4)
    trace = spike_trace(10_000, spike_rate=0.029, seed=0)
    assert 0.02 < sum(r > 1.1 for r in trace) / len(trace) < 0.04 and max(trace) <= 2.6
    with pytest.raises(ValueError, match="spike_rate"):
        spike_trace(10, spike_rate=1.5)
    with pytest.raises(ValueError, match="imbalance"):
        spike_trace(10, max_imbalance=0.5)


def test_demo_command():
    runner = CliRunner()
    result = runner.invoke(app, ["demo", "--model", "tiny-moe", "--hardware", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fits"] and len(data["forwards"]) == 4
    bad = runner.invoke(app, ["demo", "--spike-rate", "2"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
