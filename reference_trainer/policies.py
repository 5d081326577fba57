"""The trainer's provisioning policies (the simulator's, :mod:`bagualu2.sim.policies`, on the run's activation cap).

* ``flexible``      bagualu2: per-micro-batch budgets, plans and gate decisions (:mod:`.provision`), plus a safety
                    net the paper lacks: a micro-batch that still overflows the cap (a misprediction) is freed and
                    re-run with full recompute, no restart.
* ``static-under``  one plan per chunk fixed before training for balanced load: ``greedy.solve`` on the graph at
                    r = 1 with ``cap // in-flight chunks``; it fits at r = 1 and overflows on spikes: out of memory
                    -> exit code ``OOM_EXIT_CODE`` -> ``torchrun --max-restarts`` restarts the workers, which resume
                    from the latest checkpoint with ``static-over`` (the paper's operator).
* ``static-over``   full recompute of every chunk (sized for the worst case).
* ``kwai``          Megatron-Kwai's configuration search, fixed at r = 1: no checkpointing or its balanced one
                    (recompute of norms and activation functions), each plus offload of a uniform fraction alpha of
                    the tensors it keeps, alpha the smallest multiple of 0.05 that fits; the faster level that
                    fits. A chunk that fits unmitigated runs nothing, and overflows on spikes like static-under.
* ``adapipe``       AdaPipe: recompute only, fixed before training at r = 1, tensors with the most bytes freed per
                    added recompute time first, until the chunk fits.
* ``ideal``         no cap, no mitigation (the upper limit; memory may exceed the cap).

The plans of the fixed policies are exactly the simulator's (``bagualu2.sim.make_policy`` on a stage context whose
``M_max`` is the cap); ``describe`` prints them stage by stage. So is the order each runs a fused point in
(``bagualu2.sim.native_execution``): ``flexible`` and ``ideal`` the fusion DP's, the baselines Megatron-Core's combined 1F1B (one
micro-batch's all-to-alls beside the other's compute, copies beside compute, recompute before the backward that
needs it; no pairing where the recovery re-runs an all-to-all), the overlap their real systems have.
"""

from __future__ import annotations


from bagualu2.costmodel import Plan, presets
from bagualu2.sim import FALLBACKS, StageContext, make_policy

POLICIES = ("flexible", "static-under", "static-over", "kwai", "adapipe", "ideal")
FIXED = ("static-under", "static-over", "kwai", "adapipe", "ideal")
OOM_EXIT_CODE = 75  # EX_TEMPFAIL: the workers ran out of activation memory; torchrun may restart them


def fallback(policy: str) -> str:
    """What a restarted run continues with after an out-of-memory error (static-under -> static-over)."""
    return FALLBACKS.get(policy, policy)


def fixed_plans(config, stage: int, cap_bytes: int) -> tuple[Plan, ...] | None:
    """Per chunk of ``stage``, the plan a fixed policy runs (None for ``flexible``)."""
    if config.policy not in FIXED:
        return None
    ctx = StageContext(config.model, config.parallel, presets.hardware(config.hardware), stage, m_max_bytes=cap_bytes)
    return tuple(make_policy(config.policy, ctx).plans)


def describe(config, cap_bytes: int) -> dict[str, list[str]]:
    """``{"stage s chunk c": plan text}`` of a fixed policy (what the notes of the comparison table show)."""
    out = {}
    for stage in range(config.pp):
        plans = fixed_plans(config, stage, cap_bytes)
        for chunk, plan in enumerate(plans or ()):
            out[f"stage {stage} chunk {chunk}"] = str(plan) or "none"
    return out
