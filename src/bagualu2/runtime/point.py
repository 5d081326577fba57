"""The fused order of one *running* scheduling point, from the real plans of its four micro-batches (§V-B).

:meth:`DecisionPath.forward <bagualu2.runtime.DecisionPath.forward>` orders a point as if x-1, x, y and y+1 ran
one plan (what the simulator needs). A running pipeline knows better: each micro-batch has its own plan (and, after
its gate, the plan it really ran) and its own chunk. :class:`PointOrders` builds the chains of F_x, B_y, O_{x-1}
and R_{y+1} from those, one ``(graph, plan)`` each (None: that chain is absent), and orders them with the stage's
one order function (``Stage.order``: the DP, memoised by what it reads), so repeated points are nearly free.

The F chain's ops do not depend on x's plan beyond its FP8 casts, so an order solved with x's *pre-gate* plan
stays executable when the gate changes the plan. Without a pipeline (pp = 1) the order is sequential unless the
layout is ``paired`` (F_(y+1) beside B_y).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

from ..costmodel import OpGraph, Plan
from ..fusion import Chains, Order, build_chains
from .stage import Stage

Batch = Optional[Tuple[OpGraph, Plan]]


class ChainKey(NamedTuple):
    """One chain (F, B, O or R) of one micro-batch's graph and plan (``split``: the copy split of O and R)."""

    kind: str
    graph: int  # id() of a graph of the stage (checked on a hit)
    entries: tuple
    split: int | None


class PointOrders:
    """Orders of running scheduling points of one :class:`~.stage.Stage` (its hardware and pipeline degree)."""

    def __init__(self, stage: Stage):
        if not isinstance(stage, Stage):
            raise ValueError(f"stage must be a runtime Stage, got {type(stage).__name__}")
        self.engine = stage
        self.hardware = stage.hardware
        self.pipeline_degree = stage.point_relation  # the DP's pipeline_degree (x - y) at this stage
        self._chains = stage.memo.table(ChainKey)

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
        key = ChainKey(kind, id(graph), plan.entries, split)
        found = self._chains.get(key)
        if found is not None and found[1] is graph:
            return found[0]
        if kind in "FO":
            built = build_chains(graph, plan, None, None, hardware=self.hardware, copy_split_ns=split)
        else:
            built = build_chains(None, None, graph, plan, hardware=self.hardware, copy_split_ns=split)
        chain = {"F": built.forward, "B": built.backward, "O": built.offload, "R": built.recovery}[kind]
        self._chains[key] = (chain, graph)
        return chain

    def order(self, chains: Chains) -> Order:
        """The order of ``chains`` (``Stage.order``: the DP's; sequential at pp = 1 unless ``paired``)."""
        return self.engine.order(chains)
