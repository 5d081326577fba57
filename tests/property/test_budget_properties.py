"""Property tests of bagualu2.budget: Algorithm 1 keeps in-flight bytes within capacity under 1F1B-like schedules."""

from __future__ import annotations

import pytest
from collections import deque

from hypothesis import given
from hypothesis import strategies as st

from bagualu2.budget import BudgetAssigner, BudgetPhase


@st.composite
def configs(draw):
    """Valid configurations: num_warmup in [1, B], m_max_bytes >= num_warmup * m0_bytes."""
    num_microbatches = draw(st.integers(1, 24))
    num_warmup = draw(st.integers(1, num_microbatches))
    m0_bytes = draw(st.integers(0, 10**6))
    m_max_bytes = num_warmup * m0_bytes + draw(st.one_of(st.integers(0, 10), st.integers(0, 10**8)))
    return dict(
        m_max_bytes=m_max_bytes, m0_bytes=m0_bytes, num_microbatches=num_microbatches, num_warmup=num_warmup,
        contain_overruns=draw(st.booleans()),
    )


def forward(assigner: BudgetAssigner, mb: int, data, budgets: list[int]) -> None:
    budget = assigner.next_forward_budget()
    assert assigner.next_forward_budget() == budget  # idempotent peek
    warmup = assigner.phase is BudgetPhase.WARMUP
    assert assigner.next_forward() == (budget, assigner.absorb_limit_bytes() if warmup else None)  # one call
    assert assigner.absorb_limit_bytes() >= budget
    budgets.append(budget)
    assert budget >= assigner.m0_bytes
    actual_bytes = data.draw(st.integers(assigner.m0_bytes, budget), label=f"actual_bytes[{mb}]")
    peak = assigner.peak_in_flight_bytes
    assigner.record_forward(mb, actual_bytes)
    assert assigner.in_flight_bytes <= assigner.m_max_bytes
    assert assigner.peak_in_flight_bytes == max(peak, assigner.in_flight_bytes)


@pytest.mark.slow
@given(config=configs(), data=st.data())
def test_1f1b_schedule_stays_within_capacity_and_budgets_above_floor(config, data):
    assigner = BudgetAssigner(**config)
    num_microbatches, num_warmup = config["num_microbatches"], config["num_warmup"]
    budgets: list[int] = []
    in_flight: deque[int] = deque()
    for _ in range(data.draw(st.integers(1, 2), label="iterations")):  # second pass exercises reset()
        assigner.reset()
        budgets.clear()
        next_mb = 0
        for _ in range(num_warmup):  # warmup: forwards stack
            assert assigner.phase is BudgetPhase.WARMUP
            forward(assigner, next_mb, data, budgets)
            in_flight.append(next_mb)
            next_mb += 1
        while next_mb < num_microbatches:  # steady: backward of the oldest, then a forward
            assert assigner.phase is BudgetPhase.STEADY
            assigner.record_backward(in_flight.popleft())
            forward(assigner, next_mb, data, budgets)
            in_flight.append(next_mb)
            next_mb += 1
        assert assigner.phase is BudgetPhase.DONE
        while in_flight:  # cooldown
            assigner.record_backward(in_flight.popleft())
            assert 0 <= assigner.in_flight_bytes <= assigner.m_max_bytes
        assert assigner.in_flight_bytes == 0
        assert assigner.num_launched == num_microbatches
        assert len(budgets) == num_microbatches
        assert assigner.overrun_microbatches == ()


@given(config=configs(), data=st.data())
def test_in_flight_equals_sum_of_measured_bytes_even_with_overruns(config, data):
    """Re-basing: the in-flight total is the sum of the measured bytes, whatever the budgets were."""
    assigner = BudgetAssigner(**config)
    live: dict[int, int] = {}
    for mb in range(config["num_microbatches"]):
        if live and data.draw(st.booleans(), label="backward first"):
            victim = data.draw(st.sampled_from(sorted(live)), label="backward")
            assigner.record_backward(victim)
            del live[victim]
        budget = assigner.next_forward_budget()
        assert budget >= 0
        actual_bytes = data.draw(st.integers(0, 2 * budget + 10), label="actual_bytes")
        assigner.record_forward(mb, actual_bytes)
        live[mb] = actual_bytes
        assert assigner.in_flight_bytes == sum(live.values())
        assert assigner.in_flight_microbatches == tuple(live)


_any_value = st.one_of(
    st.integers(-(10**9), 10**9),
    st.integers(-3, 30),
    st.booleans(),
    st.floats(allow_nan=True),
    st.none(),
    st.text(max_size=3),
)


@given(m_max_bytes=_any_value, m0_bytes=_any_value, num_microbatches=_any_value, num_warmup=_any_value)
def test_random_config_constructs_or_raises_value_error(m_max_bytes, m0_bytes, num_microbatches, num_warmup):
    kwargs = dict(
        m_max_bytes=m_max_bytes, m0_bytes=m0_bytes, num_microbatches=num_microbatches, num_warmup=num_warmup
    )
    try:
        assigner = BudgetAssigner(**kwargs)
    except ValueError as error:
        assert "\n" not in str(error)
        return
    # Construction succeeded: the documented preconditions hold and the first budget is feasible.
    assert all(type(value) is int for value in kwargs.values())
    assert 1 <= num_warmup <= num_microbatches
    assert 0 <= m0_bytes and num_warmup * m0_bytes <= m_max_bytes
    assert assigner.next_forward_budget() >= m0_bytes
