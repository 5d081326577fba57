"""The per-iteration decision path: budgets, cached plans and deferred downgrades keep a stage within M_max."""

import json

import pytest
from typer.testing import CliRunner

from bagualu2.cli import app
from bagualu2.costmodel import presets
from bagualu2.runtime import replay_iteration, spike_trace


@pytest.mark.parametrize("name", ["glm-1041b-a35b", "glm-423b-a30b", "glm-188b-a20b"])
def test_replay_with_spikes_fits_and_downgrades_spikes(name):
    model, parallel = presets.model(name)
    hw = presets.hardware("paper-gpu")
    trace = list(spike_trace(parallel.num_microbatches, spike_rate=0.03, seed=1))
    trace[1] = trace[-1] = 2.6  # one spike in warmup, one in the steady phase
    replay = replay_iteration(model, parallel, hw, trace)
    assert replay.fits and replay.peak_in_flight_bytes <= replay.m_max_bytes
    assert len(replay.decisions) == parallel.num_microbatches * parallel.vp
    for decision in replay.decisions:  # only warmup absorbs an overrun (paper §V-A)
        assert decision.kept_bytes <= decision.budget_bytes or (decision.action == "absorb"
                                                                and decision.phase == "warmup")
        assert decision.budget_bytes >= replay.m0_bytes
    spiked = [d for d in replay.decisions if d.imbalance == 2.6]
    assert spiked and all(d.downgraded or d.kept_bytes <= d.budget_bytes or d.action == "absorb" for d in spiked)
    assert replay.cache_hits > replay.cache_misses


def test_spike_trace_validates_and_is_seeded():
    assert spike_trace(100, seed=4) == spike_trace(100, seed=4)
    trace = spike_trace(10_000, spike_rate=0.029, seed=0)
    assert 0.02 < sum(r > 1.1 for r in trace) / len(trace) < 0.04 and max(trace) <= 2.6
    with pytest.raises(ValueError, match="spike_rate"):
        spike_trace(10, spike_rate=1.5)
    with pytest.raises(ValueError, match="imbalance"):
        spike_trace(10, max_imbalance=0.5)


@pytest.mark.launch
@pytest.mark.filterwarnings("ignore:pipeline degree 2")  # tiny-moe has pp=2: sequential fallback, by design
def test_demo_command():
    runner = CliRunner()
    result = runner.invoke(app, ["demo", "--model", "tiny-moe", "--hardware", "cpu", "--train-steps", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["fits"] and len(data["forwards"]) == 4
    assert data["training"]["steps"] == 2 and data["training"]["max_prediction_error"] == 0.0
    bad = runner.invoke(app, ["demo", "--spike-rate", "2"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_decision_path_caches_and_keeps_decisions_safe():
    from bagualu2.costmodel import build_graph, evaluate
    from bagualu2.runtime import DecisionPath

    model, parallel = presets.model("glm-1041b-a35b")
    hw = presets.hardware("paper-gpu")
    path = DecisionPath(model, parallel, hw, planned_imbalance=1.2, imbalance_step=0.1)
    graph = build_graph(model, parallel, hw, imbalance=1.3)
    budget = (graph.floor_bytes + graph.unmitigated_bytes) // 2
    first = path.forward(budget, 1.25, "steady", 0)
    again = path.forward(budget + 1024, 1.21, "steady", 0)  # same buckets
    assert again.plan == first.plan and again.order is first.order and (path.hits, path.misses) == (1, 1)
    # the decision made for the bucket's upper imbalance fits the real one
    assert evaluate(build_graph(model, parallel, hw, imbalance=1.21), first.plan).activation_bytes <= budget
    assert first.kept_bytes <= budget and first.order.makespan_ns > 0
    # every budget above what the micro-batch keeps unmitigated shares one decision
    big = path.forward(10 * graph.unmitigated_bytes, 1.25, "steady", 0)
    assert path.forward(20 * graph.unmitigated_bytes, 1.25, "steady", 0) == big and len(big.plan) == 0


def test_decision_path_never_shares_a_bucket_below_the_floor():
    from bagualu2.costmodel import build_graph
    from bagualu2.runtime import DecisionPath

    model, parallel = presets.model("glm-188b-a20b")
    hw = presets.hardware("paper-gpu")
    floor = build_graph(model, parallel, hw, imbalance=1.1).floor_bytes
    quantum = 2 * floor  # the first bucket [0, 2*M0) straddles the floor
    path = DecisionPath(model, parallel, hw, budget_quantum_bytes=quantum)
    generous = path.forward(quantum - 1, 1.05, "steady", 0)
    tight = path.forward(floor, 1.05, "steady", 0)
    assert tight is not generous and tight.kept_bytes <= floor and generous.kept_bytes <= quantum - 1


@pytest.mark.parametrize("args, option", [(["demo", "--max-imbalance", "0.5"], "--max-imbalance"),
                                          (["demo", "-m", "glm-188b-a20b", "-H", "cpu"], "--hardware"),
                                          (["plan", "-m", "tiny-moe", "-H", "cpu", "-b", "1e300"], "--budget-gib"),
                                          (["schedule", "-m", "tiny-moe", "-H", "cpu", "-b", "1e300"],
                                           "--budget-gib")])
def test_cli_bad_inputs_name_the_option(args, option):
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert option in result.output and "Traceback" not in result.output


def test_memoised_decisions_equal_fresh_ones():
    """Decisions share orders (by the chains the DP reads), costs and rows (by measured imbalance): each one
    still carries what evaluating and ordering its plan from scratch gives."""
    from bagualu2.costmodel import build_graph, evaluate
    from bagualu2.fusion import build_chains, dp
    from bagualu2.runtime import DecisionPath

    model, parallel = presets.model("glm-1041b-a35b")
    hw = presets.hardware("paper-gpu")
    path = DecisionPath(model, parallel, hw)
    for chunk in (0, 1):
        for imbalance in (1.1, 2.6):  # bucket values themselves: the decision's graph is this one
            graph = build_graph(model, parallel, hw, imbalance=imbalance, chunk=chunk)
            for step in range(0, 9):
                budget = graph.floor_bytes + (graph.unmitigated_bytes - graph.floor_bytes) * step // 6
                decision = path.forward(budget, imbalance, "steady", chunk)
                assert decision.kept_bytes == evaluate(graph, decision.plan).activation_bytes
                assert decision.downgraded or decision.kept_bytes <= budget
                chains = build_chains(graph, decision.plan, graph, decision.plan, hardware=hw)
                assert decision.order == dp.solve(chains, pipeline_degree=parallel.pp)


def test_stage_plan_phases_are_the_assigners():
    """The phase of each forward is a constant of the stage's schedule, hoisted out of the replay loop: it is the
    phase Algorithm 1's assigner is in at that forward."""
    from bagualu2.budget import BudgetAssigner, BudgetPhase
    from bagualu2.runtime import DecisionPath

    model, parallel = presets.model("glm-188b-a20b")
    memory, steps = DecisionPath(model, parallel, presets.hardware("paper-gpu"), stage=1).stage_plan()
    assigner = BudgetAssigner(m_max_bytes=memory.m_max_bytes, m0_bytes=memory.m0_bytes,
                              num_microbatches=len(steps) // 2, num_warmup=memory.inflight_chunks)
    for is_forward, index, _, _, phase in steps:
        if is_forward:
            assert phase == assigner.phase.value
            assigner.record_forward(index, memory.m0_bytes)
        else:
            assert phase == ""
            assigner.record_backward(index)
    assert assigner.phase is BudgetPhase.DONE and {s[4] for s in steps} == {"", "warmup", "steady"}


def test_pre_gate_plans_are_never_stand_ins():
    """What runs before the gate cannot be undone: a smaller need never gets the plan of a larger one."""
    from bagualu2.costmodel import build_graph, evaluate
    from bagualu2.runtime import DecisionPath

    model, parallel = presets.model("glm-423b-a30b")
    hw = presets.hardware("paper-gpu")
    balanced = build_graph(model, parallel, hw, imbalance=1.0)
    small = balanced.unmitigated_bytes - (balanced.unmitigated_bytes - balanced.floor_bytes) // 40
    large = balanced.unmitigated_bytes - (balanced.unmitigated_bytes - balanced.floor_bytes) // 10
    warm = DecisionPath(model, parallel, hw, planned_imbalance=1.0)
    warm.forward(large, 1.0, "steady", 0)
    fresh = DecisionPath(model, parallel, hw, planned_imbalance=1.0)
    assert warm.forward(small, 1.0, "steady", 0).plan == fresh.forward(small, 1.0, "steady", 0).plan
    assert evaluate(balanced, fresh.forward(small, 1.0, "steady", 0).plan).activation_bytes <= small


def test_a_rejected_imbalance_does_not_enter_the_planned_estimate():
    from bagualu2.runtime import DecisionPath

    model, parallel = presets.model("glm-188b-a20b")
    path = DecisionPath(model, parallel, presets.hardware("paper-gpu"))
    path.forward(1 << 40, 1.5, "steady", 0)
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="imbalance"):
            path.forward(1 << 40, bad, "steady", 0)
    assert path.planned(0) == 1.5
    with pytest.raises(ValueError, match="chunk"):
        path.forward(1 << 40, 1.5, "steady", parallel.vp)
