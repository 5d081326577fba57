"""Cost-model speed: build_graph + evaluate for one GLM-1041B-A35B stage chunk (target < 1 ms on CPU)."""

from bagualu2.costmodel import Plan, build_graph, evaluate, presets, stage_memory

MODEL, PARALLEL = presets.model("glm-1041b-a35b")
HW = presets.hardware("paper-gpu")
POLICY = Plan.uniform({"core_attn": "RECOMPUTE", "expert_act": "RECOMPUTE", "expert_fc1": "OFFLOAD"})


def test_build_graph_and_evaluate(benchmark):
    cost = benchmark(lambda: evaluate(build_graph(MODEL, PARALLEL, HW, imbalance=1.6)))
    assert cost.activation_bytes > 0


def test_evaluate_only(benchmark):
    graph = build_graph(MODEL, PARALLEL, HW, imbalance=1.6)
    assert benchmark(evaluate, graph, POLICY).overhead_ns > 0


def test_stage_memory(benchmark):
    assert benchmark(stage_memory, MODEL, PARALLEL, HW, imbalance=2.6).peak_bytes > 0
