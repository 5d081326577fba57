"""The fused order of one *running* scheduling point, from the real plans of its four micro-batches (§V-B).

:meth:`DecisionPath.forward <bagualu2.runtime.DecisionPath.forward>` orders a point as if x-1, x, y and y+1 ran
one plan (what the simulator needs). A running pipeline knows better: each micro-batch has its own plan (and, after
its gate, the plan it really ran) and its own chunk. :class:`PointOrders` builds the chains of F_x, B_y, O_{x-1}
and R_{y+1} from those, one ``(graph, plan)`` each (None: that chain is absent), and solves the DP, memoised by
what the DP reads (each chain's stage resources and durations), so repeated points are nearly free.

The F chain's ops do not depend on x's plan beyond its FP8 casts, so an order solved with x's *pre-gate* plan
stays executable when the gate changes the plan. ``pipeline_degree <= 2`` gives the sequential order.
"""

from __future__ import annotations

import warnings
from typing import Optional, Tuple

from ..costmodel import Hardware, OpGraph, Plan
from ..costmodel.validate import require_int
from ..fusion import Chains, Order, build_chains, dp
from ..fusion.baselines import sequential

Batch = Optional[Tuple[OpGraph, Plan]]
MAX_ORDERS = 4096


class PointOrders:
    """Orders of running scheduling points of one stage (``pipeline_degree``: the pipeline's, as in the DP)."""

    def __init__(self, hardware: Hardware, *, pipeline_degree: int):
        self.hardware = hardware
        self.pipeline_degree = require_int("pipeline_degree", pipeline_degree, 1)
        self._orders: dict[tuple, Order] = {}
        self._chains: dict[tuple, tuple[Chains, tuple]] = {}
        self.hits = self.misses = 0

    def chains(self, *, forward: Batch = None, backward: Batch = None, offload: Batch = None,
               recovery: Batch = None) -> Chains:
        """The four chains: F and B of ``forward`` / ``backward``, O of ``offload``'s plan, R of ``recovery``'s
        (each memoised by its graph and plan: a running stage repeats them)."""
        f = self._part("F", forward)
        b = self._part("B", backward)
        durations = sorted(stage.duration_ns for chain in (f, b) if chain is not None for stage in chain.stages)
        split = max(durations[len(durations) // 2], 1) if durations else None
        o = self._part("O", offload, split)
        r = self._part("R", recovery, split)
        labels = [batch[0].label for batch in (forward, backward) if batch is not None]
        label = labels[0] if len(set(labels)) == 1 else " / ".join(labels)
        return Chains(f, b, o, r, label=label)

    def _part(self, kind: str, batch: Batch, split: int | None = None):
        """One chain of one micro-batch's ``(graph, plan)`` (None: absent), memoised."""
        if batch is None:
            return None
        graph, plan = batch
        key = (kind, id(graph), plan.entries, split)
        found = self._chains.get(key)
        if found is not None and found[1] is graph:
            return found[0]
        if kind in "FO":
            built = build_chains(graph, plan, None, None, hardware=self.hardware, copy_split_ns=split)
        else:
            built = build_chains(None, None, graph, plan, hardware=self.hardware, copy_split_ns=split)
        chain = {"F": built.forward, "B": built.backward, "O": built.offload, "R": built.recovery}[kind]
        if len(self._chains) >= MAX_ORDERS:
            self._chains.clear()
        self._chains[key] = (chain, graph)
        return chain

    def order(self, chains: Chains) -> Order:
        """The DP's order of ``chains`` (sequential at ``pipeline_degree <= 2``), memoised by stage durations."""
        key = tuple(None if chain is None else tuple((s.resource, s.duration_ns) for s in chain.stages)
                    for chain in (chains.forward, chains.backward, chains.offload, chains.recovery))
        found = self._orders.get(key)
        if found is not None:
            self.hits += 1
            return found
        self.misses += 1
        if len(self._orders) >= MAX_ORDERS:
            self._orders.clear()
        if self.pipeline_degree <= 2:
            found = sequential(chains)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                found = dp.solve(chains, pipeline_degree=self.pipeline_degree)
        self._orders[key] = found
        return found
