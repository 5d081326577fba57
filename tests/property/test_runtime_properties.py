"""Property tests of bagualu2.runtime: the decision path is safe for any imbalance sequence, wastes nothing when
the budget covers the micro-batch and nothing ran before the gate, reports exact bytes; the graded gate is never
worse than the full downgrade; warmup absorption keeps M0 for later warmup batches; ``downgrade="paper"`` is the
behaviour before it."""

from __future__ import annotations

import pytest
from functools import lru_cache

from hypothesis import given, settings
from conftest import scaled
from hypothesis import strategies as st

from bagualu2.budget import BudgetAssigner
from bagualu2.costmodel import Plan, build_graph, evaluate, presets
from bagualu2.mitigation import greedy
from bagualu2.runtime.buckets import ceil_bucket
from bagualu2.runtime import (DecisionPath, GateAction, after_gate, downgrade_plan, gate_free_tensors,
                              replay_iteration)

HW = presets.hardware("paper-gpu")
PRESETS = ("glm-188b-a20b", "glm-423b-a30b", "glm-1041b-a35b")
imbalances = st.floats(1.0, 3.0, allow_nan=False).map(lambda r: round(r, 3))


@lru_cache(maxsize=None)
def path(name: str, stage: int, downgrade: str = "graded") -> DecisionPath:
    """One warm path per preset and stage: decisions must be safe whatever the caches hold."""
    model, parallel = presets.model(name)
    return DecisionPath(model, parallel, HW, stage=stage, downgrade=downgrade)


@lru_cache(maxsize=None)
def graph_at(name: str, stage: int, chunk: int, imbalance: float):
    model, parallel = presets.model(name)
    return build_graph(model, parallel, HW, imbalance=imbalance, stage=stage, chunk=chunk)


@settings(max_examples=scaled(25))
@given(name=st.sampled_from(PRESETS), stage=st.integers(0, 3), downgrade=st.sampled_from(["graded", "paper"]),
       data=st.data())
def test_in_flight_never_exceeds_m_max_for_any_imbalance_sequence(name, stage, downgrade, data):
    model, parallel = presets.model(name)
    trace = data.draw(st.lists(imbalances, min_size=parallel.num_microbatches, max_size=parallel.num_microbatches))
    replay = replay_iteration(model, parallel, HW, trace, path=path(name, stage, downgrade))
    assert replay.peak_in_flight_bytes <= replay.m_max_bytes
    for decision in replay.decisions:
        assert decision.budget_bytes >= replay.m0_bytes
        assert decision.in_flight_bytes <= replay.m_max_bytes


@settings(max_examples=scaled(40))
@given(name=st.sampled_from(PRESETS), chunk=st.integers(0, 1), imbalance=imbalances,
       extra=st.integers(0, 1 << 34), phase=st.sampled_from(["warmup", "steady"]))
def test_a_covering_budget_gives_the_empty_plan_and_exact_bytes(name, chunk, imbalance, extra, phase):
    """Covering the unmitigated bytes at the measured imbalance, with nothing committed before the gate (the budget
    covers the planned imbalance too, or the pre-gate step left it to the gate), runs the empty plan; a plan that
    ran before the gate is kept or re-planned around, and fits."""
    model, parallel = presets.model(name)
    chunk = min(chunk, parallel.vp - 1)
    exact = graph_at(name, 0, chunk, imbalance)
    budget = exact.unmitigated_bytes + extra
    for planned in (1.0, 2.0, 3.0):  # a path expecting more than the gate measures has planned for it
        fresh = DecisionPath(model, parallel, HW, planned_imbalance=planned)
        committed = fresh.pre_gate(budget, chunk)
        decision = fresh.forward(budget, imbalance, phase, chunk)
        assert decision.kept_bytes == evaluate(exact, decision.plan).activation_bytes <= budget
        if planned <= imbalance or not committed.entries:
            assert len(decision.plan) == 0 and decision.kept_bytes == exact.unmitigated_bytes


@settings(max_examples=scaled(30))
@given(name=st.sampled_from(PRESETS), chunk=st.integers(0, 1), imbalance=imbalances,
       share=st.floats(0.0, 1.0), phase=st.sampled_from(["warmup", "steady"]))
def test_kept_bytes_are_exact_at_the_measured_imbalance_and_fit(name, chunk, imbalance, share, phase):
    model, parallel = presets.model(name)
    chunk = min(chunk, parallel.vp - 1)
    exact = graph_at(name, 0, chunk, imbalance)
    budget = exact.floor_bytes + int((exact.unmitigated_bytes - exact.floor_bytes) * share)
    decision = path(name, 0).forward(budget, imbalance, phase, chunk)
    assert decision.kept_bytes == evaluate(exact, decision.plan).activation_bytes
    assert decision.kept_bytes <= budget  # without a limit there is no absorption: it fits


@lru_cache(maxsize=None)
def fixed_path(name: str, downgrade: str, hidden_copies: bool) -> DecisionPath:
    model, parallel = presets.model(name)
    return DecisionPath(model, parallel, HW, downgrade=downgrade, planned_imbalance=1.0, hidden_copies=hidden_copies)


@settings(max_examples=scaled(40))
@given(name=st.sampled_from(PRESETS), chunk=st.integers(0, 1), imbalance=imbalances, share=st.floats(0.0, 1.0),
       downgrade=st.sampled_from(["graded", "paper"]), hidden_copies=st.booleans())
def test_the_gate_can_keep_a_pre_gate_plan_that_fits_at_the_measured_imbalance(name, chunk, imbalance, share,
                                                                               downgrade, hidden_copies):
    """Keeping the plan in force is an option whenever it fits the budget at the measured imbalance, whatever the
    need level rounds the budget to: the gate keeps it or takes something no costlier (by overhead, with copies
    priced in full; the paper's gate keeps it), and keeps it only when it fits (steady phase: no absorption)."""
    model, parallel = presets.model(name)
    chunk = min(chunk, parallel.vp - 1)
    exact = graph_at(name, 0, chunk, imbalance)
    balanced = graph_at(name, 0, chunk, 1.0)
    budget = exact.floor_bytes + int(share * (balanced.unmitigated_bytes - exact.floor_bytes))
    runtime = fixed_path(name, downgrade, hidden_copies)
    decision = runtime.forward(budget, imbalance, "steady", chunk)
    if budget >= exact.unmitigated_bytes:
        return
    pre = runtime.pre_gate(budget, chunk)
    fits = evaluate(exact, pre).activation_bytes <= budget
    if decision.action is GateAction.KEEP:
        assert fits and decision.plan == pre
    elif fits and downgrade == "paper":
        pytest.fail("the paper's gate keeps a plan that fits")
    elif fits and not hidden_copies:
        step = runtime.step if imbalance <= runtime.spike_threshold else runtime.spike_step
        bucket = runtime.graph(chunk, ceil_bucket(imbalance, step))
        assert decision.overhead_s <= evaluate(bucket, pre).overhead_s + 1e-12
    assert decision.kept_bytes <= budget


@settings(max_examples=scaled(30))
@given(name=st.sampled_from(PRESETS), planned=imbalances, measured=imbalances, pre_share=st.floats(0.0, 1.0),
       share=st.floats(0.0, 1.0))
def test_graded_gate_never_costs_more_than_the_full_downgrade_and_fits_when_it_does(name, planned, measured,
                                                                                    pre_share, share):
    before = graph_at(name, 0, 0, planned)
    pre_budget = before.floor_bytes + int((before.unmitigated_bytes - before.floor_bytes) * pre_share)
    pre = greedy.solve(before, pre_budget).plan
    after = graph_at(name, 0, 0, measured)
    budget = after.floor_bytes + int((after.unmitigated_bytes - after.floor_bytes) * share)
    decision = after_gate(after, pre, budget)
    full = evaluate(after, downgrade_plan(after, pre))
    assert decision.cost == evaluate(after, decision.plan)  # one evaluator
    if full.activation_bytes <= budget:
        assert decision.cost.activation_bytes <= budget
        assert decision.cost.overhead_ns <= full.overhead_ns
    # what the gate can no longer change stays as it was
    free = gate_free_tensors(after)
    changed = {key for key, _ in set(decision.plan.entries) ^ set(pre.entries)}
    assert all("/" in key and key.partition("/")[2] in free for key in changed)


@settings(max_examples=scaled(40))
@given(name=st.sampled_from(PRESETS), planned=imbalances, measured=imbalances, pre_share=st.floats(0.0, 1.0),
       share=st.floats(0.0, 1.2))
def test_paper_downgrade_is_the_behaviour_before_graded_replanning(name, planned, measured, pre_share, share):
    """Before: keep the plan in force if it fits the budget at the measured imbalance, else recompute every
    tensor the MoE modules make after their routers (kept as it is where it recomputes them all already)."""
    before = graph_at(name, 0, 0, planned)
    pre = greedy.solve(before, before.floor_bytes
                       + int((before.unmitigated_bytes - before.floor_bytes) * pre_share)).plan
    after = graph_at(name, 0, 0, measured)
    budget = int(after.unmitigated_bytes * share)
    decision = after_gate(after, pre, budget, downgrade="paper", limit_bytes=2 * budget + 1)
    full = downgrade_plan(after, pre)
    if evaluate(after, pre).activation_bytes <= budget or full == pre:
        assert decision.action is GateAction.KEEP and decision.plan == pre
    else:
        assert decision.action is GateAction.DOWNGRADE and decision.plan == full


@given(m0=st.integers(1, 10**6), warmup=st.integers(1, 12), extra=st.integers(0, 10**8), data=st.data())
def test_warmup_absorption_never_leaves_a_later_warmup_budget_below_m0(m0, warmup, extra, data):
    assigner = BudgetAssigner(m_max_bytes=warmup * m0 + extra, m0_bytes=m0, num_microbatches=warmup + 2,
                              num_warmup=warmup)
    for mb in range(warmup):
        budget = assigner.next_forward_budget()
        assert budget >= m0
        limit = assigner.absorb_limit_bytes()
        assert limit >= budget
        kept = data.draw(st.integers(m0, limit), label=f"kept[{mb}]")  # an absorbed overrun up to the limit
        assigner.record_forward(mb, kept)
        assert assigner.in_flight_bytes <= assigner.m_max_bytes
    assert assigner.absorb_limit_bytes() == assigner.next_forward_budget()  # steady: no absorption


@pytest.mark.slow
@settings(max_examples=scaled(20))
@given(name=st.sampled_from(PRESETS), stage=st.integers(0, 3), data=st.data())
def test_replay_absorbs_only_in_warmup_and_every_budget_stays_above_m0(name, stage, data):
    model, parallel = presets.model(name)
    trace = data.draw(st.lists(imbalances, min_size=parallel.num_microbatches, max_size=parallel.num_microbatches))
    replay = replay_iteration(model, parallel, HW, trace, path=path(name, stage))
    for decision in replay.decisions:
        assert decision.budget_bytes >= replay.m0_bytes
        if decision.kept_bytes > decision.budget_bytes:
            assert decision.action == "absorb" and decision.phase == "warmup"


@settings(max_examples=scaled(20))
@given(m=st.integers(1, 8), data=st.data())
def test_paired_layout_keeps_two_in_flight_under_m_max_and_interleaves_its_points(m, data):
    """pp=1, ``paired`` (combined 1F1B): the budgets count two micro-batches in flight and never let them exceed
    M_max; a steady point F_(y+1) B_y is ordered by the DP (no slower than F then B), not sequentially."""
    from bagualu2.costmodel import ParallelConfig
    from bagualu2.runtime import Stage

    model, _ = presets.model("tiny-moe")
    parallel = ParallelConfig(dp=2, ep=2, num_microbatches=m, paired=True)
    hardware = presets.hardware("cpu")
    trace = data.draw(st.lists(st.floats(1.0, 2.0).map(lambda r: round(r, 3)), min_size=m, max_size=m))
    replay = replay_iteration(model, parallel, hardware, trace)
    assert replay.peak_in_flight_bytes <= replay.m_max_bytes
    assert [d.phase for d in replay.decisions][:2] == ["warmup"] * min(2, m)
    paired, alone = (Stage(model, p, hardware, stage=0) for p in (parallel, parallel.replace(paired=False)))
    order = paired.point_order(Plan(), 1.0, 0)
    if m == 1:  # no steady point: each pass runs alone, as without pairing
        assert paired.alone and order.makespan_ns == alone.point_order(Plan(), 1.0, 0).makespan_ns
        return
    assert order.solver == "dp" and any(len(group) > 1 for group in order.groups)
    assert order.makespan_ns <= alone.point_order(Plan(), 1.0, 0).makespan_ns
