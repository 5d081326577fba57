"""Fused dual-batch execution (paper §V-B): chains of one scheduling point, stage compaction, the DP over chain
prefixes, an exact CP-SAT baseline, baseline orders, and a discrete-event simulator (the order cache
is in ``bagualu2.runtime``).
Pure Python (numpy; OR-Tools for the exact baseline): never imports torch."""

import importlib

from . import baselines, dp
from .baselines import megatron_core, megatron_kwai, megatron_overlapped, sequential
from .chains import CHAIN_KINDS, Chain, Chains, Stage, build_chains, compact
from .order import Order
from .simulate import Event, Timeline, simulate



def __getattr__(name: str):
    if name == "exact":  # the CP-SAT baseline needs OR-Tools: imported on first use only
        return importlib.import_module(f"{__name__}.exact")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CHAIN_KINDS", "Chain", "Chains", "Event", "Order", "Stage", "Timeline", "baselines",
           "build_chains", "compact", "dp", "exact", "megatron_core", "megatron_kwai", "megatron_overlapped",
           "sequential", "simulate"]
