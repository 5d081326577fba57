"""Bad arguments to the public library API: one ValueError naming the argument (never a TypeError, an
AttributeError or an arithmetic error from inside, never a silent result), and text forms that read back."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest

from bagualu2.budget import BudgetPhase
from bagualu2.costmodel import Plan, Strategy, build_graph, presets
from bagualu2.costmodel.strategy import Knee, calibrate, fit_knee, knee
from bagualu2.exec import ActivationTracker, apply_plan
from bagualu2.exec.deferred import DeferredPlanner
from bagualu2.fusion import Order
from bagualu2.mitigation.prefix import fit_prefix, prefix_plan
from bagualu2.runtime import DecisionPath, Iteration, Stage, ceil_bucket, floor_bucket, spike_trace

HW = presets.hardware("cpu")
MODEL, PARALLEL = presets.model("tiny-moe")
PARALLEL = dataclasses.replace(PARALLEL, dp=2, ep=2, vp=2)
GRAPH = build_graph(MODEL, PARALLEL, HW)


def refused(call, match: str) -> None:
    with pytest.raises(ValueError, match=match) as excinfo:
        call()
    assert "\n" not in str(excinfo.value)


def test_plans_are_built_only_from_what_reads_back():
    refused(lambda: Plan.from_decisions({("a", 1): Strategy.RECOMPUTE}), "decisions must map")
    refused(lambda: Plan.from_decisions([1]), "decisions must map")
    refused(lambda: Plan.uniform({1: "R"}), "plan key must be")
    refused(lambda: Plan.uniform(["core_attn"]), "Plan.uniform takes a mapping")
    for bad in (5, [5], [("a", "b", "c")]):
        refused(lambda: Plan.of(bad), "plan decisions must be")
    refused(lambda: Plan(None), "plan entries must be a tuple")
    refused(lambda: Plan.from_csv(5), "plan CSV must be a string")
    refused(lambda: Plan.from_csv("key,strategy\n" + "x" * 200_000 + ",KEEP"), "plan CSV is malformed: field larger")
    refused(lambda: Plan.from_json("[" * 100000), "plan JSON must be")


def test_orders_check_every_field_and_read_back():
    order = Order(((("F", 0), ("B", 1)), (("O", 0),)), makespan_ns=np.int64(7), solver="dp")
    assert type(order.makespan_ns) is int and Order.from_str(repr(order)) == order
    refused(lambda: Order(((("F", 0),),), makespan_ns=1.5), "makespan_ns must be an integer")
    refused(lambda: Order(((("F", 0),),), barriers="no"), "barriers must be True or False")
    refused(lambda: Order(None), "order groups must be")
    refused(lambda: Order.from_str("F\u00b2"), "stage 'F\u00b2' must be a chain kind")
    refused(lambda: Order.from_str("Order('F0', makespan_ns=abc, solver='x')"), "makespan_ns must be an integer")
    refused(lambda: Order.from_str("Order('F0', makespan_ns=1, solver='x', solver='y')"), "'solver' is given twice")
    for text in (">", "F0>>F1", "F0||F1", ">F0", "F0>F1>"):
        refused(lambda: Order.from_str(text), "order text has an empty group")
    assert Order.from_str("F0>") == Order(((("F", 0),),), barriers=False)  # an issue order of one stage
    for args, message in (((1, "t", Strategy.KEEP), "op must be a non-empty name"),
                          (("op", "", Strategy.KEEP), "tensor must be a non-empty name"),
                          (("L0.a/b", "t", Strategy.KEEP), "op must be an op's name"),
                          (("op", "t", "KEEP"), "strategy must be a Strategy")):
        refused(lambda: Plan().with_decision(*args), message)


def test_the_decision_path_validates_what_its_memo_would_find():
    path = DecisionPath(MODEL, PARALLEL, HW)
    budget = path.graph(0, 1.0).unmitigated_bytes // 2
    path.forward(budget, 1.0, "steady", 1)  # (1.0, 1) is remembered now: True and [0] must not pass for it
    refused(lambda: path.forward(budget, 1.0, "steady", True), "chunk must be an integer")
    refused(lambda: path.forward(budget, True, "steady", 1), "imbalance must be a finite number")
    refused(lambda: path.forward(budget, 1.0, "steady", [0]), "chunk must be an integer")
    refused(lambda: path.observe("x", 1.0), "chunk must be an integer")
    state = path.state_dict()
    for bad, match in (({"seen": {"0": "12"}}, "holds str, not a list"), ({"seen": {"99": [1.0]}}, "chunk must be"),
                       ({"seen": {"0": [1.0], "1": [9.0]}}, "imbalance must be"), ({"seen": 3}, "runtime state")):
        refused(lambda: path.load_state_dict(bad), match)
        assert path.state_dict() == state  # a refused state changes nothing


def test_iteration_records_without_budgets_are_checked():
    iteration = Iteration(Stage(MODEL, PARALLEL, HW), budgeted=False)
    refused(lambda: iteration.record_forward(-1, 100), "record_forward: index")
    refused(lambda: iteration.record_forward(0, -100), "kept_bytes")
    refused(lambda: iteration.record_forward(99, 1), "record_forward: index")
    assert iteration.held_bytes == 0
    iteration.record_forward(0, 10)
    refused(lambda: iteration.record_forward(0, 10), "already recorded")
    iteration.record_backward(0)
    refused(lambda: iteration.record_backward(0), "not in flight")
    assert (iteration.held_bytes, iteration.peak_bytes) == (0, 10)


def test_a_budgets_phase_is_warmup_or_steady():
    """Any other phase was taken as steady, silently dropping the warmup's absorption limit."""
    iteration = Iteration(Stage(MODEL, PARALLEL, HW))
    assert iteration.budget(BudgetPhase.WARMUP) == iteration.budget("warmup")
    assert iteration.budget("warmup")[1] is not None and iteration.budget("steady")[1] is None
    for bad in ("WARMUP", "x", 5, None):
        refused(lambda: iteration.budget(bad), "phase must be one of warmup, steady")


def test_knees_fits_and_buckets():
    assert knee("OFFLOAD", HW) == knee(Strategy.OFFLOAD, HW)
    refused(lambda: fit_knee([1, 2, 3], [math.nan, 1.0, 2.0]), "overheads_s must be a finite number")
    refused(lambda: fit_knee([1, 2, math.inf], [1, 2, 3]), "sizes_bytes must be a finite number")
    refused(lambda: fit_knee(None, None), "sizes_bytes must be a sequence")
    refused(lambda: knee(Strategy.OFFLOAD, None), "hardware must be a Hardware")
    refused(lambda: calibrate(HW, "OFFLOAD", 3), "fitted must be a Knee")
    refused(lambda: Knee(1.0, 0.0), "peak_bytes_per_s")
    for step in (0, -0.1, math.nan, True):
        refused(lambda: ceil_bucket(1.5, step, 2.0), "step must be")
        refused(lambda: floor_bucket(1.5, step), "step must be")
    refused(lambda: spike_trace(4, seed=None), "seed must be")
    hardware = HW.replace(matmul_efficiency=np.float32(0.5), attention_efficiency=np.float64(0.4))
    assert type(hardware.matmul_efficiency) is float and hardware.to_json()  # numpy scalars print as JSON


def test_prefix_plans_and_the_deferred_planner():
    budget = GRAPH.unmitigated_bytes // 2
    assert fit_prefix(GRAPH, "none", budget).plan == fit_prefix(GRAPH, Plan(), budget).plan
    refused(lambda: prefix_plan(GRAPH, Plan(), -1), "count must be an integer >= 0")
    refused(lambda: prefix_plan(GRAPH, Plan(), 1.5), "count must be an integer")
    refused(lambda: fit_prefix(None, Plan(), budget), "graph must be an OpGraph")
    dense, dense_parallel = presets.model("tiny-dense")
    refused(lambda: DeferredPlanner(dense, dense_parallel, HW, budget_bytes=1).imbalance(0, 0), "dense model")
    refused(lambda: DeferredPlanner(None, None, HW, budget_bytes=1), "needs a ModelConfig and a ParallelConfig")
    parallel = dataclasses.replace(PARALLEL, vp=1)  # stage 0 holds layers 0 (dense) and 1 (MoE)
    planner = DeferredPlanner(MODEL, parallel, HW, budget_bytes=budget)
    assert planner.after_gate("none", 1, 10) == planner.after_gate(Plan(), 1, 10)
    refused(lambda: planner.after_gate(Plan(), "x", 10), "layer must be an integer")
    refused(lambda: planner.imbalance(1, 10 ** 400), "received_tokens must be an integer")


def test_executor_and_tracker_misuse():
    for plan in (0, [], {}):
        refused(lambda: apply_plan(GRAPH, plan), "plan must be a Plan, its text form or None")
    refused(lambda: ActivationTracker(exclude=5), "exclude must be an iterable of torch modules")
    refused(lambda: ActivationTracker(exclude=[5]), "exclude takes torch modules")
    refused(lambda: ActivationTracker().micro_batch([1]).__enter__(), "micro-batch names are strings or integers")
    executor = apply_plan(GRAPH, "none")
    refused(lambda: executor.micro_batch("p", plan=5).__enter__(), "plan must be a Plan")
    with executor.micro_batch("a"):
        pass
    with executor.micro_batch(0):
        pass
    refused(lambda: executor.release("zz"), r"not in flight; in flight: 'a', 0")
    refused(lambda: executor.release([1]), "not in flight")
    refused(lambda: executor.recover("a", tensors=5), "tensors must be a collection of names")


def test_solvers_engines_and_configs_name_a_wrong_argument():
    from bagualu2.mitigation import brute, exact, greedy
    from bagualu2.mitigation.conflicts import check_conflicts
    from bagualu2.mitigation.solution import floor_plan

    for call in (lambda: greedy.solve(None, 1), lambda: exact.solve(None, 1), lambda: brute.solve(None, 1),
                 lambda: check_conflicts(None, Plan()), lambda: floor_plan(None)):
        refused(call, "graph must be an OpGraph")
    refused(lambda: greedy.solve(GRAPH, 1, config={"variant": "paper"}), "config must be a GreedyConfig")
    refused(lambda: greedy.solve(GRAPH, 1, free=[["a"]]), "free must be a collection of tensor names")
    assert greedy.solve(GRAPH, GRAPH.unmitigated_bytes, free=(t for t in ())).ok  # a generator is a collection
    refused(lambda: Stage(MODEL, None, HW), "parallel must be a ParallelConfig")
    refused(lambda: Stage(MODEL, PARALLEL, None), "hardware must be a Hardware profile")
    refused(lambda: MODEL.replace(foo=1), "ModelConfig has no field foo; fields: num_layers")
    refused(lambda: HW.replace(peak=1), "Hardware has no field peak")
    refused(lambda: exact.solve(GRAPH, 1, hint="x"), "hint must be True or False")
    refused(lambda: brute.solve(GRAPH, 1, max_decisions="x"), "max_decisions must be an integer")


def test_the_evaluator_the_fusion_solvers_and_the_curves_name_a_wrong_argument():
    from bagualu2.costmodel import evaluate
    from bagualu2.costmodel.evaluate import evaluate_resolved
    from bagualu2.costmodel.pipeline import memory_curve, timed_curve
    from bagualu2.fusion import build_chains, dp, exact

    refused(lambda: evaluate(None), "graph must be an OpGraph")
    refused(lambda: evaluate("g", "none"), "graph must be an OpGraph")
    refused(lambda: evaluate_resolved(None, {}), "graph must be an OpGraph")
    refused(lambda: build_chains("g", None, None, None), "forward_graph must be an OpGraph or None, got str")
    refused(lambda: build_chains(None, None, 3, None), "backward_graph must be an OpGraph or None, got int")
    for call in (lambda: dp.solve(None), lambda: exact.solve(None), lambda: dp.solve("F0")):
        refused(call, "chains must be a Chains")
    chains = build_chains(GRAPH, Plan(), GRAPH, Plan())
    refused(lambda: exact.solve(chains, hint="x"), "hint must be an Order or None")
    per_microbatch = [1] * PARALLEL.num_microbatches
    refused(lambda: timed_curve(PARALLEL, per_microbatch, forward_s=math.nan, backward_s=1.0), "forward_s must be")
    refused(lambda: timed_curve(PARALLEL, per_microbatch, forward_s="1", backward_s=1.0), "forward_s must be")
    refused(lambda: timed_curve(PARALLEL, per_microbatch, forward_s=1.0, backward_s=0), "backward_s must be")
    refused(lambda: memory_curve(PARALLEL, per_microbatch, base_bytes=math.nan), "base_bytes must be an integer")
    refused(lambda: memory_curve(PARALLEL, per_microbatch, base_bytes=-1), "base_bytes must be an integer >= 0")
    assert memory_curve(PARALLEL, per_microbatch, base_bytes=5)[0] == 5


def test_the_simulator_and_the_reproduction_name_a_wrong_argument():
    from bagualu2.sim import PaperTrace, load_trace, paper_trace, simulate
    from bagualu2.sim.reproduce import ReproduceConfig, reproduce

    model, parallel = presets.model("glm-188b-a20b")
    refused(lambda: simulate(model, parallel, presets.hardware("paper-gpu"), "flexible", [1.0], plan_imbalance=0.5),
            "plan_imbalance must be")
    for changes, match in (({"models": ()}, "models must be a non-empty tuple"), ({"models": "glm-188b-a20b"},
                                                                                 "models"),
                           ({"models": None}, "models"), ({"top_ks": ()}, "top_ks"),
                           ({"seq_lengths": ()}, "seq_lengths"),
                           ({"seq_lengths": (4097,)}, "seq_lengths: 4097 does not fit"),
                           ({"plan_imbalance": 0.5}, "plan_imbalance must be"),
                           ({"plan_imbalance": 40}, r"plan_imbalance must be in \[1, 12.8\]"),
                           ({"top_ks": (2, 50)}, r"top_ks must be integers in \[1, 49\]")):
        refused(lambda: ReproduceConfig(iterations=10, **changes), match)
    config = ReproduceConfig(iterations=10, models=("GLM-423B-A30B", "glm-423b-a30b"), focus="GLM-423B-A30B")
    assert config.models == ("glm-423b-a30b",) and config.focus == "glm-423b-a30b"  # one spelling, one run
    refused(lambda: reproduce("abc"), "config must be a ReproduceConfig")
    refused(lambda: reproduce(config, progress=5), "progress must be a callable")
    for value in ("x", -1):
        refused(lambda: paper_trace(3, spike_microbatches=value), "spike_microbatches must be an integer")
    refused(lambda: PaperTrace(num_iterations=10 ** 12), "num_iterations must be an integer in")
    refused(lambda: PaperTrace(num_iterations=3, num_microbatches=10 ** 9), "num_microbatches must be an integer in")
    for path in (0, True, None):  # an integer would be read as a file descriptor
        refused(lambda: load_trace(path), "path must be a file path")


def test_gate_helpers_and_iteration_drivers_name_a_wrong_argument():
    from bagualu2.runtime import after_gate, downgrade_plan, gate_free_tensors, replay_iteration, run_iteration

    graph = build_graph(MODEL, dataclasses.replace(PARALLEL, vp=1), HW)
    assert downgrade_plan(graph, "none", layers=[1]) == downgrade_plan(graph, Plan(), layers=(1,))
    for call in (lambda: after_gate(graph, None, 10, layers=1), lambda: downgrade_plan(graph, layers=1),
                 lambda: gate_free_tensors(graph, layers=1)):
        refused(call, "layers must be a collection of layer numbers")
    refused(lambda: downgrade_plan(graph, layers=["a"]), "layers must be an integer")
    refused(lambda: after_gate(graph, None, 10, cost="x"), "cost must be a callable")
    refused(lambda: gate_free_tensors(None), "graph must be an OpGraph")
    engine = Stage(MODEL, PARALLEL, HW)
    path = DecisionPath.on(engine)
    rates = [1.0] * PARALLEL.num_microbatches
    refused(lambda: run_iteration(engine, path.decide, (r for r in rates)), "imbalances must be a sequence")
    refused(lambda: run_iteration(engine, path.decide, {"a": 1.0}), "imbalances must be a sequence")
    refused(lambda: run_iteration(engine, lambda *args: 5, rates), "decide must return what the forward runs")
    refused(lambda: run_iteration(engine, lambda *args: None, rates), "kept_bytes; got NoneType")
    refused(lambda: Iteration(None), "stage must be a runtime Stage")
    refused(lambda: replay_iteration(MODEL, PARALLEL, HW, rates, stage=False), "stage must be an integer")
    refused(lambda: replay_iteration(MODEL, None, HW, rates), "parallel must be a ParallelConfig")


def test_what_worked_before_still_does():
    """The checks above refuse only what is wrong: numpy values, str subclasses, module containers, paths."""
    from pathlib import Path
    from types import MappingProxyType

    import torch

    from bagualu2.runtime import replay_iteration, run_iteration
    from bagualu2.sim import PaperTrace
    from reference_trainer.recipes import recipe

    engine = Stage(MODEL, PARALLEL, HW)
    rates = np.ones(PARALLEL.num_microbatches)
    assert len(run_iteration(engine, DecisionPath.on(engine).decide, rates).forwards) == engine.num_forwards
    refused(lambda: replay_iteration(MODEL, PARALLEL, HW, [2.5] * PARALLEL.num_microbatches),
            r"imbalance must be a finite number in \[1, 2\]")  # named before any decision
    assert PaperTrace(num_iterations=10, num_microbatches=16384, spike_microbatches=16384).rates()
    key = (np.str_("L1.expert_act"), np.str_("L1.expert_fc1_out"))
    assert str(Plan.from_decisions({key: Strategy.OFFLOAD})) == "L1.expert_act/L1.expert_fc1_out=OFFLOAD"
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    ActivationTracker(exclude=layers)  # a container of modules excludes each
    config = recipe("glm_moe_debug").with_overrides(checkpoint_dir=Path("ckpt"), checkpoint_every=2)
    assert config.checkpoint_dir == "ckpt"
    assert _section_of(MappingProxyType({"memory_cap_mib": 8})).memory_cap_mib == 8  # any mapping


def _section_of(section):
    from types import SimpleNamespace

    from bagualu2.integrations.torchtitan import Bagualu2Converter

    job = SimpleNamespace(bagualu2=section, activation_checkpoint=SimpleNamespace(mode="none"),
                          parallelism=SimpleNamespace(pipeline_parallel_schedule="1F1B",
                                                      pipeline_parallel_schedule_csv="",
                                                      pipeline_parallel_microbatch_size=1),
                          training=SimpleNamespace(local_batch_size=4))
    dims = SimpleNamespace(tp_enabled=False, cp_enabled=False, ep_enabled=False, ep=1, pp_enabled=True)
    return Bagualu2Converter(job, dims).config


def test_a_graph_too_slow_for_int64_nanoseconds_is_one_line_not_an_overflow():
    """Each field in range, together beyond any int64 sum of nanoseconds: refused where the graph is built, not
    an OverflowError in the DP or a TypeError in CP-SAT."""
    from bagualu2.costmodel import ModelConfig, ParallelConfig

    model = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4096, num_query_groups=8, head_dim=512,
                        ffn_hidden_size=64, vocab_size=64, seq_length=1 << 24)
    refused(lambda: build_graph(model, ParallelConfig(), presets.hardware("cpu")),
            r"take 4\.13e\+10 s of one micro-batch .* so that every sum of nanoseconds stays an int64")


def test_a_bound_in_an_error_is_never_rounded_into_a_contradiction():
    """A range's float bound prints short where that is exact, else in full: the value shown is the bound checked."""
    from bagualu2.costmodel.validate import require_int, require_number

    refused(lambda: require_number("imbalance", 2.666667, 1, 8 / 3),
            re.escape("imbalance must be a finite number in [1, 2.6666666666666665], got 2.666667"))
    refused(lambda: require_number("restart_s", -1.0, 0.0, 1e9),
            re.escape("restart_s must be a finite number in [0, 1e+09]"))
    refused(lambda: require_int("seed", -1, 0, 2**63), re.escape("seed must be an integer in [0, 2**63), got -1"))


def test_paper_trace_refuses_huge_rates_and_takes_numpy_seeds():
    import numpy as np

    from bagualu2.sim import paper_trace

    for field, value in (("spike_max", 1e308), ("base_low", 1e307), ("base_high", 1e300)):
        with pytest.raises(ValueError, match=rf"^{field} must be a finite number in .*, 65536\], got "):
            paper_trace(5, **{field: value})
    assert paper_trace(20, seed=np.int64(3)) == paper_trace(20, seed=3)


def test_integers_beyond_the_floats_are_refused_like_any_out_of_range_number(tmp_path):
    """``float(10**400)`` raises OverflowError: every number the simulator takes, in a trace file too, is one line
    naming it (with the integer shown short), as 1e400 is."""
    from bagualu2.sim import load_trace, paper_trace, simulate

    model, parallel = presets.model("glm-188b-a20b")
    hardware = presets.hardware("paper-gpu")
    huge = 10 ** 400
    refused(lambda: paper_trace(3, base_low=huge), r"^base_low must be a finite number in \[1, 65536\], got an "
                                                   "integer of about 401 digits$")
    refused(lambda: paper_trace(3, spike_share=huge), r"^spike_share must be a finite number in \[0, 1\]")
    refused(lambda: simulate(model, parallel, hardware, "ideal", [1.0], restart_s=huge), r"^restart_s must be")
    refused(lambda: simulate(model, parallel, hardware, "ideal", [1.0], plan_imbalance=huge),
            r"^plan_imbalance must be")
    refused(lambda: simulate(model, parallel, hardware, "ideal", [huge]),
            r"^trace\[0\] \(iteration 0\): imbalance must be .* got an integer of about 401 digits$")
    path = tmp_path / "huge.jsonl"
    path.write_text('{"iteration": 0, "microbatch": 0, "imbalance": 1' + "0" * 400 + "}\n")
    refused(lambda: load_trace(path), rf"^{re.escape(str(path))}: line 1: imbalance must be a finite number >= 1, "
                                      "got an integer of about 401 digits$")


def test_an_iteration_of_unordered_rates_and_repeated_sweep_values_are_not_taken_silently():
    """A set or a dict of rates has no micro-batch order (a set's follows the hashes): refused as one iteration, as
    it is as the whole trace. Fig. 10's top-k and sequence lengths given twice run once, as models do."""
    from bagualu2.sim import simulate
    from bagualu2.sim.reproduce import ReproduceConfig

    model, parallel = presets.model("glm-188b-a20b")
    hardware = presets.hardware("paper-gpu")
    rates = [1.0 + i / 100 for i in range(parallel.num_microbatches)]
    for entry in (set(rates), dict.fromkeys(rates, 0)):
        refused(lambda entry=entry: simulate(model, parallel, hardware, "ideal", [entry]),
                rf"^trace\[0\] \(iteration 0\): must be a rate or a sequence of {parallel.num_microbatches} "
                "per-micro-batch rates")
    config = ReproduceConfig(top_ks=(2, 4, 2), seq_lengths=(4096, 8192, 4096), models=("glm-188b-a20b",) * 2)
    assert (config.top_ks, config.seq_lengths, config.models) == ((2, 4), (4096, 8192), ("glm-188b-a20b",))


def test_plan_and_order_text_errors_stay_one_short_line():
    """A 100,000-character key, a 5,000-digit number, a missing JSON field and a stage index no text form can print
    are each one short ValueError; a stage listed twice is no order (each stage runs once)."""
    for call, match in ((lambda: Plan.from_str("x" * 100_000 + "=R"), r"^plan key 'xxx.*\.\.\. is neither"),
                        (lambda: Plan.from_json("1" * 5000), r"holds a number of over 4300 digits$"),
                        (lambda: Plan.from_json('{"plan": [{"key": "a/b"}]}'), r"missing field 'strategy'$"),
                        (lambda: Order.from_str("F" + "9" * 5000), r"^stage 'F999.*\.\.\. must be a chain kind"),
                        (lambda: Order(((("F", 10 ** 5000),),)), r"^unknown stage 'F' an integer of about 5001 digits"),
                        (lambda: Order.from_str("F0>F0"), r"^stage F0 appears twice in the order"),
                        (lambda: Order.from_str("F0+B0|F0"), r"^stage F0 appears twice in the order")):
        refused(call, match)
        with pytest.raises(ValueError) as excinfo:
            call()
        assert len(str(excinfo.value)) < 400
    assert str(Order.from_str("F2147483647")) == "F2147483647"


def test_json_readers_take_text_and_name_what_is_wrong():
    from pathlib import Path

    from bagualu2.costmodel import Hardware

    for reader, what in ((Hardware.from_json, "hardware JSON"), (presets.model_from_json, "model JSON")):
        refused(lambda: reader(Path("hw.json")), f"{what} must be the text of a JSON document \\(str or bytes\\), "
                                                 "got PosixPath")
        refused(lambda: reader(None), f"{what} must be the text of a JSON document")
        refused(lambda: reader(b"\xff\xfe\x00"), f"{what} is not UTF-8 text")  # was: "a number over 4300 digits"
    refused(lambda: Plan.from_json(b"\xff\xfe\x00"), "it is not UTF-8 text")
    assert Hardware.from_json(presets.hardware("paper-gpu").to_json().encode()) == presets.hardware("paper-gpu")


def test_buckets_take_an_imbalance_of_at_least_1():
    for bad in (None, "1", 0.5, -5, math.inf, math.nan, 10**400):
        refused(lambda: ceil_bucket(bad, 0.02), "imbalance must be a finite number >= 1")
        refused(lambda: floor_bucket(bad, 0.02), "imbalance must be a finite number >= 1")
    refused(lambda: ceil_bucket(1.5, 0.02, "x"), "ceiling must be a number >= 1")
    assert (ceil_bucket(1.51, 0.02), ceil_bucket(3.0, 0.5, math.inf), ceil_bucket(5, 0.5, 4.0)) == (1.52, 3.0, 5.0)
    assert floor_bucket(np.float64(1.57), 0.05) == 1.55


def test_fusion_entry_points_refuse_what_is_not_an_order_or_chains():
    from bagualu2.costmodel.rescale import at_imbalance
    from bagualu2.fusion import baselines, build_chains, simulate

    for baseline in (baselines.sequential, baselines.megatron_core, baselines.megatron_kwai,
                     baselines.megatron_overlapped, baselines.megatron_overlapped_groups):
        refused(lambda: baseline(None), "chains must be a Chains")
    graph = build_graph(MODEL, PARALLEL, HW)
    chains = build_chains(graph, None, graph, None, hardware=HW)
    order = baselines.sequential(chains)
    refused(lambda: simulate(str(order), chains), "order must be an Order \\(its text form: Order.from_str\\)")
    assert simulate(Order.from_str(str(order)), chains).makespan_ns == order.makespan_ns
    refused(lambda: Stage(MODEL, PARALLEL, HW).order(5), "chains must be a Chains")
    refused(lambda: at_imbalance(graph, 1e308), "beyond any routing")


def test_hand_made_graphs_and_chains_name_what_is_wrong():
    """The public constructors of the cost graph and of a point's chains refuse what no evaluator or DP can cost:
    a tensor of negative, fractional or unknown-dtype size, an op of a fractional duration, an op reading what a
    later op makes (a cycle), chains whose nanoseconds leave int64, stages that are not stages."""
    from bagualu2.costmodel import OpGraph
    from bagualu2.fusion import Chain, Chains
    from bagualu2.fusion import Stage as ChainStage

    def remade(**changes):
        return lambda: OpGraph(**{**{f.name: getattr(GRAPH, f.name) for f in dataclasses.fields(GRAPH) if f.init},
                                  **changes})

    remade()()  # the graph as built is accepted
    name, spec = next(iter(GRAPH.tensors.items()))
    for numel, match in ((-1, ">= 0, got -1"), (2.5, "an integer >= 0, got 2.5")):
        refused(remade(tensors={**GRAPH.tensors, name: spec._replace(numel=numel)}),
                f"tensor {name!r}'s numel .*{match}")
    refused(remade(tensors={**GRAPH.tensors, name: spec._replace(dtype="fp4")}), "unknown dtype 'fp4'; allowed: fp32")
    ops = list(GRAPH.ops)
    refused(remade(ops=tuple([ops[0]._replace(forward_ns=1.5)] + ops[1:])), "forward_ns must be an integer")
    reader = next(i for i, op in enumerate(ops) if any(GRAPH.tensors[t].producer for t in op.inputs))
    swapped = ops[:reader - 1] + [ops[reader], ops[reader - 1]] + ops[reader + 1:]
    refused(remade(ops=tuple(swapped)), "makes at or after it; ops must be in program order")
    huge = Chain("F", (ChainStage("f0", "compute", 1 << 59), ChainStage("f1", "comm", 1 << 59)))
    refused(lambda: Chains(forward=huge, backward=Chain("B", (ChainStage("b0", "compute", 1 << 59),))),
            "take 1.73e\\+09 s together .* stays an int64")
    refused(lambda: Chain("F", (3,)), "chain F's stages must be Stage objects, got int")
    refused(lambda: Chain("F", "f0"), "chain F's stages must be a sequence of Stage, got 'f0'")


def test_each_error_names_the_field_it_is_about():
    from bagualu2.budget import BudgetAssigner
    from bagualu2.costmodel import imbalance_limit
    from bagualu2.sim import PaperTrace, SimConfig
    from bagualu2.sim.reproduce import ReproduceConfig

    refused(lambda: imbalance_limit(None, PARALLEL), "^model must be a ModelConfig, got NoneType$")
    refused(lambda: imbalance_limit(MODEL, "pp=2"), "^parallel must be a ParallelConfig, got str$")
    refused(lambda: ReproduceConfig(focus="x"), "^focus: unknown model preset 'x'")
    refused(lambda: ReproduceConfig(models=("glm-188b-a20b", "x")), "^models: unknown model preset 'x'")
    refused(lambda: ReproduceConfig(hardware="x"), "^hardware: unknown hardware preset 'x'")
    refused(lambda: PaperTrace(num_iterations=10, base_low=1.5), r"^base_high must be >= base_low \(1.5\), got 1.2$")
    refused(lambda: PaperTrace(num_iterations=10, spike_max=1.2), r"^spike_max must be > base_high \(1.2\) while")
    refused(lambda: fit_prefix(GRAPH, "nosuch", 1), "^base: plan entry 'nosuch'")
    # what has no use beyond a bound is refused at it rather than taken (or looped over) without end
    refused(lambda: spike_trace(10**30), r"^num_microbatches must be an integer in \[1, 100000000\], got an integer "
                                         r"of 31 digits, about 1e\+30$")
    refused(lambda: PaperTrace(num_iterations=10, seed=10**30), r"^seed must be an integer in \[0, 2\*\*63\)")
    refused(lambda: SimConfig(plan_imbalance=10**30), r"^plan_imbalance must be a finite number in \[1, 65536\]")
    refused(lambda: BudgetAssigner(m_max_bytes=10, m0_bytes=1, num_microbatches=10**30, num_warmup=1),
            r"^num_microbatches must be an integer in \[1, 2\*\*22\]")


def test_a_trace_longer_than_any_run_is_refused_before_its_entries_are_read():
    from bagualu2.sim import simulate
    from bagualu2.sim.simulate import MAX_ITERATIONS

    class Endless:  # a sequence of rates whose entries are never read
        def __len__(self):
            return MAX_ITERATIONS + 1

        def __getitem__(self, index):
            raise AssertionError("an entry was read")

    refused(lambda: simulate(MODEL, PARALLEL, HW, "ideal", Endless()),
            r"^trace must have 1 to 10,000,000 iterations, got 10,000,001$")
    refused(lambda: simulate(MODEL, PARALLEL, HW, "ideal", []), r"^trace must have 1 to 10,000,000 iterations, got 0$")


def test_a_json_file_that_gives_a_field_twice_is_refused():
    from bagualu2.costmodel import Hardware

    model_json = '{"model": {"num_layers": 2, "num_layers": 4}, "parallel": {}}'
    refused(lambda: presets.model_from_json(model_json), "^model JSON gives the key 'num_layers' twice")
    refused(lambda: Hardware.from_json('{"name": "a", "name": "b"}'), "^hardware JSON gives the key 'name' twice")


def test_knees_curves_buckets_and_traces_refuse_what_they_cannot_compute(tmp_path):
    from bagualu2.costmodel import ParallelConfig, memory_curve, num_parameters
    from bagualu2.sim import load_trace

    refused(lambda: fit_knee([1e300, 2e300, 3e300], [1, 2, 3]), "too far apart to fit a knee")
    refused(lambda: knee(Strategy.RECOMPUTE, HW, op="x", saved_bytes=5), "op must be the Op")
    refused(lambda: knee(Strategy.RECOMPUTE, HW, op=GRAPH.ops[0], saved_bytes=True), "saved_bytes")
    refused(lambda: knee(Strategy.QUANTIZE, HW, dtype=[]), "dtype must be the name of a dtype")
    refused(lambda: calibrate(HW, Strategy.QUANTIZE, Knee(1.0, 1e9), dtype=[]), "dtype must be the name of a dtype")
    refused(lambda: num_parameters("tiny-moe"), "model must be a ModelConfig")
    refused(lambda: memory_curve(ParallelConfig(), 5), "per_microbatch_bytes must be a sequence")
    for bucket in (ceil_bucket, floor_bucket):
        refused(lambda: bucket(1e300, 1e-300), "imbalance / step must be a finite number")
    refused(lambda: spike_trace(8, base_jitter=1e308, max_imbalance=1e308), "max_imbalance")
    refused(lambda: spike_trace(8, base_imbalance=1.1, base_jitter=1.0, max_imbalance=2.0, spike_min=1.5),
            "base_jitter=1.0 must keep the ordinary rates")
    refused(lambda: load_trace(tmp_path / "absent.jsonl"), "absent.jsonl: cannot read the trace")


def test_gantt_charts_refuse_what_they_cannot_draw(tmp_path):
    from bagualu2 import fusion
    from bagualu2.fusion.gantt import gantt_png, gantt_png_bytes, gantt_text
    from bagualu2.mitigation import greedy

    plan = greedy.solve(GRAPH, GRAPH.floor_bytes).plan
    chains = fusion.build_chains(GRAPH, plan, GRAPH, plan)
    timeline = fusion.simulate(fusion.dp.solve(chains), chains)
    refused(lambda: gantt_text(None), "timeline must be a fusion Timeline")
    refused(lambda: gantt_text(timeline, width=10**7), "width must be an integer in")
    refused(lambda: gantt_png(timeline, ""), "path must be a non-empty file path")
    refused(lambda: gantt_png_bytes(timeline, title=5), "title must be a string")
    assert gantt_png_bytes(timeline, title="$\\frac{").startswith(b"\x89PNG")  # a '$' is a character, not math
