"""Random per-saving plans on the reference model: the executor keeps exactly what the evaluator charges.

tiny-moe in FP32 and BF16 (the router's FP32 copy of a BF16 input), tiny-dense in BF16. Any mix of KEEP / RECOMPUTE / OFFLOAD /
QUANTIZE per saving (conflicting ones included: a tensor kept at one
consumer and recomputed or offloaded at another) must give measured device and host bytes equal to
``evaluate(graph, plan)``, backward FLOPs added equal to ``recompute_flops``, and — without QUANTIZE — gradients
bitwise equal to the plain run.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from conftest import scaled
from hypothesis import strategies as st

from bagualu2.costmodel import ParallelConfig, Plan, Strategy, build_graph, evaluate, presets
from exec_run import run_plan

CONFIGS = {dtype: presets.model("tiny-moe")[0].replace(seq_length=16, dtype=dtype) for dtype in ("fp32", "bf16")}
CONFIGS["dense-bf16"] = presets.model("tiny-dense")[0].replace(seq_length=16, dtype="bf16")
GRAPHS = {dtype: build_graph(config, ParallelConfig(), presets.hardware("cpu")) for dtype, config in CONFIGS.items()}


def _run(dtype, plan):
    record, _, grads, flops = run_plan(CONFIGS[dtype], GRAPHS[dtype], plan)
    return record, list(grads.values()), flops


PLAIN: dict = {}


@st.composite
def plans(draw):
    dtype = draw(st.sampled_from(sorted(CONFIGS)))
    graph = GRAPHS[dtype]
    savings = {(op.name, s.tensor): s for op, s in graph.savings}
    entries = []
    for key in graph.decisions:
        choices = [Strategy.KEEP, Strategy.RECOMPUTE, Strategy.OFFLOAD]
        if graph.quantizable(savings[key]) and draw(st.booleans()):
            choices.append(Strategy.QUANTIZE)
        strategy = draw(st.sampled_from(choices))
        if strategy is not Strategy.KEEP:
            entries.append((f"{key[0]}/{key[1]}", strategy))
    return dtype, Plan(tuple(entries))


@pytest.mark.slow
@settings(max_examples=scaled(12))
@given(plans())
def test_random_plans_match_the_evaluator(case):
    dtype, plan = case
    if dtype not in PLAIN:
        PLAIN[dtype] = _run(dtype, None)
    _, grads0, flops0 = PLAIN[dtype]
    cost = evaluate(GRAPHS[dtype], plan)
    record, grads, flops = _run(dtype, plan)
    assert record.unknown_count == 0
    assert record.device_bytes == cost.activation_bytes
    assert record.host_bytes == cost.host_bytes
    assert flops - flops0 == cost.recompute_flops
    if not any(s is Strategy.QUANTIZE for _, s in plan.entries):
        assert all(torch.equal(a, b) for a, b in zip(grads0, grads))
