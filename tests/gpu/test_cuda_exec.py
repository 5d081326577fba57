"""Plan execution on CUDA (copy streams, pinned pool, prefetch): bytes as predicted, host copies exact, re-runs
bitwise (``verify``), gradients as the plain run's.

Skipped without a CUDA device (CI has none); ``benchmarks/gpu/gpu_checks.py`` is the timed check. On CUDA, bf16
attention runs PyTorch's cuDNN (or flash) kernel, which keeps what the cost model lists plus, for cuDNN, two 8-byte
RNG-state tensors per call (unnamed, reported as unknown); its backward accumulates with atomics, so two plain runs
already differ in the last bits and gradients are compared by their relative error."""

import pytest
import torch

from bagualu2.costmodel import ParallelConfig, build_graph, evaluate, presets
from bagualu2.exec import apply_plan
from reference_trainer.instrumented import instrument_reference
from reference_trainer.model import GLMMoEModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CONFIG = presets.model("tiny-moe")[0].replace(seq_length=32, dtype="bf16")
GRAPH = build_graph(CONFIG, ParallelConfig(), presets.hardware("h100"))


def _run(plan, *, stash=None):
    torch.manual_seed(0)
    model = GLMMoEModel(CONFIG).cuda()
    instrument_reference(model)
    x = torch.randn(2, 32, CONFIG.hidden_size, device="cuda", requires_grad=True, dtype=torch.bfloat16)
    executor = apply_plan(GRAPH, plan, exclude=[model], verify=True)  # a re-run must match its forward bitwise
    if stash is not None:  # what each offload copies, read on the compute stream when it is saved
        offload = executor.engine.offload
        executor.engine.offload = lambda flat: (stash.append(flat.to("cpu", copy=True)), offload(flat))[1]
    with executor.micro_batch("mb") as record:
        out = model.forward_layers(x)
    torch.cuda.synchronize()
    hosts = [copy.host.clone() for copy in record.host_copies]
    executor.prefetch("mb")
    out.float().pow(2).mean().backward()
    executor.release("mb")
    return record, hosts, [x.grad] + [q.grad for q in model.parameters() if q.grad is not None]


@pytest.mark.parametrize("plan", ["core_attn=OFFLOAD,norm=OFFLOAD", "expert_act=RECOMPUTE,core_attn=RECOMPUTE",
                                  "norm=RECOMPUTE,expert_fc1=OFFLOAD,shared_fc1=OFFLOAD"])
def test_cuda_plan_matches_prediction_copies_exactly_and_keeps_gradients(plan):
    stash = []
    record, hosts, grads = _run(plan, stash=stash)
    _, _, plain = _run("none")
    assert set(record.unknown_ops) <= {f"L{i}.core_attn" for i in range(CONFIG.num_layers)}
    assert record.unknown_bytes <= 16 * CONFIG.num_layers
    assert record.device_bytes - record.unknown_bytes == evaluate(GRAPH, plan).activation_bytes
    assert len(hosts) == len(stash)
    assert all(torch.equal(host, original) for host, original in zip(hosts, stash))
    for got, want in zip(grads, plain):  # bf16: a few ulps of difference from the atomics, nothing more
        assert float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)) < 1e-2


def test_cuda_fp32_grouped_attention_rerun_is_refused_in_forward():
    """fp32 attention with grouped queries took PyTorch's math path on CUDA (2.11, H200; forced here, whatever a
    later PyTorch picks): a re-run of it is refused at the end of the forward with a clear error, not mid-backward."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    config = CONFIG.replace(dtype="fp32")
    graph = build_graph(config, ParallelConfig(), presets.hardware("h100"))
    model = GLMMoEModel(config).cuda()
    instrument_reference(model)
    x = torch.randn(2, 32, config.hidden_size, device="cuda", requires_grad=True)
    executor = apply_plan(graph, "core_attn=RECOMPUTE", exclude=[model])
    with sdpa_kernel([SDPBackend.MATH]), pytest.raises(ValueError, match="math path"):
        with executor.micro_batch("mb"):
            model.forward_layers(x)
