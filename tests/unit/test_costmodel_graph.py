"""Op graph structure, MoE scaling with imbalance, and the evaluator's semantics."""

import dataclasses
import pytest

from bagualu2.costmodel import (OP_KINDS, ParallelConfig, Plan, Resource, Strategy, build_graph, evaluate,
                                presets, resolve)
from bagualu2.costmodel.graph import COMM_KINDS

HW = presets.hardware("paper-gpu")


def _graph(name="glm-1041b-a35b", imbalance=1.0, **kw):
    model, parallel = presets.model(name)
    return build_graph(model, parallel, HW, imbalance=imbalance, **kw)


def test_moe_layer_has_every_named_kind_and_comm_on_its_own_resource():
    graph = _graph()
    kinds = set(graph.kinds)
    expected = set(OP_KINDS) - {"mlp_fc1", "mlp_act", "mlp_fc2"}
    assert kinds == expected
    for op in graph.ops:
        assert (op.resource is Resource.COMM) == (op.kind in COMM_KINDS)
        if op.resource is Resource.COMM:
            assert op.saves == ()


def test_dense_layers_use_dense_mlp():
    model, parallel = presets.model("tiny-moe")  # first layer dense
    graph = build_graph(model, parallel, presets.hardware("cpu"), stage=0)
    layer0 = {op.kind for op in graph.ops if op.layer == 0}
    layer1 = {op.kind for op in graph.ops if op.layer == 1}
    assert {"mlp_fc1", "mlp_act", "mlp_fc2"} <= layer0 and "router" not in layer0
    assert "router" in layer1 and "mlp_fc1" not in layer1


def test_router_input_is_shared_in_two_precisions():
    graph = _graph()
    n2 = "L0.norm2_out"
    consumers = dict(graph.consumers(n2))
    assert consumers == {"L0.router": "fp32", "L0.shared_fc1": "bf16"}
    # the flash-attention output is kept by core attention and the out-projection: one copy
    assert {op for op, _ in graph.consumers("L0.attn_out_in")} == {"L0.core_attn", "L0.attn_out"}


@pytest.mark.parametrize("name", ["glm-188b-a20b", "glm-1041b-a35b", "tiny-moe"])
def test_routed_bytes_linear_in_imbalance_dense_unchanged(name):
    model, parallel = presets.model(name)
    hw = presets.hardware("cpu") if name.startswith("tiny") else HW
    stage = 1 if name == "tiny-moe" else 0
    if parallel.ep < 4:  # an imbalance is at most ep (all the load on one rank)
        parallel = dataclasses.replace(parallel, dp=4, ep=4)
    graphs = {r: build_graph(model, parallel, hw, imbalance=r, stage=stage) for r in (1.0, 1.5, 2.0, 2.5)}
    base = graphs[1.0]
    routed = base.routed_bytes
    assert routed > 0
    for r, graph in graphs.items():
        assert graph.routed_bytes == pytest.approx(r * routed, abs=model.hidden_size * 8)
        assert graph.unmitigated_bytes - graph.routed_bytes == base.unmitigated_bytes - base.routed_bytes
        dense_sizes = {n: t.numel for n, t in graph.tensors.items() if not t.routed}
        assert dense_sizes == {n: t.numel for n, t in base.tensors.items() if not t.routed}


def test_floor_is_full_recompute_and_minimum():
    graph = _graph()
    full = Plan.from_decisions({key: Strategy.RECOMPUTE for key in graph.decisions})
    cost = evaluate(graph, full)
    assert cost.activation_bytes == graph.floor_bytes
    # the least closure re-runs every op whose output backward needs: all but each layer's tail
    # (unpermute, shared_fc2, its tp_reduce and the final residual produce nothing that is saved)
    assert cost.num_recomputed_ops == len(graph.ops) - 4 * len(graph.layers)
    assert cost.unavailable == ()
    offload_all = Plan.uniform({kind: Strategy.OFFLOAD for kind in graph.kinds})
    assert evaluate(graph, offload_all).activation_bytes == graph.floor_bytes
    # kind-level RECOMPUTE re-runs ops from their kept inputs: it cannot reach the floor on its own
    assert evaluate(graph, Plan.uniform({k: "RECOMPUTE" for k in graph.kinds})).activation_bytes > graph.floor_bytes
    assert graph.floor_bytes < graph.unmitigated_bytes


def test_offload_and_quantize_transforms():
    graph = _graph()
    act = graph.op("L0.expert_act")
    (saving,) = act.saves
    tensor = graph.tensors[saving.tensor]
    keep = evaluate(graph)
    off = evaluate(graph, Plan.of({f"L0.expert_act/{saving.tensor}": Strategy.OFFLOAD}))
    assert keep.activation_bytes - off.activation_bytes == tensor.nbytes
    assert off.host_bytes == tensor.nbytes
    expected = tensor.nbytes / HW.d2h_bytes_per_s + tensor.nbytes / HW.h2d_bytes_per_s + 2 * HW.kernel_launch_s
    assert off.offload_s == pytest.approx(expected, rel=1e-6)
    assert off.resource_ns["d2h"] > 0 and off.resource_ns["h2d"] > 0
    quant = evaluate(graph, Plan.of({f"L0.expert_act/{saving.tensor}": Strategy.QUANTIZE}))
    assert keep.activation_bytes - quant.activation_bytes == tensor.nbytes - tensor.numel
    assert quant.quantize_ns > 0 and quant.overhead_ns == quant.quantize_ns


def test_conflicting_strategies_are_charged_truthfully():
    graph = _graph()
    keep = evaluate(graph)
    # multi-device: offloading the attention output at one consumer only frees nothing
    half = evaluate(graph, Plan.of({"L0.attn_out/L0.attn_out_in": "OFFLOAD"}))
    assert half.activation_bytes == keep.activation_bytes and half.offload_ns > 0
    both = evaluate(graph, Plan.of({"L0.attn_out/L0.attn_out_in": "O", "L0.core_attn/L0.attn_out_in": "O"}))
    assert both.activation_bytes == keep.activation_bytes - graph.tensors["L0.attn_out_in"].nbytes
    # multi-precision: quantizing the router input at the shared expert adds an FP8 copy
    quant = evaluate(graph, Plan.of({"L0.shared_fc1/L0.norm2_out": "QUANTIZE"}))
    numel = graph.tensors["L0.norm2_out"].numel
    assert quant.activation_bytes == keep.activation_bytes - 2 * numel + numel


def test_recompute_closure_reruns_producers_once():
    graph = _graph()
    plan = Plan.of({"L0.expert_fc2/L0.expert_act_out": "RECOMPUTE"})
    cost = evaluate(graph, plan)
    assert cost.num_recomputed_ops == 1
    assert cost.recompute_ns == graph.op("L0.expert_act").forward_ns
    # dropping fc1's output too forces fc1 to run again (its input is kept)
    plan2 = plan.with_decision("L0.expert_act", "L0.expert_fc1_out", Strategy.RECOMPUTE)
    cost2 = evaluate(graph, plan2)
    assert cost2.recompute_ns == graph.op("L0.expert_act").forward_ns + graph.op("L0.expert_fc1").forward_ns


def test_invalid_plan_entries_raise():
    graph = _graph()
    with pytest.raises(ValueError, match="does not save"):
        evaluate(graph, Plan.of({"L0.qkv/L0.v": "RECOMPUTE"}))
    with pytest.raises(ValueError, match="pinned"):
        evaluate(graph, Plan.of({"L0.norm1/L0.x": "OFFLOAD"}))
    with pytest.raises(ValueError, match="QUANTIZE"):
        evaluate(graph, Plan.of({"L0.permute/L0.routing_map": "QUANTIZE"}))
    # a kind policy skips where it does not apply
    assert evaluate(graph, Plan.uniform({"permute": "QUANTIZE"})).activation_bytes == graph.unmitigated_bytes


def test_times_and_resources_are_consistent():
    graph = _graph()
    cost = evaluate(graph, Plan.uniform({"core_attn": "RECOMPUTE", "expert_fc1": "OFFLOAD",
                                         "expert_act": "QUANTIZE"}))
    total = sum(cost.resource_ns.values())
    assert total == graph.forward_ns + graph.backward_ns + cost.overhead_ns
    assert cost.forward_ns + cost.backward_ns == total
    assert cost.overhead_s == pytest.approx(cost.recompute_s + cost.offload_s + cost.quantize_s)


def test_chunks_cover_all_layers_once():
    model, parallel = presets.model("glm-423b-a30b")
    seen = []
    for stage in range(parallel.pp):
        for chunk in range(parallel.vp):
            seen += list(build_graph(model, parallel, HW, stage=stage, chunk=chunk).layers)
    assert sorted(seen) == list(range(model.num_layers))


def test_ep_one_dispatch_is_launch_only():
    model, _ = presets.model("tiny-moe")
    graph = build_graph(model, ParallelConfig(pp=2, num_microbatches=4), presets.hardware("cpu"), stage=1)
    dispatch = next(op for op in graph.ops if op.kind == "dispatch")
    assert dispatch.forward_ns == round(presets.hardware("cpu").kernel_launch_s * 1e9)


def test_kind_level_recompute_is_selective_recompute_of_the_op():
    graph = _graph()
    resolved = resolve(graph, Plan.uniform({"core_attn": "RECOMPUTE"}))
    mitigated = {key for key, s in resolved.items() if s is Strategy.RECOMPUTE}
    # flash attention: its own output and log-sum-exp are dropped, its inputs q, k, v stay
    assert {("L0.core_attn", "L0.attn_lse"), ("L0.core_attn", "L0.attn_out_in")} <= mitigated
    assert ("L0.core_attn", "L0.q_rope") not in mitigated and ("L0.core_attn", "L0.v") not in mitigated
    # cheap elementwise kinds drop their output wherever it is kept (Megatron's moe_act / layernorm recompute)
    act = resolve(graph, Plan.uniform({"expert_act": "RECOMPUTE"}))
    assert act[("L0.expert_fc2", "L0.expert_act_out")] is Strategy.RECOMPUTE
    assert act[("L0.expert_act", "L0.expert_fc1_out")] is Strategy.KEEP
    norm = resolve(graph, Plan.uniform({"norm": "RECOMPUTE"}))
    assert norm[("L0.qkv", "L0.norm1_out")] is norm[("L0.router", "L0.norm2_out")] is Strategy.RECOMPUTE
    assert norm[("L0.norm1", "L0.x")] is Strategy.KEEP  # pinned block input
    # an explicit entry wins over the policy
    explicit = resolve(graph, Plan.of({"expert_act": "RECOMPUTE", "L0.expert_fc2/L0.expert_act_out": "OFFLOAD"}))
    assert explicit[("L0.expert_fc2", "L0.expert_act_out")] is Strategy.OFFLOAD


@pytest.mark.parametrize("flash", [True, False])
def test_a_flash_attention_backward_does_two_and_a_half_forwards_every_other_op_two(flash):
    """FlashAttention's backward re-computes the scores (five matrix products for the forward's two); a kernel that
    saved the probabilities, and every other compute op, does twice its forward. Core attention runs at the
    hardware's ``attention_efficiency``, every other op at its ``matmul_efficiency``."""
    model, parallel = presets.model("glm-423b-a30b")
    graph = build_graph(model.replace(flash_attention=flash), parallel, HW)
    launch_ns = HW.kernel_launch_s * 1e9
    for op in graph.ops:
        if op.resource is Resource.COMM:
            continue
        factor = 2.5 if flash and op.kind == "core_attn" else 2.0
        share = HW.attention_efficiency if op.kind == "core_attn" else HW.matmul_efficiency
        compute_ns = max(op.flops / (HW.peak_flops * share), op.moved_bytes / HW.hbm_bytes_per_s) * 1e9
        assert op.forward_ns == pytest.approx(launch_ns + compute_ns, abs=1)
        backward_ns = max(factor * op.flops / (HW.peak_flops * share), 2 * op.moved_bytes / HW.hbm_bytes_per_s)
        assert op.backward_ns == pytest.approx(launch_ns + backward_ns * 1e9, abs=1), op.name


@pytest.mark.parametrize("experts, top_k, ep", [(256, 6, 128), (128, 6, 64), (64, 4, 32), (8, 2, 1), (8, 2, 8),
                                                (16, 16, 4), (160, 8, 32), (12, 3, 4)])
def test_the_imbalance_limit_is_what_the_most_skewed_routing_gives(experts, top_k, ep):
    """Every token sends rank 0 as many of its top_k copies as rank 0 hosts experts for: the highest load routing
    can give one rank; build_graph takes exactly up to it."""
    from bagualu2.costmodel import check_imbalance, imbalance_limit
    from bagualu2.costmodel.build import limit_text

    model = presets.model("tiny-moe")[0].replace(num_experts=experts, top_k=top_k)
    parallel = ParallelConfig(dp=ep, ep=ep)
    tokens = 1000
    busiest = tokens * min(top_k, experts // ep)  # copies on rank 0
    mean = tokens * top_k / ep
    assert imbalance_limit(model, parallel) == pytest.approx(busiest / mean)
    limit = imbalance_limit(model, parallel)
    assert check_imbalance(limit, ep=ep, model=model) == limit
    shown = float(limit_text(limit))  # the upper end an error line prints is taken
    assert limit - 1e-4 < shown <= limit and check_imbalance(shown, ep=ep, model=model) == shown
    build_graph(model, parallel, presets.hardware("cpu"), imbalance=limit)
    with pytest.raises(ValueError, match="imbalance must be a finite number in"):
        build_graph(model, parallel, presets.hardware("cpu"), imbalance=limit * 1.01)
