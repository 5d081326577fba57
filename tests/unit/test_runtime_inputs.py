"""Bad inputs to the runtime's public entry points: one ValueError naming the argument, never a silent default."""

from __future__ import annotations

import pytest

from bagualu2.budget import BudgetPhase
from bagualu2.costmodel import presets
from bagualu2.runtime import DecisionPath, Stage, replay_iteration

MODEL, PARALLEL = presets.model("tiny-moe")
HW = presets.hardware("cpu")


def test_a_phase_is_warmup_steady_or_a_budget_phase():
    path = DecisionPath(MODEL, PARALLEL, HW)
    budget = path.graph(0, 1.0).unmitigated_bytes // 2
    by_enum = path.forward(budget, 1.2, BudgetPhase.WARMUP, 0, limit_bytes=budget * 2)
    by_name = DecisionPath(MODEL, PARALLEL, HW).forward(budget, 1.2, "warmup", 0, limit_bytes=budget * 2)
    steady = DecisionPath(MODEL, PARALLEL, HW).forward(budget, 1.2, "steady", 0)
    assert by_enum == by_name and by_name.order != steady.order  # before: a BudgetPhase counted as steady
    for phase in ("WARMUP", "bogus", None):
        with pytest.raises(ValueError, match="phase must be one of warmup, steady"):
            path.forward(budget, 1.2, phase, 0)
    for limit in ("x", -1, 1.5e9):
        with pytest.raises(ValueError, match="limit_bytes"):
            path.forward(budget, 1.2, "warmup", 0, limit_bytes=limit)


def test_paths_over_one_engine_share_its_grid_options():
    engine = Stage(MODEL, PARALLEL, HW)
    DecisionPath.on(engine)
    DecisionPath.on(engine, downgrade="paper", planned_imbalance=1.0)  # options that are not the memo's grid
    with pytest.raises(ValueError, match="other grid options"):
        DecisionPath.on(engine, need_step=0.5)
    DecisionPath.on(Stage(MODEL, PARALLEL, HW, cache=False), need_step=0.5)
    with pytest.raises(ValueError, match="cache must be True or False"):
        Stage(MODEL, PARALLEL, HW, cache=1)


def test_a_replay_runs_on_its_paths_stage_and_model():
    trace = [1.0] * PARALLEL.num_microbatches
    path = DecisionPath(MODEL, PARALLEL, HW, stage=1)
    assert replay_iteration(MODEL, PARALLEL, HW, trace, path=path).m_max_bytes == path.engine.memory.m_max_bytes
    with pytest.raises(ValueError, match="same model, parallel config, hardware and stage"):
        replay_iteration(MODEL, PARALLEL, HW, trace, stage=0, path=path)
    dense, dense_parallel = presets.model("tiny-dense")
    with pytest.raises(ValueError, match="same model"):
        replay_iteration(dense, dense_parallel, HW, trace, path=path)
    with pytest.raises(ValueError, match="list or tuple"):
        replay_iteration(MODEL, PARALLEL, HW, (r for r in trace))
