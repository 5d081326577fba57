"""Bad inputs to the public entry points of the runtime, the solvers and the plan and order types: one ValueError
naming the argument, never a silent default or a text form that does not read back."""

from __future__ import annotations

import dataclasses

import pytest

from bagualu2.budget import BudgetPhase
from bagualu2.costmodel import Plan, Strategy, presets
from bagualu2.runtime import DecisionPath, Stage, replay_iteration

MODEL, PARALLEL = presets.model("tiny-moe")
PARALLEL = dataclasses.replace(PARALLEL, dp=2, ep=2)  # imbalances up to 2
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
    DecisionPath.on(engine, planned_imbalance=1.0, window=4)  # options that are not the memo's grid
    for options in ({"need_step": 0.5}, {"downgrade": "paper"}):  # the gate decides what the pre-gate plans are
        with pytest.raises(ValueError, match="other grid options"):
            DecisionPath.on(engine, **options)
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
    with pytest.raises(ValueError, match="a sequence of rates"):
        replay_iteration(MODEL, PARALLEL, HW, (r for r in trace))


def test_plan_text_is_taken_wherever_a_plan_is_and_free_is_checked():
    from bagualu2.costmodel import build_graph, stage_memory
    from bagualu2.mitigation import greedy
    from bagualu2.mitigation.conflicts import check_conflicts
    from bagualu2.runtime import after_gate

    graph = build_graph(MODEL, PARALLEL, HW)
    budget = graph.unmitigated_bytes // 2
    by_text = greedy.solve(graph, budget, fixed="norm=OFFLOAD", free={"L1.dispatched"})
    assert by_text.plan == greedy.solve(graph, budget, fixed=Plan.from_str("norm=OFFLOAD"), free={"L1.dispatched"}).plan
    assert check_conflicts(graph, "norm=OFFLOAD") == []
    assert stage_memory(MODEL, PARALLEL, HW, plan="norm=OFFLOAD") == stage_memory(
        MODEL, PARALLEL, HW, plan=Plan.from_str("norm=OFFLOAD"))
    assert after_gate(graph, "norm=OFFLOAD", budget) == after_gate(graph, Plan.from_str("norm=OFFLOAD"), budget)
    for bad in (3, ["norm=OFFLOAD"]):
        with pytest.raises(ValueError, match="plan must be a Plan, its text form or None"):
            greedy.solve(graph, budget, fixed=bad)
    with pytest.raises(ValueError, match="free must be a collection of tensor names"):
        greedy.solve(graph, budget, free="L1.expert_fc1_out")
    with pytest.raises(ValueError, match="free names tensors the graph does not have: nope"):
        greedy.solve(graph, budget, free={"nope"})


@pytest.mark.parametrize("key", ["L0.qkv/x\r", "L0.qkv/x\xa0", 'L0.qkv/"x', "L0.qkv/x'", "L0.qkv/a b", "L0.qkv/x\x1e"])
def test_a_plan_key_every_text_form_could_not_read_back_is_refused(key):
    with pytest.raises(ValueError, match="plan key must be"):
        Plan(((key, Strategy.OFFLOAD),))


def test_an_order_reads_back_from_its_text():
    from bagualu2.fusion import Order

    empty = Order((), barriers=False)
    assert Order.from_str(repr(empty)) == empty and Order.from_str(str(empty)) == empty
    with pytest.raises(ValueError, match="integer index"):
        Order(((("F", 1.7),),))
    with pytest.raises(ValueError, match="solver must be a name"):
        Order(((("F", 0),),), solver="dp,v2")


def test_build_graph_names_an_argument_that_is_not_its_config():
    from bagualu2.costmodel import build_graph

    for args, message in (((None, PARALLEL, HW), "model must be a ModelConfig"),
                          ((MODEL, "pp=2", HW), "parallel must be a ParallelConfig"),
                          ((MODEL, PARALLEL, None), "hardware must be a Hardware profile")):
        with pytest.raises(ValueError, match=message):
            build_graph(*args)


def test_an_imbalance_above_the_expert_parallel_degree_is_refused():
    """The busiest of ``ep`` ranks holds at most every rank's routed copies: ``ep`` x the mean."""
    from bagualu2.costmodel import build_graph
    from bagualu2.exec import DeferredPlanner
    from bagualu2.runtime import ceil_bucket

    def fresh():
        return DecisionPath(MODEL, PARALLEL, HW, spike_step=0.3)  # 1.8 + 0.3 would pass ep = 2

    path = fresh()
    budget = path.graph(0, 1.0).unmitigated_bytes // 2
    # one bucket, capped at ep (fresh paths: a gate's measurement raises the next pre-gate plan's imbalance)
    assert path.forward(budget, 2.0, "steady", 0).plan == fresh().forward(budget, 1.95, "steady", 0).plan
    for call in (lambda: path.forward(budget, 2.01, "steady", 0), lambda: path.observe(0, 3.0),
                 lambda: path.pre_gate(budget, 0, planned=2.5), lambda: build_graph(MODEL, PARALLEL, HW, imbalance=4),
                 lambda: DecisionPath(MODEL, PARALLEL, HW, planned_imbalance=2.5)):
        with pytest.raises(ValueError, match=r"imbalance must be a finite number in \[1, 2\]"):
            call()
    planner = DeferredPlanner(MODEL, PARALLEL, HW, budget_bytes=budget, imbalance_step=0.3)
    mean = planner.graph().mean_routed_tokens
    router = next(op.layer for op in planner.graph().ops if op.kind == "router")
    planner.after_gate(Plan(), router, 2 * mean)  # every rank's copies on this one: bucket 2.1 capped at 2
    assert planner.decisions[-1][1] == 2.0
    with pytest.raises(ValueError, match=r"received_tokens must be at most min\(ep, num_experts / top_k\) x the mean"):
        planner.after_gate(Plan(), router, 2 * mean + 1)
    assert ceil_bucket(1.95, 0.3, 2.0) == 2.0 and ceil_bucket(1.95, 0.3) == 2.1 and ceil_bucket(2.5, 0.3, 2.0) == 2.5


def test_a_measured_imbalance_just_above_a_bucket_edge_never_rounds_below_it():
    """Within the float tolerance above a multiple of the step the bucket is the measured rate itself: the
    multiple's graph can hold one routed token fewer (round half to even), and a decision made on it kept more
    than its budget."""
    from bagualu2.costmodel import ModelConfig, ParallelConfig, build_graph
    from bagualu2.runtime import ceil_bucket

    rate = 1.02 + 1e-11
    assert ceil_bucket(rate, 0.02) >= rate and ceil_bucket(1.02, 0.02) == 1.02 and ceil_bucket(1.1, 0.05) == 1.1
    model = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, num_query_groups=1, head_dim=8,
                        ffn_hidden_size=32, moe_ffn_hidden_size=64, num_experts=4, top_k=3, vocab_size=64,
                        seq_length=25)
    parallel = ParallelConfig(dp=2, ep=2, num_microbatches=1)
    hw = presets.hardware("cpu")
    assert build_graph(model, parallel, hw, imbalance=1.02).routed_tokens(1.02) < build_graph(
        model, parallel, hw, imbalance=rate).routed_tokens(rate)  # 76.5 rounds to 76, a hair above it to 77
    path = DecisionPath(model, parallel, hw, engine=Stage(model, parallel, hw, m_max_bytes=18064))
    replay = replay_iteration(model, parallel, hw, [rate], path=path)
    assert replay.fits and all(d.kept_bytes <= d.budget_bytes for d in replay.decisions)


@pytest.mark.parametrize("field", ["need_step", "pregate_need_step"])
@pytest.mark.parametrize("step", [1e-17, 2.3e-16, 0.0, 1.5])
def test_a_need_grid_step_below_what_floating_point_resolves_is_refused(field, step):
    """1 + 1e-17 is 1.0: the grid's logarithm would divide by zero (or never end); the finest step is 1e-6."""
    with pytest.raises(ValueError, match=rf"{field} must be a finite number in \[1e-06, 1\]"):
        DecisionPath(MODEL, PARALLEL, HW, **{field: step})
    DecisionPath(MODEL, PARALLEL, HW, **{field: 1e-6})


def test_the_stage_engine_takes_a_plan_as_evaluate_takes_it():
    """A Plan, its text form or None (no mitigation), as ``evaluate`` does; anything else is one line."""
    from bagualu2.costmodel import evaluate

    engine = Stage(MODEL, PARALLEL, HW)
    graph = engine.graph(0, 1.0)
    text = "expert_act=RECOMPUTE"
    assert engine.cost(text, 1.0, 0) == engine.cost(Plan.from_str(text), 1.0, 0) == evaluate(graph, text)
    assert engine.cost(None, 1.0, 0) == engine.cost("none", 1.0, 0) == evaluate(graph, None)
    assert engine.point_order(text, 1.0, 0) == engine.point_order(Plan.from_str(text), 1.0, 0)
    assert engine.point_order(None, 1.0, 0, warmup=True) == engine.point_order(Plan(), 1.0, 0, warmup=True)
    with pytest.raises(ValueError, match="plan must be a Plan, its text form or None, got int"):
        engine.cost(3, 1.0, 0)


def test_expect_at_least_keeps_the_planned_imbalance_from_falling_below_the_expected_load():
    path = DecisionPath(MODEL, PARALLEL, HW)
    path.expect(1.5)
    path.observe(0, 1.0)
    assert path.planned(0) == 1.0  # the gates replace what was expected
    path.expect(1.5, at_least=True)  # the gates measured so far are kept, and only raise it from now on
    assert path.planned(0) == 1.5
    path.observe(0, 1.8)
    path.observe(0, 1.1)
    assert path.planned(0) == 1.5
    with pytest.raises(ValueError, match="at_least must be true or false"):
        path.expect(1.5, at_least=1)


def test_random_spikes_never_round_past_their_largest_imbalance():
    from bagualu2.runtime import spike_trace

    for seed in range(300):
        trace = spike_trace(64, spike_rate=1.0, max_imbalance=16 / 7, seed=seed)  # 2.2857: would round to 2.29
        assert max(trace) <= 16 / 7
