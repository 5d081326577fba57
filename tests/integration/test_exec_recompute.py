"""RECOMPUTE on the reference model (CPU): replays in backward vs the cost model.

* measured device bytes == ``evaluate(graph, plan).activation_bytes`` for plans with RECOMPUTE (kind policies,
  explicit savings, closures over several ops, mixed with OFFLOAD / QUANTIZE);
* loss and every gradient bitwise equal to the unmitigated run (RECOMPUTE and OFFLOAD only);
* the FLOPs backward adds (``FlopCounterMode``, with the attention convention of ``bagualu2.exec.flop_counter``)
  equal the cost model's ``recompute_flops``, and each re-run op runs once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bagualu2.costmodel import ParallelConfig, build_graph, evaluate, presets
from bagualu2.costmodel.evaluate import mitigation_ops
from bagualu2.exec import apply_plan, flop_counter
from exec_run import run_plan
from reference_trainer.instrumented import instrument_reference
from reference_trainer.model import GLMMoEModel

SEQ = 32
RECOMPUTE_PLANS = [
    "core_attn=RECOMPUTE",
    "expert_act=RECOMPUTE,mlp_act=RECOMPUTE",
    "norm=RECOMPUTE",
    "core_attn=RECOMPUTE,norm=OFFLOAD",
    "L1.attn_out/L1.attn_out_in=RECOMPUTE,L1.core_attn/L1.attn_out_in=RECOMPUTE",       # o regenerated
    "L1.qkv/L1.norm1_out=RECOMPUTE,L2.core_attn/L2.attn_lse=RECOMPUTE",
    "L2.expert_fc2/L2.expert_act_out=RECOMPUTE,L2.expert_act/L2.expert_fc1_out=RECOMPUTE",  # fc1 + act re-run
    "L2.unpermute/L2.combined=RECOMPUTE,expert_fc1=QUANTIZE",
]
FULL = "ALL"  # every non-pinned saving RECOMPUTE: full recompute from the block inputs


def _setup(preset: str):
    dtype = "bf16" if preset.endswith("-bf16") else None  # the router keeps an FP32 copy of its BF16 input
    config, _ = presets.model(preset.removesuffix("-bf16"))
    config = config.replace(seq_length=SEQ, **({"dtype": dtype} if dtype else {}))
    return config, build_graph(config, ParallelConfig(), presets.hardware("cpu"))


def _plan(graph, plan: str) -> str:
    if plan != FULL:
        return plan
    return ",".join(f"{op}/{tensor}=RECOMPUTE" for op, tensor in graph.decisions)


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["tiny-moe", "tiny-dense", "tiny-moe-bf16"])
@pytest.mark.parametrize("plan", [*RECOMPUTE_PLANS, FULL])
def test_recompute_bytes_gradients_and_flops(preset, plan):
    config, graph = _setup(preset)
    try:
        plan = _plan(graph, plan)
        cost = evaluate(graph, plan)
    except ValueError:
        pytest.skip("the plan names ops of the other preset")
    _, loss0, grads0, flops0 = run_plan(config, graph, None)
    record, loss1, grads1, flops1 = run_plan(config, graph, plan)
    assert record.unknown_count == 0
    assert record.device_bytes == cost.activation_bytes, (record.device_bytes, cost.activation_bytes)
    assert record.host_bytes == cost.host_bytes
    assert cost.activation_bytes < graph.unmitigated_bytes
    assert torch.equal(loss0, loss1)
    quantized = "QUANTIZE" in plan
    for name, g0 in grads0.items():
        if quantized:
            assert (grads1[name] - g0).norm() <= 0.1 * g0.norm() + 1e-12, name
        else:
            assert torch.equal(g0, grads1[name]), name
    # the FLOPs backward added are the re-run ops' matmul and attention FLOPs, each op once
    assert flops1 - flops0 == cost.recompute_flops
    rerun = set(mitigation_ops(graph, plan).rerun)
    # at EP=1 dispatch is the identity: its output is permute's, so re-running permute regenerates it
    replayed = {op for op in rerun if not op.endswith(".dispatch")}
    assert {r.op for r in record.replays if r.runs} == replayed
    assert all(r.runs == 1 for r in record.replays if r.op in replayed)


@pytest.mark.slow
def test_full_recompute_reaches_the_floor():
    config, graph = _setup("tiny-moe")
    plan = _plan(graph, FULL)
    record, _, _, _ = run_plan(config, graph, plan)
    assert record.device_bytes == graph.floor_bytes == evaluate(graph, plan).activation_bytes


def test_recompute_flops_are_counted_for_attention_too():
    """The cost model's causal attention FLOPs (half of QK^T + PV) are what the counter reports for SDPA."""
    config, graph = _setup("tiny-dense")
    cost = evaluate(graph, "core_attn=RECOMPUTE")
    attention = sum(op.flops for op in graph.ops if op.kind == "core_attn")
    assert cost.recompute_flops == attention > 0
    q = torch.randn(2, 4, SEQ, 8)
    with flop_counter() as counter:
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert counter.get_total_flops() == 2 * 2 * 4 * SEQ * SEQ * 8


def test_apply_plan_takes_the_model_itself():
    """``apply_plan(model, plan)``: the graph of all its layers, its parameters excluded."""
    config, graph = _setup("tiny-moe")
    torch.manual_seed(0)
    model = GLMMoEModel(config)
    instrument_reference(model)
    executor = apply_plan(model, "expert_act=RECOMPUTE,core_attn=OFFLOAD")
    x = torch.randn(config.micro_batch_size, config.seq_length, config.hidden_size, requires_grad=True)
    with executor.micro_batch("mb") as record:
        out = model.forward_layers(x)
    out.pow(2).mean().backward()
    assert record.unknown_count == 0
    assert record.device_bytes == evaluate(graph, "expert_act=RECOMPUTE,core_attn=OFFLOAD").activation_bytes
    with pytest.raises(ValueError, match="OpGraph or a model"):
        apply_plan("tiny-moe", "none")
    with pytest.raises(ValueError, match="has no bagualu2 ModelConfig as its .config.; pass the InstrumentedModel"):
        apply_plan(torch.nn.Linear(2, 2), "none")


def test_a_rerun_whose_input_was_never_saved_is_refused_at_the_end_of_the_forward():
    """PyTorch's math attention (fp32 with grouped queries on CUDA takes it) keeps the probabilities and the expanded
    keys and values, not q, k, v: those savings are unnamed (kept and counted as unknown), and a plan that re-runs
    core attention, whose inputs no op then saved, is refused when the forward ends, not mid-backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config = presets.model("tiny-moe")[0].replace(seq_length=32)
    graph = build_graph(config, ParallelConfig(), presets.hardware("h100"))
    torch.manual_seed(0)
    model = GLMMoEModel(config)
    instrument_reference(model)
    x = torch.randn(2, 32, config.hidden_size, requires_grad=True)
    with sdpa_kernel([SDPBackend.MATH]):
        executor = apply_plan(graph, "norm=OFFLOAD", exclude=[model])
        with executor.micro_batch("mb") as record:
            out = model.forward_layers(x)
        out.pow(2).mean().backward()  # keeping and offloading still work; the unnamed bytes are reported
        assert record.unknown_bytes > 0 and set(record.unknown_ops) >= {"L0.core_attn"}
        assert record.device_bytes > evaluate(graph, "norm=OFFLOAD").activation_bytes
        executor = apply_plan(graph, "core_attn=RECOMPUTE", exclude=[model])
        with pytest.raises(ValueError, match=r"re-runs L0\.core_attn, whose input L0\.\w+ no op saved.*math path"):
            with executor.micro_batch("mb"):
                model.forward_layers(x)
        assert "mb" not in executor
