"""Solver speed: greedy and exact on one GLM-1041B-A35B stage micro-batch, and a memo hit of a plan's cost
(``runtime.Stage.cost``)."""

import pytest

from bagualu2.costmodel import build_graph, presets
from bagualu2.mitigation import exact, greedy
from bagualu2.runtime import Stage

MODEL, PARALLEL = presets.model("glm-1041b-a35b")
HW = presets.hardware("paper-gpu")
GRAPH = build_graph(MODEL, PARALLEL, HW, imbalance=1.2)
LO, HI = GRAPH.floor_bytes, GRAPH.unmitigated_bytes


@pytest.mark.parametrize("step", range(1, 9))
def test_greedy(benchmark, step):
    budget = LO + (HI - LO) * step // 9
    assert benchmark(greedy.solve, GRAPH, budget).ok


@pytest.mark.parametrize("step", [2, 5, 8])
def test_exact(benchmark, step):
    budget = LO + (HI - LO) * step // 9
    result = benchmark.pedantic(exact.solve, args=(GRAPH, budget), kwargs={"time_limit_s": 5.0}, rounds=3)
    assert result.ok


def test_cost_memo_hit(benchmark):
    """``Stage.cost`` of the same plan on the same (chunk, imbalance) again: a lookup in the stage's memo."""
    engine = Stage(MODEL, PARALLEL, HW, stage=0)
    plan = greedy.solve(GRAPH, (LO + HI) // 2).plan
    first = engine.cost(plan, 1.2, 0)
    assert benchmark(engine.cost, plan, 1.2, 0) is first
