"""``bagualu2 schedule``: DP vs exact vs baseline orders as a table / JSON, a PNG Gantt, one-line errors (exit 2)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bagualu2 import costmodel, fusion
from bagualu2.cli import app
from bagualu2.fusion import Order, dp, simulate
from bagualu2.fusion.baselines import BASELINES
from bagualu2.mitigation import greedy

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})  # deterministic table layout
MODEL, HARDWARE = "glm-1041b-a35b", "paper-gpu"
GIB = 2**30
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ORDERS = ("dp", "exact", "sequential", "megatron-core", "megatron-kwai", "megatron-overlapped")


def run(*args: str):
    result = runner.invoke(app, ["schedule", "--time-limit", "2", *args])
    assert "Traceback" not in result.stdout + result.stderr
    return result


def build(model: str = MODEL, hardware: str = HARDWARE, imbalance: float = 1.0, budget_gib: float | None = None):
    """The graph, budget and chains exactly as the command builds them."""
    model_config, parallel = costmodel.presets.model(model)
    hw = costmodel.presets.hardware(hardware)
    graph = costmodel.build_graph(model_config, parallel, hw, imbalance=imbalance)
    budget = (graph.floor_bytes + graph.unmitigated_bytes) // 2 if budget_gib is None else int(budget_gib * GIB)
    plan = greedy.solve(graph, budget).plan
    return graph, budget, fusion.build_chains(graph, plan, graph, plan, hardware=hw)


def test_table() -> None:
    graph, budget, chains = build()
    result = run()
    assert result.exit_code == 0, result.stdout + result.stderr
    out = result.stdout
    assert f"schedule: {MODEL} on {HARDWARE}, {graph.label}, imbalance 1, budget {budget / GIB:.4g} GiB" in out
    f, b, o, r = chains.counts()
    assert f"stages per chain: F {f}, B {b}, O {o}, R {r}" in out
    dp_order = dp.solve(chains)
    assert f"DP order: {dp_order}" in out
    assert f"makespan {dp_order.makespan_ns * 1e-6:.3f} ms" in out  # the Gantt header
    assert all(f"{res.value:<8}|" in out for res in costmodel.Resource)  # one Gantt row per resource
    lines = out.splitlines()
    for name in ORDERS:
        assert any(line.startswith(f"│ {name} ") for line in lines), name
    reference = simulate(dp_order, chains).makespan_ns
    dp_row = next(line for line in lines if line.startswith("│ dp "))
    assert f"{reference * 1e-6:.3f}" in dp_row and "1.000" in dp_row
    for name, baseline in BASELINES.items():
        row = next(line for line in lines if line.startswith(f"│ {name} "))
        makespan = baseline(chains).makespan_ns
        assert f"{makespan * 1e-6:.3f}" in row and f"{makespan / reference:.3f}" in row
    assert f"lower bound {chains.lower_bound_ns * 1e-6:.3f} ms" in out
    assert f"DP / lower bound {reference / chains.lower_bound_ns:.3f}" in out


@pytest.mark.parametrize(("model", "hardware", "budget", "rate"), [
    (MODEL, HARDWARE, None, 1.5), (MODEL, HARDWARE, 0.5, 1.5),
    ("tiny-moe", "cpu", None, 1.0)])  # cpu: offloads (O, R); tiny-moe has ep=1, so imbalance 1 only
def test_json_matches_the_solvers(model: str, hardware: str, budget: float | None, rate: float) -> None:
    graph, budget_bytes, chains = build(model, hardware, rate, budget)
    extra = [] if budget is None else ["--budget-gib", str(budget)]
    result = run("--model", model, "--hardware", hardware, "--imbalance", str(rate), "--json", *extra)
    assert result.exit_code == 0, result.stdout + result.stderr
    data = json.loads(result.stdout)
    assert data["inputs"] == {"model": model, "hardware": hardware, "stage": 0, "chunk": 0, "layers": graph.label,
                              "imbalance": rate, "budget_gib": budget_bytes / GIB, "budget_bytes": budget_bytes,
                              "time_limit_s": 2.0}
    assert data["counts"] == dict(zip("FBOR", chains.counts()))
    assert list(data["orders"]) == list(ORDERS)
    dp_order = dp.solve(chains)
    assert data["orders"]["dp"]["order"] == str(dp_order)
    assert data["orders"]["dp"]["makespan_s"] == pytest.approx(dp_order.makespan_s, rel=1e-12)
    timeline = simulate(dp_order, chains)
    assert data["orders"]["dp"]["exposed_mitigation_s"] == pytest.approx(timeline.exposed_mitigation_ns * 1e-9)
    for name, baseline in BASELINES.items():
        order = baseline(chains)
        assert data["orders"][name]["order"] == str(order)
        assert data["orders"][name]["makespan_s"] == pytest.approx(order.makespan_s, rel=1e-12)
    bound = data["lower_bound_s"]
    assert bound == pytest.approx(chains.lower_bound_ns * 1e-9)
    exact = data["orders"]["exact"]
    assert exact["solver"] in ("exact", "exact-feasible")
    replay = simulate(Order.from_str(exact["order"]), chains)  # the issue order reproduces its makespan
    assert not Order.from_str(exact["order"]).barriers and replay.makespan_s == pytest.approx(exact["makespan_s"])
    assert bound * (1 - 1e-12) <= exact["makespan_s"] <= dp_order.makespan_s * (1 + 1e-12)
    assert all(bound * (1 - 1e-12) <= o["makespan_s"] for o in data["orders"].values())
    assert data["png"] is None


@pytest.mark.slow
def test_png(tmp_path) -> None:
    target = tmp_path / "gantt.png"
    result = run("--png", str(target))
    assert result.exit_code == 0, result.stdout + result.stderr
    assert target.read_bytes().startswith(PNG_MAGIC)
    assert f"wrote the DP order's Gantt chart to {target}" in result.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["gantt.png"]
    data = json.loads(run("--png", str(tmp_path / "again.png"), "--json").stdout)
    assert data["png"] == str(tmp_path / "again.png") and (tmp_path / "again.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.parametrize(("args", "option"), [
    (["--budget-gib", "-1"], "--budget-gib"),
    (["--budget-gib", "nan"], "--budget-gib"),
    (["--budget-gib", "0.0001"], "--budget-gib"),  # below the floor M0
    (["--stage", "99"], "--stage"),
    (["--chunk", "-1"], "--chunk"),
    (["--png", "/nonexistent/dir/x.png"], "--png"),
    (["--model", "nope"], "--model"),
    (["--hardware", "nope"], "--hardware"),
    (["--imbalance", "0.5"], "--imbalance"),
    (["--time-limit", "0"], "--time-limit"),
])
def test_bad_input_exits_2(args: list[str], option: str) -> None:
    result = run(*args)
    assert result.exit_code == 2, result.stdout + result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option}: "), result.stderr


def test_png_is_a_directory(tmp_path) -> None:
    result = run("--png", str(tmp_path))
    assert result.exit_code == 2 and result.stderr.startswith("error: --png: ")
    assert list(tmp_path.iterdir()) == []


def test_budget_below_floor_names_the_floor() -> None:
    graph, _, _ = build()
    result = run("--budget-gib", "0.0001")
    assert "below the floor M0" in result.stderr and f"{graph.floor_bytes / GIB:.4g} GiB" in result.stderr
