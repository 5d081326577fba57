"""A hypothesis strategy shared by the random-plan property tests: one strategy per traced tensor, shared by its
consumers (KEEP, OFFLOAD, QUANTIZE where every consumer may be quantised, RECOMPUTE where a mapped module made
it)."""

from __future__ import annotations

from hypothesis import strategies as st

from bagualu2.costmodel import OpGraph, Plan, Strategy


def per_tensor_plan(draw, graph: OpGraph) -> Plan:
    savings = {(op.name, s.tensor): s for op, s in graph.savings}
    entries = []
    for tensor in dict.fromkeys(t for _, t in graph.decisions):
        consumers = [key for key in graph.decisions if key[1] == tensor]
        choices = [Strategy.KEEP, Strategy.OFFLOAD]
        if graph.tensors[tensor].producer is not None:
            choices.append(Strategy.RECOMPUTE)
        if all(graph.quantizable(savings[key]) for key in consumers):
            choices.append(Strategy.QUANTIZE)
        strategy = draw(st.sampled_from(choices))
        if strategy is not Strategy.KEEP:
            entries.extend((f"{op}/{t}", strategy) for op, t in consumers)
    return Plan(tuple(entries))
