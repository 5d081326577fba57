"""Deferred planning after the MoE gate, on the running reference model (CPU cap, gloo EP).

A micro-batch planned for the mean routing meets a budget it cannot keep (a tight budget, or a routing spike under
expert parallelism): without the deferred hook the tracker's cap raises ``ActivationOutOfMemoryError`` mid-forward;
with it, the MoE modules after the gate switch to full recompute, the forward fits, the bytes kept equal the cost
model's for the plan in force, and the gradients are bitwise those of the unmitigated run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from bagualu2.costmodel import ParallelConfig, Plan, build_graph, evaluate, presets
from bagualu2.exec import ActivationOutOfMemoryError, ActivationTracker, DeferredPlanner, apply_plan
from bagualu2.runtime import downgrade_plan
from exec_run import run_plan
from forkrun import FORKRUN, forked
from reference_trainer.instrumented import instrument_reference
from reference_trainer.model import GLMMoEModel

ROOT = Path(__file__).resolve().parents[2]
SEQ = 32


def _setup():
    config, _ = presets.model("tiny-moe")
    config = config.replace(seq_length=SEQ)
    hardware = presets.hardware("cpu")
    return config, hardware, build_graph(config, ParallelConfig(), hardware)


def _run(config, graph, plan, *, cap=None, deferred=None):
    torch.manual_seed(0)
    model = GLMMoEModel(config)
    instrument_reference(model)
    x = torch.randn(config.micro_batch_size, config.seq_length, config.hidden_size, requires_grad=True)
    executor = apply_plan(graph, plan, tracker=ActivationTracker(cap_bytes=cap, exclude=[model]), deferred=deferred)
    with executor.micro_batch("mb0") as record:
        out = model.forward_layers(x)
    out.pow(2).mean().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    grads["input"] = x.grad
    return record, grads, executor.tracker.peak_bytes


def _all_moe_downgraded(graph, config):
    plan = Plan()
    for layer in graph.layers:
        if config.is_moe_layer(layer):
            plan = downgrade_plan(graph, plan, layers=(layer,))
    return plan


@pytest.mark.slow
def test_deferred_downgrade_avoids_the_cap_error():
    config, hardware, graph = _setup()
    floor = evaluate(graph, _all_moe_downgraded(graph, config)).activation_bytes
    budget = (floor + graph.unmitigated_bytes) // 2
    with pytest.raises(ActivationOutOfMemoryError):
        _run(config, graph, "none", cap=budget)
    planner = DeferredPlanner(config, ParallelConfig(), hardware, budget_bytes=budget)
    record, grads, peak = _run(config, graph, "none", cap=budget, deferred=planner)
    assert record.downgraded  # some MoE modules switched to full recompute after their gate
    assert [layer for layer, _, _, down in planner.decisions if down] == record.downgraded
    assert record.device_bytes == evaluate(graph, record.plan).activation_bytes <= budget
    assert peak <= budget
    _, grads0, _ = _run(config, graph, "none")
    for name, g0 in grads0.items():
        assert torch.equal(g0, grads[name]), name


@pytest.mark.slow
def test_no_downgrade_when_the_plan_fits():
    config, hardware, graph = _setup()
    planner = DeferredPlanner(config, ParallelConfig(), hardware, budget_bytes=graph.unmitigated_bytes)
    record, _, _ = _run(config, graph, "none", cap=graph.unmitigated_bytes, deferred=planner)
    assert record.downgraded == [] and planner.decisions and not any(d for *_, d in planner.decisions)
    assert record.device_bytes == graph.unmitigated_bytes


def test_downgrade_keeps_what_exists_at_the_gate():
    config, _, graph = _setup()
    plan = downgrade_plan(graph, None, layers=(1,))
    strategies = {k: s.value for k, s in plan.entries}
    assert "L1.unpermute/L1.combined" in strategies and "L1.expert_fc1/L1.dispatched" in strategies
    assert not any(k.startswith(("L1.router/", "L0.", "L2.")) for k in strategies)
    assert "L1.unpermute/L1.router_probs" not in strategies  # made by the router: stays
    with pytest.raises(ValueError, match="layer 0 is not a MoE layer"):
        downgrade_plan(graph, None, layers=(0,))
    with pytest.raises(ValueError, match="budget_bytes"):
        DeferredPlanner(config, ParallelConfig(), presets.hardware("cpu"), budget_bytes=-1)


@pytest.mark.launch
@pytest.mark.integration
def test_spike_under_expert_parallelism_is_downgraded():
    """EP=2, rank 0 receives 2x the mean: the plan sized for the mean would exceed its budget there."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def measure(*extra):
        proc = forked(FORKRUN, "--standalone", "--nproc_per_node=2", "-m", "reference_trainer.experiments.measure",
                      "--preset", "tiny-moe", "--ep", "2", "--imbalance", "2", "--json", *extra, cwd=ROOT, env=env,
                      timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][0])

    config, _ = presets.model("tiny-moe")
    mean = build_graph(config, ParallelConfig(dp=2, ep=2), presets.hardware("cpu"), imbalance=1.0)
    budget = mean.unmitigated_bytes  # provisioned for the mean routing
    record = measure("--budget-bytes", str(budget))
    assert record["planned_bytes"] > budget  # the spike does not fit the plan made for the mean
    assert record["downgraded_layers"]
    assert record["measured_bytes"] == record["predicted_bytes"] <= budget
    assert record["peak_bytes"] <= budget
    assert "L1.dispatch" in record["replayed_ops"]  # backward re-ran the all-to-all on both ranks
    assert record["grads_sha256"] == measure()["grads_sha256"]  # bitwise the unmitigated gradients


@pytest.mark.slow
@pytest.mark.parametrize("step", [1, 2, 3, 4, 5])
def test_graded_gate_replans_the_module_and_keeps_bytes_and_gradients(step):
    """The graded re-plan may change what the router and its norm saved (held provisionally until the gate):
    whatever it chose, the bytes kept are ``evaluate`` of the plan in force and the gradients are bitwise."""
    config, hardware, graph = _setup()
    floor = evaluate(graph, _all_moe_downgraded(graph, config)).activation_bytes
    budget = graph.floor_bytes + (graph.unmitigated_bytes - graph.floor_bytes) * step // 6
    planner = DeferredPlanner(config, ParallelConfig(), hardware, budget_bytes=budget)
    record, grads, peak = _run(config, graph, "none", cap=max(budget, floor), deferred=planner)
    assert record.device_bytes == evaluate(graph, record.plan).activation_bytes
    assert record.device_bytes <= budget or record.device_bytes <= floor
    assert not record.provisional and not record.standby  # every gate settled what it held
    _, grads0, _ = _run(config, graph, "none")
    for name, g0 in grads0.items():
        assert torch.equal(g0, grads[name]), name


@pytest.mark.slow
def test_graded_gate_changes_savings_made_before_it():
    """At some budget the cheapest plan after the gate re-runs the MoE norm (its output's FP32 copy, kept by the
    router before the gate, is then dropped): the provisional path is what makes that exact."""
    config, hardware, graph = _setup()
    router_made = {t for t, spec in graph.tensors.items() if spec.producer is not None
                   and graph.op(spec.producer).kind in ("router", "norm") and spec.producer.endswith(("router", "norm2"))}
    changed = False
    for step in range(1, 6):
        budget = graph.floor_bytes + (graph.unmitigated_bytes - graph.floor_bytes) * step // 6
        planner = DeferredPlanner(config, ParallelConfig(), hardware, budget_bytes=budget)
        record, _, _ = _run(config, graph, "none", deferred=planner)
        changed = changed or any(key.partition("/")[2] in router_made for key, _ in record.plan.entries)
        assert record.device_bytes == evaluate(graph, record.plan).activation_bytes
    assert changed


def _run_bf16(plan, deferred, gate=True):
    config = presets.model("tiny-moe")[0].replace(seq_length=16, dtype="bf16")
    graph = build_graph(config, ParallelConfig(), presets.hardware("cpu"))
    # gate=False: a model instrumented without a gate callback never reports its gates, so everything held is
    # settled when the forward ends
    record, _, grads, _ = run_plan(config, graph, plan, deferred=deferred, gate=gate)
    return graph, record, list(grads.values())


@pytest.mark.slow
def test_a_gate_never_reported_settles_at_the_end_and_backward_reads_the_stored_copy():
    """bf16: the router keeps an FP32 copy of the norm's output; the shared expert's BF16 saving is RECOMPUTE, so
    nothing re-runs the norm and the standby replay is forgotten — backward must read the FP32 copy."""
    config = presets.model("tiny-moe")[0].replace(seq_length=16, dtype="bf16")
    planner = DeferredPlanner(config, ParallelConfig(), presets.hardware("cpu"), budget_bytes=1 << 40)
    graph, record, grads = _run_bf16(Plan.from_str("L1.shared_fc1/L1.norm2_out=RECOMPUTE"), planner,
                                     gate=False)
    assert record.device_bytes == evaluate(graph, record.plan).activation_bytes
    _, _, plain = _run_bf16(None, None)
    assert all(torch.equal(a, b) for a, b in zip(plain, grads))


@pytest.mark.slow
def test_replays_the_gate_drops_hold_nothing():
    """A pre-gate plan that re-runs the router; when the gate's plan no longer does, no replay of it is left."""
    config, hardware, graph = _setup()
    for step in range(0, 20):
        budget = graph.floor_bytes + (graph.unmitigated_bytes - graph.floor_bytes) * step // 20
        planner = DeferredPlanner(config, ParallelConfig(), hardware, budget_bytes=budget)
        record, grads, _ = _run(config, graph, "L1.router/L1.router_scores=RECOMPUTE", deferred=planner)
        assert all(replay.op in record.rerun or replay.runs for replay in record.replays), step
        assert record.device_bytes == evaluate(graph, record.plan).activation_bytes


def test_paper_mode_downgrades_only_the_module_whose_gate_fired():
    config, hardware, graph = _setup()
    budget = evaluate(graph, downgrade_plan(graph, None, layers=(1,))).activation_bytes
    planner = DeferredPlanner(config, ParallelConfig(), hardware, budget_bytes=budget, downgrade="paper")
    record, _, _ = _run(config, graph, "none", deferred=planner)
    downgraded = sorted({graph.op(key.partition("/")[0]).layer for key, _ in record.plan.entries})
    assert downgraded == record.downgraded == [1]
