"""The trainer's fixed policies are the simulator's plans on the run's cap, and the debug recipe's default cap
makes the comparison meaningful: static-under fits at balanced load and overflows on a spike, static-over always
fits."""

from __future__ import annotations


import pytest

from bagualu2.costmodel import build_graph, evaluate, presets, stage_memory
from bagualu2.sim import StageContext, make_policy
from reference_trainer.policies import FIXED, describe, fallback, fixed_plans
from reference_trainer.recipes import default_cap, recipe

CONFIG = recipe("glm_moe_debug")
HW = presets.hardware(CONFIG.hardware)
CAP = default_cap(CONFIG)


@pytest.mark.slow
@pytest.mark.parametrize("policy", FIXED)
def test_fixed_plans_are_the_simulators_on_the_cap(policy):
    config = CONFIG.with_overrides(policy=policy)
    for stage in range(config.pp):
        ctx = StageContext(config.model, config.parallel, HW, stage, m_max_bytes=CAP)
        assert fixed_plans(config, stage, CAP) == tuple(make_policy(policy, ctx).plans)
    assert len(describe(config, CAP)) == config.pp * config.vp


def _in_flight(policy: str, stage: int, imbalance: float) -> int:
    plan = fixed_plans(CONFIG.with_overrides(policy=policy), stage, CAP)[0]
    inflight = stage_memory(CONFIG.model, CONFIG.parallel, HW, stage=stage).inflight_chunks
    graph = build_graph(CONFIG.model, CONFIG.parallel, HW, imbalance=imbalance, stage=stage)
    return inflight * evaluate(graph, plan).activation_bytes


def test_default_cap_static_under_fits_balanced_and_overflows_a_spike_static_over_always_fits():
    spike = min(2.6, CONFIG.ep)
    assert all(_in_flight("static-under", s, 1.0) <= CAP for s in range(CONFIG.pp))
    assert any(_in_flight("static-under", s, spike) > CAP for s in range(CONFIG.pp))
    assert all(_in_flight("static-over", s, float(CONFIG.ep)) <= CAP for s in range(CONFIG.pp))


def test_fallbacks():
    assert fallback("static-under") == "static-over" and fallback("flexible") == "flexible"
    assert fixed_plans(CONFIG, 0, CAP) is None  # flexible plans at runtime


def test_static_over_is_full_layer_recompute_on_every_recipe_and_profile():
    """The paper's over-provisioning: every saving but the block inputs RECOMPUTE, down to the floor — on the CPU
    profile too, where offloading would look cheaper but frees nothing a CPU could use."""
    for name in ("glm_moe_debug", "glm_moe_bench"):
        config = recipe(name).with_overrides(policy="static-over")
        cap = default_cap(config)
        for stage in range(config.pp):
            graph = build_graph(config.model, config.parallel, HW, stage=stage)
            plan = fixed_plans(config, stage, cap)[0]
            assert {strategy.value for _, strategy in plan.entries} == {"RECOMPUTE"}
            assert len(plan.entries) == sum(1 for op, s in graph.savings if (op.name, s.tensor) not in graph.pinned)
            assert evaluate(graph, plan).activation_bytes == graph.floor_bytes


def test_bench_cap_runs_ordinary_micro_batches_unmitigated_and_makes_spikes_mitigate():
    """glm_moe_bench's default cap: the busiest stage keeps its in-flight micro-batches unmitigated up to the
    recipe's cap imbalance, and a spike (the most one EP rank can receive) does not fit there."""
    config = recipe("glm_moe_bench")
    cap = default_cap(config)
    kept = {}
    for stage in range(config.pp):
        inflight = stage_memory(config.model, config.parallel, HW, stage=stage).inflight_chunks
        for rate in (1.0, config.memory_cap_imbalance, float(config.ep)):
            graph = build_graph(config.model, config.parallel, HW, imbalance=rate, stage=stage)
            kept[stage, rate] = inflight * graph.unmitigated_bytes
    assert all(kept[s, r] <= cap for s in range(config.pp) for r in (1.0, config.memory_cap_imbalance))
    assert max(kept[s, config.memory_cap_imbalance] for s in range(config.pp)) == cap
    assert any(kept[s, float(config.ep)] > cap for s in range(config.pp))


def test_bench_cap_leaves_the_baselines_unmitigated_so_a_spike_overflows_them():
    """Under glm_moe_bench's cap an ordinary micro-batch fits unmitigated, so every baseline planned at balanced
    load runs nothing (kwai's search picks no checkpointing and alpha = 0, as its artifact's tuned runs do where
    memory allows), and the busiest stage's in-flight pair overflows with one spiked micro-batch."""
    config = recipe("glm_moe_bench")
    cap = default_cap(config)
    for policy in ("static-under", "kwai", "adapipe"):
        plans = [fixed_plans(config.with_overrides(policy=policy), s, cap) for s in range(config.pp)]
        assert all(plan.entries == () for stage in plans for plan in stage), policy
    overflow = []
    for stage in range(config.pp):
        one = {rate: build_graph(config.model, config.parallel, HW, imbalance=rate, stage=stage).unmitigated_bytes
               for rate in (1.0, float(config.ep))}
        inflight = stage_memory(config.model, config.parallel, HW, stage=stage).inflight_chunks
        overflow.append(one[float(config.ep)] + (inflight - 1) * one[1.0] > cap)
    assert any(overflow)
