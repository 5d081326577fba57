"""The simulator planning with one hardware profile and timing with another (a trainer plans with its configured
profile; calibration times its runs on a profile fitted to the machine), and the flexible gate's mode."""

from __future__ import annotations

import dataclasses

import pytest

from bagualu2.costmodel import presets
from bagualu2.sim import simulate

MODEL, _TINY = presets.model("tiny-moe")
PARALLEL = dataclasses.replace(_TINY, dp=2, ep=2, num_microbatches=4)
PLAN = presets.hardware("cpu")
SLOW = dataclasses.replace(PLAN, kernel_launch_s=4e-4, copy_launch_s=1e-4, name="cpu-slow")
TRACE = ((1.0, 1.2, 1.1, 1.3), (1.9, 1.0, 1.05, 1.1), (1.2, 1.2, 1.0, 1.0))


def _cap() -> int:
    return max(simulate(MODEL, PARALLEL, PLAN, "static-under", (1.0,)).iterations[0].peak_bytes)


@pytest.mark.parametrize("policy", ["flexible", "static-over", "kwai", "adapipe", "static-under"])
def test_plans_come_from_the_planning_profile_and_times_from_the_timing_one(policy):
    cap = _cap()
    planned_here = simulate(MODEL, PARALLEL, PLAN, policy, TRACE, m_max_bytes=cap, restart_s=0.0)
    split = simulate(MODEL, PARALLEL, SLOW, policy, TRACE, m_max_bytes=cap, restart_s=0.0, plan_hardware=PLAN)
    # the same plans: the same bytes, iteration by iteration, and the same OOMs
    assert [it.peak_bytes for it in split.iterations] == [it.peak_bytes for it in planned_here.iterations]
    assert split.oom_events == planned_here.oom_events
    # timed on the slower profile
    assert all(a.time_s > b.time_s for a, b in zip(split.iterations, planned_here.iterations))
    same = simulate(MODEL, PARALLEL, SLOW, policy, TRACE, m_max_bytes=cap, restart_s=0.0, plan_hardware=SLOW)
    alone = simulate(MODEL, PARALLEL, SLOW, policy, TRACE, m_max_bytes=cap, restart_s=0.0)
    assert [it.time_s for it in same.iterations] == [it.time_s for it in alone.iterations]


def test_the_paper_gate_keeps_or_downgrades_and_bad_modes_say_so():
    cap = _cap()
    paper = simulate(MODEL, PARALLEL, PLAN, "flexible", TRACE, m_max_bytes=cap, downgrade="paper")
    graded = simulate(MODEL, PARALLEL, PLAN, "flexible", TRACE, m_max_bytes=cap)
    assert paper.oom_events == graded.oom_events == 0
    with pytest.raises(ValueError, match="downgrade must be one of graded, paper"):
        simulate(MODEL, PARALLEL, PLAN, "flexible", TRACE, downgrade="full")
    with pytest.raises(ValueError, match="plan_hardware must be a Hardware"):
        simulate(MODEL, PARALLEL, PLAN, "flexible", TRACE, plan_hardware="cpu")
    with pytest.raises(ValueError, match="hardware must be a Hardware, got str"):
        simulate(MODEL, PARALLEL, "cpu", "flexible", TRACE)
    with pytest.raises(ValueError, match="model must be a ModelConfig"):
        simulate("glm", PARALLEL, PLAN, "flexible", TRACE)
    with pytest.raises(ValueError, match="parallel must be a ParallelConfig"):
        simulate(MODEL, "x", PLAN, "flexible", TRACE)
    with pytest.raises(ValueError, match="progress must be a callable"):
        simulate(MODEL, PARALLEL, PLAN, "flexible", TRACE, progress=5)
    with pytest.raises(ValueError, match=r"plan_imbalance must be in \[1, 2\] \(one of ep=2"):
        simulate(MODEL, PARALLEL, PLAN, "flexible", TRACE, plan_imbalance=PARALLEL.ep + 1)
    with pytest.raises(ValueError, match="trace must be a sequence"):
        simulate(MODEL, PARALLEL, PLAN, "flexible", set(TRACE))


def test_an_iteration_must_fit_the_device_that_runs_it_whatever_the_plans_were_made_for():
    """Plans made for a larger device (h200's M_max) overrun the one that runs them (paper-gpu): an OOM, and the
    result's capacity is the device's; a planning profile without room is named in the error, not the device."""
    model, parallel = presets.model("glm-423b-a30b")
    device, larger = presets.hardware("paper-gpu"), presets.hardware("h200")
    result = simulate(model, parallel, device, "kwai", (2.6,), plan_hardware=larger, on_oom="fallback")
    alone = simulate(model, parallel, device, "kwai", (1.0,))
    assert result.oom_events == 1 and result.m_max_bytes == alone.m_max_bytes
    with pytest.raises(ValueError, match=r"^hardware 'cpu' leaves 0\.00 GiB .* stage 0 \(4\.0 GiB less"):
        simulate(*presets.model("glm-188b-a20b"), device, "flexible", (1.0,), plan_hardware=presets.hardware("cpu"))
