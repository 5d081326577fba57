"""Plan execution on CUDA (copy streams, pinned pool, prefetch): bytes as predicted, OFFLOAD/RECOMPUTE bitwise.

Skipped without a CUDA device (CI has none); ``benchmarks/gpu/gpu_checks.py`` is the timed check."""

import pytest
import torch

from bagualu2.costmodel import ParallelConfig, build_graph, evaluate, presets
from bagualu2.exec import apply_plan
from reference_trainer.instrumented import instrument_reference
from reference_trainer.model import GLMMoEModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("plan", ["core_attn=OFFLOAD,norm=OFFLOAD", "expert_act=RECOMPUTE,core_attn=RECOMPUTE"])
def test_cuda_plan_matches_prediction_and_plain_gradients(plan):
    config = presets.model("tiny-moe")[0].replace(seq_length=32)
    graph = build_graph(config, ParallelConfig(), presets.hardware("h100"))

    def run(p):
        torch.manual_seed(0)
        model = GLMMoEModel(config).cuda()
        instrument_reference(model)
        x = torch.randn(2, 32, config.hidden_size, device="cuda", requires_grad=True)
        executor = apply_plan(graph, p, exclude=[model])
        with executor.micro_batch("mb") as record:
            out = model.forward_layers(x)
        executor.prefetch("mb")
        out.pow(2).mean().backward()
        executor.release("mb")
        return record, [x.grad] + [q.grad for q in model.parameters() if q.grad is not None]

    record, grads = run(plan)
    _, plain = run("none")
    assert record.device_bytes == evaluate(graph, plan).activation_bytes
    assert all(torch.equal(a, b) for a, b in zip(grads, plain))
