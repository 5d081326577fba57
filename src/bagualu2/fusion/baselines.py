"""Baseline orders the DP is compared against; all are barrier-group orders costed by :func:`simulate`."""

from __future__ import annotations

from ..costmodel import Resource
from .chains import Chains, check_chains
from .order import Order, StageRef
from .simulate import simulate


def _finish(groups: list[tuple[StageRef, ...]], chains: Chains, solver: str) -> Order:
    order = Order(tuple(groups), barriers=True, solver=solver)
    return Order(order.groups, barriers=True, makespan_ns=simulate(order, chains).makespan_ns, solver=solver)


def _singles(chains: Chains, kind: str) -> list[tuple[StageRef, ...]]:
    chain = chains.get(kind)
    return [((kind, i),) for i in range(len(chain))] if chain is not None else []


def sequential(chains: Chains) -> Order:
    """F, then B, then O, then R, one stage at a time."""
    check_chains(chains)
    return _finish([g for kind in "FBOR" for g in _singles(chains, kind)], chains, "sequential")


def _pair_f_b(chains: Chains) -> list[tuple[StageRef, ...]]:
    """Megatron-Core's combined 1F1B: overlap a forward stage with a backward stage on the other stream
    (F.attn with B.combine, F.dispatch with B.expert, F.expert with B.dispatch, F.combine with B.attn)."""
    f = chains.forward.stages if chains.forward else ()
    b = chains.backward.stages if chains.backward else ()
    groups: list[tuple[StageRef, ...]] = []
    i = j = 0
    while i < len(f) or j < len(b):
        if i < len(f) and j < len(b) and f[i].resource is not b[j].resource:
            groups.append((("F", i), ("B", j)))
            i, j = i + 1, j + 1
        elif i < len(f) and (j >= len(b) or f[i].resource is not Resource.COMM or b[j].resource is Resource.COMM):
            groups.append((("F", i),))
            i += 1
        else:
            groups.append((("B", j),))
            j += 1
    return groups


def megatron_core(chains: Chains) -> Order:
    """Megatron-Core's fixed combined-1F1B order for F and B; offload and recovery after them (an order to compare
    with; the simulator runs Megatron-Core as :func:`megatron_overlapped`, which also knows when the pairing is
    refused)."""
    check_chains(chains)
    return _finish(_pair_f_b(chains) + _singles(chains, "O") + _singles(chains, "R"), chains, "megatron-core")


def megatron_overlapped(chains: Chains, *, pair: bool = True, own: bool = False) -> Order:
    """Megatron-Core with its copies on copy streams: the combined-1F1B F/B groups, each joined by the next
    device->host copy of O and the next host->device reload at the head of R (copy engines beside compute:
    ``max(compute, copy)`` per group, not the sum); what is left of O, then the rest of R (dequantise casts and
    recomputed ops, on the compute stream before the backward that needs them) one stage at a time after.
    ``pair=False``: F then B (as where R re-runs an all-to-all; a caller whose plan re-runs one outside R, inside
    B, says so). ``own``: the copies are F's and B's own (a point of pipeline degree 1, :func:`with_copies`)."""
    check_chains(chains)
    return _finish(list(megatron_overlapped_groups(chains, pair=pair, own=own)), chains, "megatron-overlapped")


def megatron_overlapped_groups(chains: Chains, *, pair: bool = True, own: bool = False
                               ) -> tuple[tuple[StageRef, ...], ...]:
    """The groups of :func:`megatron_overlapped`, without timing them. A point whose recovery re-runs an
    expert-parallel all-to-all (full-layer recompute, or a recomputed MoE dispatch or combine) is not paired: Megatron-Core
    refuses its all-to-all overlap (``--overlap-moe-expert-parallel-comm``) with full recomputation, a recompute
    method or layer count, and a recomputed ``moe`` module (``TransformerConfig``'s checks), so F and B run one
    after the other, each still joined by the copies. ``pair=False``: never paired (a Megatron release before
    that overlap, Megatron-Core 0.14), the copies still beside compute; ``own``: as :func:`with_copies`."""
    check_chains(chains)
    groups = (_singles(chains, "F") + _singles(chains, "B") if not pair or reruns_all_to_all(chains)
              else _pair_f_b(chains))
    return with_copies(groups, chains, own=own)


def combined_1f1b_groups(chains: Chains) -> tuple[tuple[StageRef, ...], ...]:
    """Megatron-Core's combined-1F1B groups of F and B alone (each forward stage beside a backward stage on the
    other stream where it can be)."""
    return tuple(_pair_f_b(chains))


def with_copies(groups, chains: Chains, *, own: bool = False) -> tuple[tuple[StageRef, ...], ...]:
    """``groups`` (an order of F and B) with the copies on copy streams beside them: each group in turn joined by
    the next device->host copy of O and the next host->device reload at the head of R; what is left of O, then
    the rest of R (dequantise casts, recomputed ops) one stage at a time after.

    ``own``: the copies are F's and B's own micro-batches' (a point of pipeline degree 1), so they follow their
    data: O's pieces cut F's tensors in program order, so piece k (of n) joins a group only after the one holding
    the F stage that completes the first (k+1)/n of F's stages; the reloads are taken in the order the backward
    reads them, so reload k (of h) runs in a group before the one holding B stage floor(k * |B| / h), alone right
    before it when no group is left. The rest of R stays after B (its compute would run on the compute stream
    before the backward stage that needs it; its place there changes no time)."""
    check_chains(chains)
    reloads = 0
    if chains.recovery:
        while reloads < len(chains.recovery) and chains.recovery.stages[reloads].resource is Resource.H2D:
            reloads += 1
    return tuple((_join_own if own else _join)([list(group) for group in groups], chains, reloads))


def _join_own(groups: list[list[StageRef]], chains: Chains, reloads: int) -> list[tuple[StageRef, ...]]:
    """:func:`with_copies` with ``own=True``."""
    forward, backward = (len(chain) if chain else 0 for chain in (chains.forward, chains.backward))
    offload = len(chains.offload) if chains.offload else 0
    group_of = {ref: g for g, group in enumerate(groups) for ref in group}
    # the group after which O piece k may run, and the group R reload l must run before
    ready = [group_of[("F", -(-(k + 1) * forward // offload) - 1)] if forward else -1 for k in range(offload)]
    deadline = [group_of[("B", l * backward // reloads)] if backward else len(groups) for l in range(reloads)]
    out: list[tuple[StageRef, ...]] = []
    k = l = 0
    for g, group in enumerate(groups):
        while l < reloads and deadline[l] <= g:  # no earlier group took it: alone, right before its reader
            out.append((("R", l),))
            l += 1
        if k < offload and ready[k] < g:
            group.append(("O", k))
            k += 1
        if l < reloads:
            group.append(("R", l))
            l += 1
        out.append(tuple(group))
    out += [(("O", i),) for i in range(k, offload)]
    out += [(("R", i),) for i in range(l, len(chains.recovery) if chains.recovery else 0)]
    return out


def reruns_all_to_all(chains: Chains) -> bool:
    """Whether the recovery chain re-runs communication (a recomputed dispatch or combine)."""
    return bool(chains.recovery) and any(stage.resource is Resource.COMM for stage in chains.recovery.stages)


def megatron_kwai(chains: Chains) -> Order:
    """Megatron-Kwai: the forward alone, then each backward stage with the next offload and recovery stages."""
    check_chains(chains)
    backward = [[("B", j)] for j in range(len(chains.backward) if chains.backward else 0)]
    return _finish(_singles(chains, "F") + _join(backward, chains, len(chains.recovery) if chains.recovery else 0),
                   chains, "megatron-kwai")


def _join(groups: list[list[StageRef]], chains: Chains, recovery: int) -> list[tuple[StageRef, ...]]:
    """Each group in turn joined by the next stage of O and (among the first ``recovery`` of R) the next of R;
    then the O and R stages left, one at a time."""
    offload = len(chains.offload) if chains.offload else 0
    k = l = 0
    for group in groups:
        if k < offload:
            group.append(("O", k))
            k += 1
        if l < recovery:
            group.append(("R", l))
            l += 1
    rest = [(("O", i),) for i in range(k, offload)]
    rest += [(("R", i),) for i in range(l, len(chains.recovery) if chains.recovery else 0)]
    return [tuple(g) for g in groups] + rest


BASELINES = {"sequential": sequential, "megatron-core": megatron_core, "megatron-kwai": megatron_kwai,
             "megatron-overlapped": megatron_overlapped}
