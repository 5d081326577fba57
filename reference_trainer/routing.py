"""The reference model's routing, instrumented from outside: forced imbalance (spikes) and routing statistics.

Imbalance on purpose (:func:`bias_router_towards`, :func:`imbalance_picks`): the routers' expert-bias buffers are
set so that every token on a rank puts exactly ``j`` of its ``K`` picks on the target rank's experts (``+BIAS`` on
``j`` of them, ``-BIAS`` on the rest; the other picks follow the scores among the other ranks' experts). With
``j_i`` picks per token on source rank ``i``, the target receives ``T * sum_i j_i`` copies, i.e. an imbalance
``sum_i j_i / K`` of the mean ``T*K``; ``sum_i j_i = round(R*K)`` realises ``R`` exactly when ``R*K`` is an integer
(otherwise the nearest multiple of ``1/K``).

Routing statistics (:func:`record_routing`, :func:`routing_stats`): a forward hook on each MoE module's dispatch
records this rank's routed copies per global expert (the last forward's and their sum since the trainer last
reset it: the aux-loss-free balancing's load) and the copies each local expert received. Module hooks fire on
real forwards only: the exec layer's replays call ``forward`` directly, so a recomputed op is never counted twice.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from .model import MoE

ROUTER_BIAS = 10.0  # sigmoid scores lie in (0, 1): +-10 forces an expert in or out of every token's top-k


def imbalance_picks(imbalance: float, ep: int, top_k: int) -> list[int]:
    """Picks per token each source rank puts on the target rank so that it receives ``imbalance`` x the mean.

    ``round(imbalance * top_k)`` picks in all, spread as evenly as possible over the ``ep`` source ranks (the first
    ranks take one more); the realised imbalance is ``sum / top_k``. Needs ``1 <= imbalance <= ep``.
    """
    if not 1 <= imbalance <= ep:
        raise ValueError(f"imbalance must lie in [1, ep={ep}], got {imbalance:g}")
    total = round(imbalance * top_k)
    return [total // ep + (1 if i < total % ep else 0) for i in range(ep)]


def bias_towards(moe: MoE, rank: int, picks: int) -> None:
    """Set ``moe.expert_bias`` so that every token puts exactly ``picks`` of its top-k on EP rank ``rank``."""
    local, k = moe.num_local_experts, moe.top_k
    if not 0 <= rank < moe.ep:
        raise ValueError(f"rank must lie in [0, ep={moe.ep}), got {rank}")
    if not 0 <= picks <= min(k, local) or k - picks > moe.num_experts - local:
        raise ValueError(f"cannot put {picks} of top_k={k} picks on a rank holding {local} of "
                         f"{moe.num_experts} experts")
    bias = torch.zeros_like(moe.expert_bias)
    first = rank * local
    bias[first:first + picks] = ROUTER_BIAS
    bias[first + picks:first + local] = -ROUTER_BIAS
    moe.expert_bias.copy_(bias)


def bias_router_towards(module: torch.nn.Module, rank: int, picks: int) -> None:
    """Every MoE router of ``module`` puts exactly ``picks`` of each token's top-k on EP rank ``rank``'s experts.
    Use :func:`imbalance_picks` for the ``picks`` of each source rank that realise a given imbalance."""
    for moe in module.modules():
        if isinstance(moe, MoE):
            bias_towards(moe, rank, picks)


@dataclass
class RoutingStats:
    """One MoE module's routing: ``last`` this rank's copies per global expert at the last forward, ``load`` their
    sum since the last reset (None: nothing since), ``received`` the copies each local expert received."""

    last: torch.Tensor | None = None
    load: torch.Tensor | None = None
    received: torch.Tensor | None = None


_STATS: "weakref.WeakKeyDictionary[MoE, RoutingStats]" = weakref.WeakKeyDictionary()


def record_routing(module: torch.nn.Module) -> None:
    """Record the routing statistics of every MoE module of ``module`` (once per MoE module: a second call adds
    nothing)."""
    for moe in module.modules():
        if isinstance(moe, MoE) and moe not in _STATS:
            stats = _STATS[moe] = RoutingStats()

            def hook(dispatch, args, output, stats=stats):
                counts = args[1][0].reshape(-1)  # the send counts: this rank's copies per global expert
                stats.last = counts
                stats.load = counts if stats.load is None else stats.load + counts
                stats.received = output[1]

            moe.dispatch.register_forward_hook(hook)


def routing_stats(moe: MoE) -> RoutingStats:
    """The statistics :func:`record_routing` keeps for ``moe``."""
    found = _STATS.get(moe)
    if found is None:
        raise ValueError("this MoE module's routing is not recorded: call record_routing on its model first")
    return found
