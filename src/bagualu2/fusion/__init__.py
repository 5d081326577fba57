"""Fused dual-batch execution (paper §V-B): chains of one scheduling point, stage compaction, the DP over chain
prefixes, an exact CP-SAT baseline, baseline orders, a discrete-event simulator and an order cache.
Pure Python (numpy; OR-Tools for the exact baseline): never imports torch."""

from . import baselines, dp, exact
from .baselines import megatron_core, megatron_kwai, sequential
from .cache import OrderCache
from .chains import CHAIN_KINDS, Chain, Chains, Stage, build_chains, compact
from .order import Order
from .simulate import Event, Timeline, simulate

__all__ = ["CHAIN_KINDS", "Chain", "Chains", "Event", "Order", "OrderCache", "Stage", "Timeline", "baselines",
           "build_chains", "compact", "dp", "exact", "megatron_core", "megatron_kwai", "sequential", "simulate"]
