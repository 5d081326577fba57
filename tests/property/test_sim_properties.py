"""Property tests of bagualu2.sim for any short imbalance trace: flexible never overruns a stage, static-under pays
exactly one restart per OOM and never more than one (static-over stays in force), ideal is never slower than
flexible or oracle, and the summary is the sum of its iterations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from conftest import scaled
from hypothesis import strategies as st

from bagualu2.costmodel import presets
from bagualu2.sim import paper_trace, simulate

MODEL, PARALLEL = presets.model("glm-188b-a20b")
HW = presets.hardware("paper-gpu")
rates = st.floats(1.0, 2.6, allow_nan=False).map(lambda r: round(r, 1))
traces = st.lists(rates, min_size=1, max_size=4).map(tuple)


@pytest.mark.slow
@settings(max_examples=scaled(8), deadline=None)
@given(traces)
def test_flexible_fits_and_ideal_bounds_it(trace):
    flexible = simulate(MODEL, PARALLEL, HW, "flexible", trace)
    ideal = simulate(MODEL, PARALLEL, HW, "ideal", trace)
    assert flexible.oom_events == flexible.restarts == 0
    for fast, it in zip(ideal.iterations, flexible.iterations):
        assert all(peak <= cap for peak, cap in zip(it.peak_bytes, flexible.m_max_bytes))
        assert fast.time_s <= it.time_s * (1 + 1e-9)
    assert flexible.total_time_s == sum(it.time_s for it in flexible.iterations)


@pytest.mark.slow
@settings(max_examples=scaled(8), deadline=None)
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


ordinary = st.floats(1.0, 1.2, allow_nan=False).map(lambda r: round(r, 2))


@pytest.mark.slow
@settings(max_examples=scaled(6), deadline=None)
@given(st.lists(ordinary, min_size=1, max_size=4).map(tuple))
def test_without_spikes_flexible_is_between_the_static_plans(trace):
    """No spikes: flexible is never slower than static-over (iteration by iteration) and never below static-under
    (which may crash on an ordinary rate above the balanced load it was planned for)."""
    flexible, over, under = (simulate(MODEL, PARALLEL, HW, p, trace) for p in ("flexible", "static-over",
                                                                               "static-under"))
    assert flexible.oom_events == 0
    assert all(f.time_s <= o.time_s * (1 + 1e-9) for f, o in zip(flexible.iterations, over.iterations))
    assert flexible.mean_mfu >= under.mean_mfu


@pytest.mark.slow
@settings(max_examples=scaled(6), deadline=None)
@given(traces)
def test_ideal_oracle_flexible_mfu_order(trace):
    ideal, oracle, flexible = (simulate(MODEL, PARALLEL, HW, p, trace).mean_mfu for p in ("ideal", "oracle",
                                                                                          "flexible"))
    assert ideal * (1 + 1e-9) >= oracle and oracle * (1 + 1e-9) >= flexible


@pytest.mark.slow
@settings(max_examples=scaled(6), deadline=None)
@given(traces)
def test_the_dual_batch_overlap_never_slows_flexible_down(trace):
    """Ablation L3 (flexible's decisions priced by Algorithm 2 alone, on Megatron-Core's execution) vs L4
    (flexible): L4 never slower; and L3, which counts on no copy being hidden, never slower on its execution than
    all serial."""
    l3, l4, serial = (simulate(MODEL, PARALLEL, HW, level, trace, overlap=overlap)
                      for level, overlap in (("L3", "real"), ("L4", "real"), ("L3", "none")))
    for unfused, fused, alone in zip(l3.iterations, l4.iterations, serial.iterations):
        assert fused.time_s <= unfused.time_s * (1 + 1e-9) and unfused.time_s <= alone.time_s * (1 + 1e-9)


@pytest.mark.slow
@settings(max_examples=scaled(6), deadline=None)
@given(traces, st.sampled_from(["kwai", "adapipe", "L1", "L2"]))
def test_replan_restarts_only_above_the_planned_imbalance_and_returns_to_the_normal_plans(trace, policy):
    """on_oom="replan": a crash happens only on a rate above the one the normal plans were made for; the restart
    runs that iteration with the policy re-planned for its rate (or static-over if that still overruns), and the
    next iteration is back on the normal plans."""
    result = simulate(MODEL, PARALLEL, HW, policy, trace, on_oom="replan")
    assert result.restarts == result.oom_events
    for rate, it in zip(trace, result.iterations):
        if it.restarted:
            assert rate > 1.0 and it.policy in (policy, "static-over")
        else:  # on the normal plans, whatever came before
            assert it == simulate(MODEL, PARALLEL, HW, policy, (rate,)).iterations[0]


grid = st.integers(100, 300).map(lambda cents: cents / 100)  # rates on the paper trace's 0.01 grid


@settings(max_examples=scaled(40), deadline=None)
@given(st.integers(1, 200), st.integers(0, 2 ** 32), st.floats(0.0, 1.0), grid, st.integers(0, 50),
       st.integers(1, 160), st.one_of(st.none(), st.integers(1, 16)))
def test_paper_trace_draws_its_statistics(n, seed, share, low, spread, above, microbatches):
    high, top = round(low + spread / 100, 2), round(low + (spread + above) / 100, 2)
    trace = paper_trace(n, seed=seed, spike_share=share, base_low=low, base_high=high, spike_max=top,
                        num_microbatches=microbatches)
    assert len(trace) == n and trace == paper_trace(n, seed=seed, spike_share=share, base_low=low,
                                                    base_high=high, spike_max=top, num_microbatches=microbatches)
    spikes = [entry for entry in trace if (max(entry) if isinstance(entry, tuple) else entry) > high]
    assert len(spikes) == round(share * n)
    for entry in trace:
        rates_ = entry if isinstance(entry, tuple) else (entry,)
        assert len(rates_) == (microbatches if isinstance(entry, tuple) else 1)
        assert all(round(r, 2) == r and low <= r <= top for r in rates_)
        assert sum(r > high for r in rates_) == (max(rates_) > high)  # a spike hits one micro-batch


def test_off_grid_bounds_are_refused():
    for field, bounds in (("base_low", (1.005, 1.2, 2.6)), ("base_high", (1.0, 1.205, 2.6)),
                          ("spike_max", (1.0, 1.2, 2.605))):
        with pytest.raises(ValueError, match=f"{field} must be a multiple of 0.01"):
            paper_trace(5, base_low=bounds[0], base_high=bounds[1], spike_max=bounds[2])
