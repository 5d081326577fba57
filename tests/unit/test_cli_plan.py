"""``bagualu2 plan``: solver output as a table / JSON, exit 1 without a plan, one-line errors with exit 2."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bagualu2 import costmodel
from bagualu2.cli import app
from bagualu2.cli.plan_cmd import plan_rows
from bagualu2.mitigation import check_conflicts, exact, greedy

runner = CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})  # deterministic table layout
MODEL, HARDWARE, IMBALANCE = "glm-1041b-a35b", "paper-gpu", 1.5
GIB = 2**30


def run(*args: str):
    result = runner.invoke(app, list(args))
    assert "Traceback" not in result.stdout + result.stderr
    return result


def graph(hardware: str = HARDWARE) -> costmodel.OpGraph:
    model, parallel = costmodel.presets.model(MODEL)
    return costmodel.build_graph(model, parallel, costmodel.presets.hardware(hardware), imbalance=IMBALANCE)


def mid_budget_gib(g: costmodel.OpGraph, fraction: float = 0.5) -> float:
    """A budget (GiB, 3 decimals) strictly between the floor M0 and the unmitigated bytes."""
    value = round((g.floor_bytes + fraction * (g.unmitigated_bytes - g.floor_bytes)) / GIB, 3)
    assert g.floor_bytes < value * GIB < g.unmitigated_bytes
    return value


def plan_args(budget: float, *extra: str) -> list[str]:
    return ["plan", "--model", MODEL, "--hardware", HARDWARE, "--imbalance", str(IMBALANCE),
            "--budget-gib", str(budget), *extra]


@pytest.mark.parametrize("solver", ["greedy", "greedy-paper", "exact"])
def test_plan_table(solver: str) -> None:
    g = graph()
    budget = mid_budget_gib(g)
    result = run(*plan_args(budget, "--solver", solver))
    assert result.exit_code == 0, result.stdout + result.stderr
    out = result.stdout
    assert MODEL in out and HARDWARE in out and "stage 0 chunk 0" in out and "imbalance 1.5" in out
    assert f"budget {budget:.3f} GiB" in out
    assert f"unmitigated {g.unmitigated_bytes / GIB:.3f} GiB" in out and f"floor (M0) {g.floor_bytes / GIB:.3f}" in out
    assert "mitigated tensors" in out and "RECOMPUTE" in out and "overhead" in out and "conflicts" not in out
    assert ("OPTIMAL" if solver == "exact" else "FEASIBLE") in out
    if solver != "exact":
        sol = greedy.solve(g, int(budget * GIB),
                           config=greedy.GreedyConfig(variant="paper" if solver == "greedy-paper" else "improved"))
        for row in plan_rows(g, sol):
            assert row["tensor"] in out and ", ".join(row["consumers"]) in out
        assert f"activation kept {sol.cost.activation_bytes / GIB:.3f} GiB" in out


def test_plan_json_matches_greedy() -> None:
    g = graph()
    budget = mid_budget_gib(g, 0.4)
    result = run(*plan_args(budget, "--json"))
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    sol = greedy.solve(g, int(budget * GIB))
    assert data["inputs"] == {"model": MODEL, "hardware": HARDWARE, "stage": 0, "chunk": 0, "layers": g.label,
                              "imbalance": IMBALANCE, "budget_gib": budget, "solver": "greedy",
                              "time_limit_s": 10.0}
    assert (data["status"], data["solver"], data["reason"]) == (sol.status.name, sol.solver, "")
    assert data["plan"] == str(sol.plan)
    assert data["activation_bytes"] == sol.cost.activation_bytes <= data["budget_bytes"] == int(budget * GIB)
    assert (data["unmitigated_bytes"], data["floor_bytes"]) == (g.unmitigated_bytes, g.floor_bytes)
    assert data["overhead_s"] == pytest.approx(sol.cost.overhead_s)
    assert (data["recompute_s"], data["offload_s"], data["quantize_s"]) == pytest.approx(
        (sol.cost.recompute_s, sol.cost.offload_s, sol.cost.quantize_s))
    assert data["violations"] == [] == check_conflicts(g, sol.plan)
    rows = data["rows"]
    assert [r["tensor"] for r in rows] == [r["tensor"] for r in plan_rows(g, sol)]
    assert len({r["tensor"] for r in rows}) == len(rows)  # consumers of one tensor grouped in one row
    assert any(len(r["consumers"]) > 1 for r in rows)


@pytest.mark.parametrize("hardware", ["paper-gpu", "cpu"])  # cpu: offloads
def test_rows_add_up_to_the_evaluator(hardware: str) -> None:
    g = graph(hardware)
    budget = int(mid_budget_gib(g, 0.3) * GIB)
    for sol in (greedy.solve(g, budget), exact.solve(g, budget, time_limit_s=10)):
        rows = plan_rows(g, sol)
        assert sum(r["saved_bytes"] for r in rows) == g.unmitigated_bytes - sol.cost.activation_bytes
        for strategy, total in (("OFFLOAD", sol.cost.offload_s), ("QUANTIZE", sol.cost.quantize_s)):
            assert sum(r["added_s"] for r in rows if r["strategy"] == strategy) == pytest.approx(total, abs=1e-12)
        assert all(r["added_s"] is None for r in rows if r["strategy"] == "RECOMPUTE")
        for r in rows:
            spec = g.tensors[r["tensor"]]
            if r["strategy"] == "QUANTIZE":
                assert r["saved_bytes"] == spec.nbytes - spec.numel


def test_generous_budget_keeps_everything() -> None:
    result = run(*plan_args(1000.0))
    assert result.exit_code == 0 and "nothing to mitigate" in result.stdout and "OPTIMAL" in result.stdout


@pytest.mark.parametrize("solver", ["greedy", "exact"])
def test_infeasible_exits_1_with_reason(solver: str) -> None:
    result = run(*plan_args(0.001, "--solver", solver))
    assert result.exit_code == 1, result.stdout + result.stderr
    assert "INFEASIBLE" in result.stdout and "below the floor M0" in result.stdout and result.stderr == ""
    data = json.loads(run(*plan_args(0.001, "--solver", solver, "--json")).stdout)
    assert data["status"] == "INFEASIBLE" and "below the floor" in data["reason"] and data["rows"] == []


def test_other_stage_and_chunk() -> None:
    model, parallel = costmodel.presets.model(MODEL)
    g = costmodel.build_graph(model, parallel, costmodel.presets.hardware(HARDWARE), imbalance=IMBALANCE,
                              stage=3, chunk=1)
    budget = mid_budget_gib(g)
    result = run(*plan_args(budget, "--stage", "3", "--chunk", "1", "--json"))
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["inputs"]["layers"] == g.label and data["plan"] == str(greedy.solve(g, int(budget * GIB)).plan)


# ---- errors: one line on stderr, exit code 2, never a traceback ---------------------------------------------
@pytest.mark.parametrize(("args", "option"), [
    (["--budget-gib", "-1"], "--budget-gib"),
    (["--budget-gib", "abc"], "--budget-gib"),
    (["--budget-gib", "inf"], "--budget-gib"),
    (["--budget-gib", "nan"], "--budget-gib"),
    (["--budget-gib", "1", "--solver", "foo"], "--solver"),
    (["--budget-gib", "1", "--stage", "99"], "--stage"),
    (["--budget-gib", "1", "--chunk", "7"], "--chunk"),
    (["--budget-gib", "1", "--imbalance", "0.5"], "--imbalance"),
    (["--budget-gib", "1", "--model", "no-such-model"], "--model"),
    (["--budget-gib", "1", "--hardware", "no-such-hw"], "--hardware"),
    (["--budget-gib", "1", "--solver", "exact", "--time-limit", "0"], "--time-limit"),
])
def test_bad_input_is_one_line(args: list[str], option: str) -> None:
    result = run("plan", "--model", MODEL, *args)
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {option}: "), result.stderr
    assert result.stdout == ""


def test_help_documents_exit_codes() -> None:
    result = run("plan", "--help")
    assert result.exit_code == 0
    assert "Exit codes" in result.stdout and "INFEASIBLE" in result.stdout and "--budget-gib" in result.stdout


def test_conflicts_are_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A solver never returns a conflicting plan; force one to check the red rows and the row bytes."""
    from bagualu2.cli import plan_cmd
    from bagualu2.mitigation.solution import SolveStatus, make_solution

    bad = costmodel.Plan.from_str("L0.router/L0.norm2_out=RECOMPUTE")
    monkeypatch.setattr(plan_cmd, "_solve", lambda g, *_: make_solution(g, bad, SolveStatus.FEASIBLE, "forced",
                                                                         0.0, 0.0))
    result = run(*plan_args(1000.0))
    assert result.exit_code == 0, result.stderr
    assert "conflicts" in result.stdout and "multi-device" in result.stdout
    assert "L0.router/L0.norm2_out" in result.stdout
    data = json.loads(run(*plan_args(1000.0, "--json")).stdout)
    assert [v["rule"] for v in data["violations"]] == ["multi-device"]
    g = graph()
    assert sum(r["saved_bytes"] for r in data["rows"]) == g.unmitigated_bytes - data["activation_bytes"]
