"""Property tests of bagualu2.sim for any short imbalance trace: flexible never overruns a stage, static-under pays
exactly one restart per OOM and never more than one (static-over stays in force), ideal is never slower than
flexible or oracle, and the summary is the sum of its iterations."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from bagualu2.costmodel import presets
from bagualu2.sim import simulate

MODEL, PARALLEL = presets.model("glm-188b-a20b")
HW = presets.hardware("paper-gpu")
rates = st.floats(1.0, 2.6, allow_nan=False).map(lambda r: round(r, 1))
traces = st.lists(rates, min_size=1, max_size=4).map(tuple)


@settings(max_examples=8, deadline=None)
@given(traces)
def test_flexible_fits_and_ideal_bounds_it(trace):
    flexible = simulate(MODEL, PARALLEL, HW, "flexible", trace)
    ideal = simulate(MODEL, PARALLEL, HW, "ideal", trace)
    assert flexible.oom_events == flexible.restarts == 0
    for fast, it in zip(ideal.iterations, flexible.iterations):
        assert all(peak <= cap for peak, cap in zip(it.peak_bytes, flexible.m_max_bytes))
        assert fast.time_s <= it.time_s * (1 + 1e-9)
    assert flexible.total_time_s == sum(it.time_s for it in flexible.iterations)


@settings(max_examples=8, deadline=None)
@given(traces, st.floats(0.0, 1000.0))
def test_static_under_restarts_once_per_oom(trace, restart_s):
    under = simulate(MODEL, PARALLEL, HW, "static-under", trace, restart_s=restart_s)
    assert under.restarts == under.oom_events <= 1
    assert under.time_lost_s >= restart_s * under.restarts
    switched = [i for i, it in enumerate(under.iterations) if it.restarted]
    if switched:
        assert all(it.policy == "static-over" for it in under.iterations[switched[0]:])
    else:
        assert all(it.policy == "static-under" for it in under.iterations)
