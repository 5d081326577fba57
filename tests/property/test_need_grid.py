"""The need grid of the decision path (``runtime.keys.NeedGrid``): a level decides a budget no larger than the
request's, gives up less than ``step`` times the need or ``budget_step`` times the budget, maps one key to one decided
budget, orders the keys of each grid by need, and decides a budget equal to the anchor exactly."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bagualu2.runtime.keys import NeedGrid

steps = st.sampled_from([0.01, 0.05, 0.15, 0.5, 1.0])


@st.composite
def requests(draw):
    quantum = draw(st.integers(1, 1 << 20))
    anchor = draw(st.integers(1, 1 << 40))
    unmitigated = draw(st.integers(1, 1 << 42))
    budget = draw(st.integers(0, unmitigated))
    floor = draw(st.integers(0, budget))
    return quantum, anchor, unmitigated, floor, budget


@settings(max_examples=400)
@given(requests(), steps, st.none() | steps)
def test_a_level_decides_at_most_the_budget_and_gives_up_little(request, step, budget_step):
    quantum, anchor, unmitigated, floor, budget = request
    grid = NeedGrid(quantum, step, anchor_bytes=anchor, budget_step=budget_step)
    key, decided = grid.level(unmitigated, floor, budget)
    assert floor <= decided <= budget or key == ("exact", budget)
    if key == ("exact", budget):
        assert decided == budget
        return
    need = unmitigated - budget
    given_up = budget - decided
    # the need grid: one step of the need (the first step: one quantum); the budget grid: one of its steps of the
    # budget
    budget_step = step if budget_step is None else budget_step
    assert given_up <= min(max(step * need, quantum) + 1, budget_step * budget + 1)


@settings(max_examples=200)
@given(requests(), steps, st.none() | steps, st.lists(st.integers(0, 1 << 42), min_size=2, max_size=30))
def test_one_key_decides_one_budget_and_keys_order_needs_within_a_grid(request, step, budget_step, budgets):
    quantum, anchor, unmitigated, _, _ = request
    grid = NeedGrid(quantum, step, anchor_bytes=anchor, budget_step=budget_step)
    decided_by_key: dict = {}
    for budget in budgets:
        budget = min(budget, unmitigated)
        key, decided = grid.level(unmitigated, 0, budget)
        assert decided_by_key.setdefault(key, decided) == decided
    ints = sorted(k for k in decided_by_key if type(k) is int)
    for low, high in zip(ints, ints[1:]):
        if (low >= 0) == (high >= 0):  # a larger key of one grid: a larger need, a smaller decided budget
            assert decided_by_key[low] > decided_by_key[high]


@settings(max_examples=200)
@given(st.integers(1, 1 << 20), st.integers(1, 1 << 40), st.integers(0, 1 << 42), steps)
def test_a_budget_of_the_whole_anchor_is_decided_exactly(quantum, anchor, extra, step):
    grid = NeedGrid(quantum, step, anchor_bytes=anchor, budget_step=step / 3)
    key, decided = grid.level(anchor + extra, 0, anchor)
    assert decided == anchor


def test_a_stage_under_a_cap_anchors_its_paths_grids_at_the_cap():
    from bagualu2.costmodel import presets
    from bagualu2.runtime import DecisionPath, Stage

    model, parallel = presets.model("tiny-moe")
    hardware = presets.hardware("cpu")
    cap = Stage(model, parallel, hardware).graph(0, 1.0).unmitigated_bytes // 3
    engine = Stage(model, parallel, hardware, m_max_bytes=cap)
    assert engine.memory.m_max_bytes == cap
    path = DecisionPath.on(engine)
    assert path.needs.level(cap * 5, 0, cap)[1] == cap == path.pregate_needs.level(cap * 5, 0, cap)[1]
