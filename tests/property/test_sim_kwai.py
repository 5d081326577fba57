"""Megatron-Kwai's configuration search (``bagualu2.sim.policies.Kwai``) against brute force over every
(checkpointing level, alpha) it may run: the chosen plan fits whenever any does, is the smallest fitting alpha of
its level and never slower than the other level's, and is nothing at all when the chunk fits unmitigated."""

from __future__ import annotations

import math

import pytest
from conftest import scaled
from hypothesis import given, settings
from hypothesis import strategies as st

from bagualu2.costmodel import Plan, Strategy, presets, resolve
from bagualu2.sim.policies import KWAI_BASE, KWAI_STEPS, NO_PLAN, Kwai, make_policy
from bagualu2.sim.stage import StageContext

MODEL, PARALLEL = presets.model("glm-188b-a20b")
HW = presets.hardware("paper-gpu")


def context(stage: int, cap_fraction: float) -> StageContext:
    """Stage ``stage`` with an activation capacity of ``cap_fraction`` x its unmitigated in-flight chunks."""
    ctx = StageContext(MODEL, PARALLEL, HW, stage)
    unmitigated = max(ctx.graph(chunk, 1.0).unmitigated_bytes for chunk in range(PARALLEL.vp))
    return StageContext(MODEL, PARALLEL, HW, stage, m_max_bytes=int(cap_fraction * unmitigated * ctx.inflight))


def every_configuration(ctx: StageContext, chunk: int):
    """``(level, alpha, plan)`` for both checkpointing levels and every alpha, written out from the definition:
    the level's plan plus OFFLOAD of every saving of the first ceil(alpha * n) tensors it keeps, graph order."""
    graph = ctx.graph(chunk, 1.0)
    pinned = {tensor for _, tensor in graph.pinned}
    for level, base in (("none", NO_PLAN), ("balanced", KWAI_BASE)):
        strategies = resolve(graph, base)
        tensors: dict[str, list[str]] = {}
        for op, saving in graph.savings:
            if saving.tensor not in pinned:
                tensors.setdefault(saving.tensor, []).append(f"{op.name}/{saving.tensor}")
        kept = [keys for keys in tensors.values() if all(strategies[tuple(k.split("/", 1))] is Strategy.KEEP
                                                          for k in keys)]
        for step in range(KWAI_STEPS + 1):
            count = math.ceil(step * len(kept) / KWAI_STEPS)
            offloaded = tuple((k, Strategy.OFFLOAD) for keys in kept[:count] for k in keys)
            yield level, step / KWAI_STEPS, Plan(base.entries + offloaded)


@pytest.mark.slow
@settings(max_examples=scaled(12), deadline=None)
@given(st.integers(0, PARALLEL.pp - 1), st.floats(0.05, 1.3, allow_nan=False))
def test_kwai_picks_the_fastest_fitting_configuration(stage, cap_fraction):
    ctx = context(stage, cap_fraction)
    policy = make_policy("kwai", ctx)
    assert isinstance(policy, Kwai)
    for chunk, plan in enumerate(policy.plans):

        def seconds(candidate: Plan) -> float:
            choice = policy.run(chunk, 1.0, candidate)
            return choice.forward_s + choice.backward_s

        fitting = [(level, alpha, candidate) for level, alpha, candidate in every_configuration(ctx, chunk)
                   if ctx.cost(chunk, 1.0, candidate).activation_bytes <= ctx.per_chunk_bytes]
        if not fitting:
            assert (policy.levels[chunk], policy.alphas[chunk]) == ("balanced", 1.0)
            continue
        smallest = {}  # per level, its smallest fitting alpha
        for level, alpha, candidate in fitting:
            smallest.setdefault(level, (level, alpha, candidate))
        chosen = (policy.levels[chunk], policy.alphas[chunk], plan)
        assert chosen in smallest.values()
        assert ctx.cost(chunk, 1.0, plan).activation_bytes <= ctx.per_chunk_bytes
        assert seconds(plan) <= min(seconds(candidate) for _, _, candidate in smallest.values())
        if "none" in smallest and seconds(smallest["none"][2]) == seconds(plan):
            assert policy.levels[chunk] == "none"  # a tie: no checkpointing


def test_a_chunk_that_fits_unmitigated_runs_nothing_and_a_tight_one_mitigates():
    roomy = make_policy("kwai", context(0, 1.0))
    assert all(plan == NO_PLAN for plan in roomy.plans)
    assert set(roomy.levels.values()) == {"none"} and set(roomy.alphas.values()) == {0.0}
    tight = make_policy("kwai", context(0, 0.6))
    ctx = tight.ctx
    for chunk, plan in enumerate(tight.plans):
        assert plan != NO_PLAN
        assert ctx.cost(chunk, 1.0, plan).activation_bytes <= ctx.per_chunk_bytes
