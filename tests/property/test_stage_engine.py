"""The stage engine and its iteration driver:

* cached = uncached: every decision of the runtime (replayed iterations of the decision path, the gates of
  ``exec``'s deferred planner, the simulator's policies) is the same with the stage's memo on and with
  ``Stage(cache=False)``, over random presets, stages, memory pressure and traces;
* the memo is bounded, and a memo that is off stores nothing;
* ``run_iteration`` and a step-by-step ``Iteration`` are one driver: same budgets, same peak, and a decision that
  fits its budget never takes the stage above ``M_max`` (Algorithm 1's invariant).
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from conftest import scaled
from hypothesis import strategies as st

from bagualu2.costmodel import Plan, presets
from bagualu2.exec import DeferredPlanner
from bagualu2.runtime import DecisionPath, Iteration, Stage, replay_iteration, run_iteration, spike_trace
from bagualu2.sim import StageContext, make_policy
from bagualu2.sim.simulate import stage_time

PRESETS = ("glm-188b-a20b", "glm-319b-a30b", "glm-423b-a30b", "glm-1041b-a35b")


def _setup(name: str, num_microbatches: int, hbm_scale: float):
    model, parallel = presets.model(name)
    parallel = dataclasses.replace(parallel, num_microbatches=max(num_microbatches, parallel.pp))
    base = presets.hardware("paper-gpu")
    hardware = dataclasses.replace(base, hbm_bytes=int(base.hbm_bytes * hbm_scale), reserved_bytes=0)
    return model, parallel, hardware


def _replays(model, parallel, hardware, stage, downgrade, traces, cache: bool):
    path = DecisionPath.on(Stage(model, parallel, hardware, stage=stage, cache=cache), downgrade=downgrade)
    out = []
    for trace in traces:
        replay = replay_iteration(model, parallel, hardware, trace, path=path)
        out.append((replay.peak_in_flight_bytes, [dataclasses.astuple(d) for d in replay.decisions]))
    return out


@settings(max_examples=scaled(12), deadline=None)
@given(name=st.sampled_from(PRESETS), stage=st.integers(0, 7), downgrade=st.sampled_from(["graded", "paper"]),
       hbm_scale=st.floats(0.55, 1.0), num_microbatches=st.integers(8, 24), seed=st.integers(0, 10_000),
       spike_rate=st.sampled_from([0.03, 0.3]))
def test_decisions_are_the_same_with_the_memo_on_and_off(name, stage, downgrade, hbm_scale, num_microbatches,
                                                         seed, spike_rate):
    model, parallel, hardware = _setup(name, num_microbatches, hbm_scale)
    stage %= parallel.pp
    try:
        Stage(model, parallel, hardware, stage=stage)
    except ValueError:  # the static memory leaves no room for activations at this scale
        return
    traces = [spike_trace(parallel.num_microbatches, spike_rate=spike_rate, base_imbalance=1.1, base_jitter=0.1,
                          seed=seed + i) for i in range(3)]
    cached = _replays(model, parallel, hardware, stage, downgrade, traces, cache=True)
    assert cached == _replays(model, parallel, hardware, stage, downgrade, traces, cache=False)


@pytest.mark.parametrize("name", PRESETS[:2])
def test_remembered_decisions_follow_the_gate_decisions_made_since(name):
    """Forwards at need level L, at L-1 (the first's gate decision stands in), at L-4 (a new gate decision of the
    same family) and at L-1 again, for every L of a range: each remembered decision is what deciding again gives
    (the memo on = off, request by request)."""
    model, parallel = presets.model(name)
    hardware = presets.hardware("paper-gpu")
    engines = [Stage(model, parallel, hardware, cache=cache) for cache in (True, False)]
    needs, graph = DecisionPath.on(engines[0]).needs, engines[0].graph(0, 1.6)
    for level in range(80, 125):
        paths = [DecisionPath.on(engine, planned_imbalance=1.0) for engine in engines]
        for at in (level, level - 1, level - 4, level - 1):
            budget = max(graph.unmitigated_bytes - int(needs.quantum * needs.ratio ** at), 0)
            on, off = (path.forward(budget, 1.6, "steady", 0) for path in paths)
            assert on == off, (level, at)


GATE_MODEL = presets.model("tiny-moe")[0].replace(num_layers=4, num_dense_layers=0, seq_length=32)
GATE_PARALLEL = dataclasses.replace(presets.model("tiny-moe")[1], dp=8, ep=8)  # gates measure up to 8 / 2 = 4
GATE_HW = presets.hardware("cpu")


@settings(max_examples=scaled(25), deadline=None)
@given(mode=st.sampled_from(["graded", "paper"]), fraction=st.floats(0.2, 1.2),
       requests=st.lists(st.tuples(st.sampled_from(["none", "expert_fc1=RECOMPUTE", "expert_act=OFFLOAD",
                                                     "core_attn=RECOMPUTE,expert_fc1=QUANTIZE"]),
                                   st.integers(0, 1), st.integers(0, 512)), min_size=1, max_size=8))  # <= E / K x T x K
def test_gate_decisions_are_the_same_with_the_memo_on_and_off(mode, fraction, requests):
    planners = []
    for cache in (True, False):
        engine = Stage(GATE_MODEL, GATE_PARALLEL, GATE_HW, cache=cache)
        budget = int(engine.graph(0, 1.0).unmitigated_bytes * fraction)
        planners.append(DeferredPlanner(GATE_MODEL, GATE_PARALLEL, GATE_HW, budget_bytes=budget, downgrade=mode,
                                        engine=engine))
    routers = sorted({op.layer for op in planners[0].graph().ops if op.kind == "router"})
    for plan, which, tokens in requests:
        layer = routers[which % len(routers)]
        decided = [p.after_gate(Plan.from_str(plan), layer, tokens) for p in planners]
        assert decided[0] == decided[1]
    assert list(planners[0].decisions) == list(planners[1].decisions)


@settings(max_examples=scaled(8), deadline=None)
@given(name=st.sampled_from(PRESETS[:2]), policy=st.sampled_from(["flexible", "oracle", "kwai", "adapipe", "L3"]),
       hbm_scale=st.floats(0.6, 1.0), seed=st.integers(0, 1000))
def test_simulated_stages_are_the_same_with_the_memo_on_and_off(name, policy, hbm_scale, seed):
    model, parallel, hardware = _setup(name, 12, hbm_scale)
    try:
        on = StageContext(model, parallel, hardware, 0)
    except ValueError:
        return
    off = StageContext(model, parallel, hardware, 0, cache=False)
    trace = spike_trace(parallel.num_microbatches, spike_rate=0.2, base_imbalance=1.1, base_jitter=0.1, seed=seed)
    assert stage_time(make_policy(policy, on), trace) == stage_time(make_policy(policy, off), trace)


def test_the_memo_is_bounded_and_a_memo_that_is_off_stores_nothing():
    model, parallel = presets.model("glm-188b-a20b")
    hardware = presets.hardware("paper-gpu")
    engine = Stage(model, parallel, hardware, max_entries=3)
    plans = [Plan.from_str(text) for text in ("none", "expert_act=RECOMPUTE", "core_attn=OFFLOAD",
                                             "expert_fc1=QUANTIZE", "qkv=RECOMPUTE")]
    for plan in plans:
        assert engine.cost(plan, 1.0, 0) is engine.cost(plan, 1.0, 0)  # a hit right after
        assert max(engine.memo.sizes().values()) <= 3
    off = Stage(model, parallel, hardware, cache=False)
    assert off.cost(plans[1], 1.0, 0) == engine.cost(plans[1], 1.0, 0)
    assert sum(off.memo.sizes().values()) == 0
    with pytest.raises(ValueError, match="max_entries"):
        Stage(model, parallel, hardware, max_entries=0)
    with pytest.raises(ValueError, match="chunk"):
        engine.check_chunk(parallel.vp)


@settings(max_examples=scaled(6), deadline=None)
@given(name=st.sampled_from(PRESETS[:3]), stage=st.integers(0, 7), seed=st.integers(0, 10_000))
def test_graphs_are_bounded_and_a_dropped_graph_decides_as_the_kept_one(name, stage, seed):
    """Continuous rates (a trainer's measured trace) meet a new graph each; an engine keeps the balanced graphs and
    at most ``max_graphs`` others, and decides the same as one that keeps them all."""
    model, parallel, hardware = _setup(name, 8, 0.8)
    stage %= parallel.pp
    try:
        small = Stage(model, parallel, hardware, stage=stage, max_graphs=2)
    except ValueError:
        return
    large = Stage(model, parallel, hardware, stage=stage, max_graphs=10_000)
    traces = [spike_trace(parallel.num_microbatches, spike_rate=0.3, base_imbalance=1.1, base_jitter=0.1,
                          seed=seed + i) for i in range(3)]
    decided = []
    for engine in (small, large):
        path = DecisionPath.on(engine)
        decided.append([[dataclasses.astuple(d) for d in replay_iteration(model, parallel, hardware, t,
                                                                          path=path).decisions] for t in traces])
    assert decided[0] == decided[1]
    assert len(small._graphs) <= parallel.vp + 2 < len(large._graphs)  # the small engine dropped graphs
    with pytest.raises(ValueError, match="max_graphs"):
        Stage(model, parallel, hardware, max_graphs=0)


class _Kept:
    def __init__(self, kept_bytes):
        self.kept_bytes = kept_bytes


@settings(max_examples=scaled(30), deadline=None)
@given(name=st.sampled_from(PRESETS), stage=st.integers(0, 7), fill=st.floats(0.0, 1.0),
       seed=st.integers(0, 1000))
def test_the_driver_keeps_algorithm_1s_invariant_and_the_stepwise_driver_agrees(name, stage, fill, seed):
    model, parallel = presets.model(name)
    engine = Stage(model, parallel, presets.hardware("paper-gpu"), stage=stage % parallel.pp)
    imbalances = spike_trace(parallel.num_microbatches, seed=seed)

    def decide(step, imbalance, budget, limit):  # keeps a share of its budget, never below M0 when it can
        return _Kept(max(int(budget * fill), min(budget, engine.memory.m0_bytes)))

    run = run_iteration(engine, decide, imbalances)
    assert run.fits and run.peak_bytes == max(f.held_bytes for f in run.forwards)
    assert [f.step for f in run.forwards] == [s for s in engine.steps if s.forward]
    stepwise = Iteration(engine)
    budgets = []
    for step in engine.steps:
        if step.forward:
            budget, _ = stepwise.budget(step.phase)
            budgets.append(budget)
            stepwise.record_forward(step.index, decide(step, imbalances[step.microbatch], budget, None).kept_bytes)
        else:
            stepwise.record_backward(step.index)
    assert budgets == [f.budget_bytes for f in run.forwards] and stepwise.peak_bytes == run.peak_bytes
    assert stepwise.held_bytes == 0
    with pytest.raises(ValueError, match="num_microbatches"):
        run_iteration(engine, decide, imbalances[:-1])
