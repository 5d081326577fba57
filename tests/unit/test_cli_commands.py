"""``bagualu2 budget``, ``curve`` and ``compare``: their tables / JSON agree with the library they wrap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bagualu2 import costmodel
from bagualu2.cli import app
from bagualu2.cli.curve_cmd import sparkline
from bagualu2.runtime import DecisionPath, replay_iteration, spike_trace

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})  # deterministic table layout
MODEL, HARDWARE = "glm-1041b-a35b", "paper-gpu"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run(*args: str):
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.stdout + result.stderr
    return result


def expected_trace(seed: int = 0, spikes: dict[int, float] | None = None) -> tuple[float, ...]:
    _, parallel = costmodel.presets.model(MODEL)
    trace = list(spike_trace(parallel.num_microbatches, spike_rate=0.05, max_imbalance=2.6, base_imbalance=1.1,
                             seed=seed))
    for index, rate in (spikes or {}).items():
        trace[index] = rate
    return tuple(trace)


# ---- budget ------------------------------------------------------------------------------------------------
def test_budget_json_matches_replay_iteration() -> None:
    result = run("budget", "--spike", "30=2.6", "--seed", "3", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    model, parallel = costmodel.presets.model(MODEL)
    hw = costmodel.presets.hardware(HARDWARE)
    trace = expected_trace(3, {30: 2.6})
    replay = replay_iteration(model, parallel, hw, trace, stage=0)
    assert data["trace"] == list(trace) and data["spikes"]["30"] == 2.6
    for key in ("m_max_bytes", "m0_bytes", "peak_in_flight_bytes", "fits"):
        assert data[key] == getattr(replay, key), key
    assert len(data["forwards"]) == len(replay.decisions) == 2 * parallel.num_microbatches
    for row, d in zip(data["forwards"], replay.decisions):
        assert set(row) == {"index", "microbatch", "chunk", "phase", "imbalance", "budget_bytes", "kept_bytes",
                            "action", "overhead_s", "in_flight_bytes", "plan"}
        assert (row["budget_bytes"], row["kept_bytes"], row["action"], row["plan"]) == (
            d.budget_bytes, d.kept_bytes, d.action, d.plan)
    spiked = [row for row in data["forwards"] if row["microbatch"] == 30]
    assert spiked and all(row["imbalance"] == 2.6 and row["action"] in ("replan", "downgrade") for row in spiked)
    base = min(trace)
    assert data["spikes"] == {str(i): r for i, r in enumerate(trace) if r > base}


@pytest.mark.parametrize("args", [("--spike", "0=1"), ("--spike-rate", "1")])
def test_budget_spikes_are_the_micro_batches_above_the_base_imbalance(args) -> None:
    """Not those above the trace's least rate: a micro-batch forced below the base, or every one a spike."""
    data = json.loads(run("budget", *args, "--json").stdout)
    assert data["spikes"] == {str(i): r for i, r in enumerate(data["trace"]) if r > 1.1}


def test_replay_reports_its_progress_per_forward_and_decides_the_same() -> None:
    model, parallel = costmodel.presets.model(MODEL)
    hw = costmodel.presets.hardware(HARDWARE)
    trace = expected_trace(3, {30: 2.6})
    seen: list[tuple[int, int]] = []
    counted = replay_iteration(model, parallel, hw, trace, stage=0, progress=lambda *args: seen.append(args))
    total = parallel.num_microbatches * parallel.vp
    assert seen == [(k, total) for k in range(1, total + 1)]
    assert counted.decisions == replay_iteration(model, parallel, hw, trace, stage=0).decisions
    with pytest.raises(ValueError, match="progress must be a callable"):
        replay_iteration(model, parallel, hw, trace, stage=0, progress=3)


@pytest.mark.slow
def test_budget_compact_view_and_all() -> None:
    compact = run("budget", "--spike", "30=2.6", "--stage", "1")  # stage 0 mitigates every forward
    assert compact.exit_code == 0, compact.stderr
    assert "forwards mitigated, absorbed or re-planned" in compact.stdout and "30=2.6" in compact.stdout
    rows = [line for line in compact.stdout.splitlines() if line.startswith("│")]
    every = run("budget", "--spike", "30=2.6", "--stage", "1", "--all")
    all_rows = [line for line in every.stdout.splitlines() if line.startswith("│")]
    assert len(all_rows) == 128 > len(rows) > 0
    assert all(" keep " not in row or "none" not in row for row in rows)  # the compact view skips plain keeps
    assert "fits" in compact.stdout and "peak in flight" in compact.stdout


def test_budget_paper_downgrade() -> None:
    data = json.loads(run("budget", "--spike", "30=2.6", "--downgrade", "paper", "--json").stdout)
    assert data["downgrade"] == "paper"
    assert {row["action"] for row in data["forwards"]} <= {"keep", "downgrade"}


@pytest.mark.filterwarnings("ignore:pipeline degree 2")  # tiny-moe has pp=2: sequential fallback, by design
def test_budget_tiny_model_defaults_within_ep() -> None:
    """tiny-moe has ep=1: the default spikes shrink to imbalance 1 instead of failing."""
    result = run("budget", "-m", "tiny-moe", "-H", "cpu", "--json")
    assert result.exit_code == 0, result.stderr
    assert set(json.loads(result.stdout)["trace"]) == {1.0}


# ---- curve -------------------------------------------------------------------------------------------------
def test_curve_json_is_the_schedule_walk() -> None:
    result = run("curve", "--spike", "30=2.6", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    model, parallel = costmodel.presets.model(MODEL)
    hw = costmodel.presets.hardware(HARDWARE)
    path = DecisionPath(model, parallel, hw, stage=0)
    memory, steps = path.stage_plan()
    trace = expected_trace(0, {30: 2.6})
    replay = replay_iteration(model, parallel, hw, trace, stage=0)
    assert data["capacity_bytes"] == memory.m_max_bytes and data["num_steps"] == len(steps)
    curves = {p["policy"]: p for p in data["policies"]}
    assert list(curves) == ["flexible", "static-over", "ideal"]
    flexible = curves["flexible"]["in_flight_bytes"]
    at_forwards = [held for held, (is_forward, *_rest) in zip(flexible, steps) if is_forward]
    assert at_forwards == [d.in_flight_bytes for d in replay.decisions]  # the budget's own bookkeeping
    assert flexible[-1] == 0 and curves["flexible"]["peak_bytes"] == replay.peak_in_flight_bytes
    assert not curves["flexible"]["exceeds_capacity"]
    floors = [path.graph(c, 1.0).floor_bytes for c in range(parallel.vp)]
    assert min(floors) <= curves["static-over"]["peak_bytes"] <= memory.inflight_chunks * max(floors)
    assert curves["ideal"]["exceeds_capacity"] and curves["ideal"]["peak_bytes"] > memory.m_max_bytes
    for p in data["policies"]:
        assert p["peak_bytes"] == max(p["in_flight_bytes"]) and min(p["in_flight_bytes"]) >= 0


@pytest.mark.slow
def test_curve_sparkline_and_png(tmp_path: Path) -> None:
    target = tmp_path / "curve.png"
    result = run("curve", "--policy", "flexible", "--policy", "ideal", "--spike", "30=2.6", "--png", str(target))
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("flexible ") and "(fits)" in line for line in lines)
    assert any(line.startswith("ideal ") and "exceeds capacity" in line for line in lines)
    assert not any(line.startswith("static-over") for line in lines)
    assert target.read_bytes().startswith(PNG_MAGIC) and [p.name for p in tmp_path.iterdir()] == ["curve.png"]


def test_sparkline_levels() -> None:
    cells = sparkline([0, 1, 2, 4, 8], top=8, width=5)
    assert "".join(block for block, _ in cells) == " ▁▂▄█"
    assert len(sparkline(list(range(1000)), top=1000, width=96)) == 96
    assert [peak for _, peak in sparkline([1, 5, 2, 7], top=7, width=2)] == [5, 7]  # each column's max


# ---- compare -----------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compare_json_points_and_summary() -> None:
    result = run("compare", "-m", "tiny-moe", "-m", "glm-188b-a20b", "-r", "1", "--budgets", "2", "-H", "cpu",
                 "--time-limit", "2", "--json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["inputs"]["models"] == ["tiny-moe", "glm-188b-a20b"] and data["inputs"]["budgets"] == 2
    points = data["points"]
    assert len(points) == 4 == data["summary"]["num_points"]
    for p in points:
        assert p["floor_bytes"] < p["budget_bytes"] < p["unmitigated_bytes"]
        if p["exact_status"] == "OPTIMAL":
            assert p["mitigation_ratio"] >= 1 - 1e-9
        if p["exact_schedule"] == "exact":
            assert p["fusion_ratio"] >= 1 - 1e-9
    ratios = sorted(p["mitigation_ratio"] for p in points)
    summary = data["summary"]["mitigation"]
    assert summary["max"] == ratios[-1] and ratios[0] <= summary["median"] <= summary["p95"] <= summary["max"]


def test_compare_table() -> None:
    result = run("compare", "-m", "tiny-moe", "-r", "1", "--budgets", "1")
    assert result.exit_code == 0, result.stderr
    assert "greedy / exact overhead" in result.stdout and "DP / exact makespan" in result.stdout
    assert "median" in result.stdout and "p95" in result.stdout


@pytest.mark.parametrize("command", ["budget", "curve", "compare"])
def test_help_documents_json(command: str) -> None:
    result = run(command, "--help")
    assert result.exit_code == 0 and "JSON" in result.stdout and "--json" in result.stdout


def test_plan_runs_on_its_defaults_with_the_midpoint_budget():
    import json as _json

    from typer.testing import CliRunner as _Runner

    from bagualu2.cli import app as _app
    from bagualu2.costmodel import build_graph, presets

    result = _Runner().invoke(_app, ["plan", "--json"])
    assert result.exit_code == 0, result.output
    data = _json.loads(result.stdout)
    model, parallel = presets.model(data["inputs"]["model"])
    graph = build_graph(model, parallel, presets.hardware(data["inputs"]["hardware"]))
    assert data["budget_bytes"] == (graph.floor_bytes + graph.unmitigated_bytes) // 2
    assert data["status"] in ("OPTIMAL", "FEASIBLE") and data["activation_bytes"] <= data["budget_bytes"]


def test_models_come_from_json_files(tmp_path):
    import dataclasses
    import json as _json

    from typer.testing import CliRunner as _Runner

    from bagualu2.cli import app as _app
    from bagualu2.costmodel import presets

    model, parallel = presets.model("glm-188b-a20b")
    path = tmp_path / "mine.json"
    path.write_text(_json.dumps({"model": dataclasses.asdict(model), "parallel": dataclasses.asdict(parallel)}))
    assert presets.model_from_json(path.read_text()) == (model, parallel)
    result = _Runner().invoke(_app, ["memory", "-m", str(path), "--json"])
    assert result.exit_code == 0, result.output
    for bad, message in [({"model": {"hidden_size": 8}}, "missing ModelConfig field"),
                         ({"model": dataclasses.asdict(model), "parallel": {"pp": 0}}, "pp"),
                         ({"model": dataclasses.asdict(model), "extra": 1}, "must be"),
                         ([1, 2], "must be")]:
        path.write_text(_json.dumps(bad))
        out = _Runner().invoke(_app, ["plan", "-m", str(path)])
        assert out.exit_code == 2 and out.output.startswith("error: --model:") and message in out.output, out.output
        assert len(out.output.strip().splitlines()) == 1
