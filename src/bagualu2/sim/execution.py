"""How a stage's steps run on the device: one execution model for every policy.

Every step of a stage (a warmup forward, a steady forward/backward pair, a cooldown backward) is the chains of its
scheduling point (``fusion.build_chains``: F, B, the device->host copies O, the recovery R) run in an order of
barrier groups; a group takes its busiest resource (compute stream, communication stream, the two copy engines),
except that compute runs slower while communication runs beside it (``COMM_SM_SHARE``, below). What differs
between policies is only the order, i.e. the overlap their real systems have:

* ``megatron`` (Megatron-Core, the base of every static policy, of Megatron-Kwai and of the ablation levels
  L1-L3): ``fusion.baselines.megatron_overlapped`` — in a steady pair the expert-parallel all-to-all of one
  micro-batch runs beside the other's compute (combined 1F1B, ``--overlap-moe-expert-parallel-comm``) unless the
  recovery re-runs an all-to-all (full or layer-level recompute: Megatron-Core refuses the overlap then); offload
  copies and reloads run on copy streams beside compute (Megatron-Kwai's pipeline-aware offloading prefetches
  the next backward's tensors): ``max(compute, copy)``, not the sum; recompute and dequantise casts run on the
  compute stream before the backward that needs them.
* ``fused`` (bagualu2, ``oracle``, ``ideal``): the fused dual-batch DP's order (``runtime.Stage.order``), which
  also places recompute, casts and copies of adjacent micro-batches beside communication (§V-B).
* ``megatron-unpaired``: ``megatron`` without the combined-1F1B pairing (F then B at every point), the copies
  still on copy streams beside compute: the baselines as their open-source releases ran (Megatron-Kwai's of May
  2024 and AdaPipe's of 2024 predate ``--overlap-moe-expert-parallel-comm``, Megatron-Core 0.14, 2025-09).
* ``serial``: one stage at a time, nothing overlaps (every step the sum of its ops).
* ``fused-pairs``: the DP's order for steady pairs, the other steps serial (the fused policies under
  ``"fused-only"``).

At one chunk per stage with pp > 1 a ``megatron`` policy runs ``megatron-unpaired`` under every model: Megatron-Core
requires virtual pipeline stages for its combined 1F1B there (a pair that waits for both its inputs would make the
stages wait for each other, docs/sim.md "Time").

``OVERLAP`` switches the model for a whole simulation: ``"real"`` (default) as above; ``"released"``: as
``"real"`` but every ``megatron`` policy ``megatron-unpaired`` (a bound: the paper does not say which Megatron its
baselines ran on); ``"fused-only"``: the static
policies serial, the fused ones ``fused-pairs``, no interference (the model in which only bagualu2's own steady
pairs overlap);
``"none"``: every policy serial.

Interference: a communication kernel occupies streaming multiprocessors, so compute that overlaps it runs at
``1 - COMM_SM_SHARE`` of its speed while it lasts (DeepSeek-V3's report: 20 of an H800's 132 SMs drive its
all-to-all; ``fusion.interference`` times a group so, ``makespan_ns`` an order). The fused DP orders for the
same slowdown (``fusion.dp.solve(..., share=)``), so a fused point is never slower than Megatron-Core's order of
the same plans. Copies use the copy engines and take no SMs (their HBM traffic is not modelled). Tensor-parallel
collectives stay on the compute stream (synchronous; ``--tp-comm-overlap`` is not modelled, for any policy).
"""

from __future__ import annotations

from ..fusion import Chains, Order
from ..fusion.baselines import megatron_overlapped_groups

OVERLAP = ("real", "released", "fused-only", "none")
EXECUTIONS = ("serial", "megatron", "megatron-unpaired", "fused", "fused-pairs")
COMM_SM_SHARE = 20 / 132  # DeepSeek-V3 technical report §3.2.2: 20 SMs of 132 run the all-to-all kernels


def check_overlap(overlap: str) -> str:
    if overlap not in OVERLAP:
        raise ValueError(f"overlap must be one of {', '.join(OVERLAP)}, got {overlap!r}")
    return overlap


def execution_of(native: str, overlap: str, *, virtual_stages: bool = True) -> str:
    """The execution a policy whose real system runs ``native`` gets under ``overlap``; ``virtual_stages``: whether
    the layout has them or needs none (vp > 1 or pp = 1): Megatron-Core's combined 1F1B requires them
    (``TransformerConfig`` asserts a virtual pipeline size with ``--overlap-moe-expert-parallel-comm`` when
    pp > 1), so without them a ``megatron`` policy runs F then B."""
    if overlap == "none":
        return "serial"
    if overlap == "fused-only":
        return "fused-pairs" if native == "fused" else "serial"
    if native == "megatron" and (overlap == "released" or not virtual_stages):
        return "megatron-unpaired"
    return native


def interference_of(overlap: str) -> float:
    """The compute slowdown share while communication overlaps: ``COMM_SM_SHARE`` under ``"real"`` and
    ``"released"``, else 0."""
    return COMM_SM_SHARE if overlap in ("real", "released") else 0.0


def order_of(execution: str, chains: Chains, fused, *, own_copies: bool = False) -> Order:
    """The order ``execution`` runs ``chains`` in (its groups; ``makespan_ns`` times them); ``fused(chains)`` is the
    DP (the stage engine's memoised one); ``own_copies``: the copies are the point's own micro-batches' (a stage
    whose points are of relation 1), which the Megatron executions then run after what they copy and before what
    reads them (``fusion.baselines.with_copies``)."""
    if execution == "fused" or (execution == "fused-pairs" and chains.forward and chains.backward):
        return fused(chains)
    if execution in ("megatron", "megatron-unpaired"):
        return Order(megatron_overlapped_groups(chains, pair=execution == "megatron", own=own_copies), barriers=True,
                     solver="megatron-overlapped" if execution == "megatron" else execution)
    return Order(tuple(((chain.kind, i),) for chain in chains.present() for i in range(len(chain))), barriers=True,
                 solver="sequential")
