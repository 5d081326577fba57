"""The four operator chains of one steady-state scheduling point F_x B_y (paper §V-B) and their compaction.

* ``F``: the forward ops of micro-batch x, with the FP8 casts its plan adds after the producing op;
* ``B``: the backward ops of micro-batch y in reverse program order;
* ``O``: the device->host copies of micro-batch x-1 (the previous forward; steady state: same plan as x);
* ``R``: the recovery of micro-batch y+1 (the next backward; same plan as y): host->device reloads, then the
  dequantise casts, then the recomputed ops in program order.

Compaction merges consecutive ops of a chain that run on the same resource into one stage, so a chain is split
at its expert-parallel all-to-all ops (dispatch, combine); tensor-parallel collectives are synchronous on the
compute stream and stay inside compute stages. Long copy stages are cut into pieces of at most
``copy_split_ns`` (a chunked memcpy), so copies can spread over several compute stages.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from itertools import groupby
from operator import itemgetter
from typing import Iterator

from ..costmodel import Hardware, OpGraph, Plan, Resource
from ..costmodel.evaluate import MitigationOps, memoised_per_plan, mitigation_ops
from ..costmodel.validate import require_int

CHAIN_KINDS = ("F", "B", "O", "R")
EP_COMM_KINDS = frozenset({"dispatch", "combine"})
COPY_RESOURCES = (Resource.D2H, Resource.H2D)
MAX_PIECES = 16  # a copy stage is cut into at most this many pieces (bounds the DP table)
MAX_POINT_NS = 1 << 60  # every stage of a point's chains together: an order's makespan never reaches int64's end


@dataclass(frozen=True, slots=True)
class Stage:
    """A compacted run of ops of one chain on one resource."""

    name: str
    resource: Resource
    duration_ns: int
    ops: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.resource, Resource):
            try:
                object.__setattr__(self, "resource", Resource(self.resource))
            except ValueError:
                allowed = ", ".join(r.value for r in Resource)
                raise ValueError(f"stage {self.name!r} has unknown resource {self.resource!r}; "
                                 f"allowed: {allowed}") from None
        require_int(f"duration_ns of stage {self.name!r}", self.duration_ns, 0)


@dataclass(frozen=True)
class Chain:
    """A non-empty sequence of stages that must run in order."""

    kind: str
    stages: tuple[Stage, ...]

    def __post_init__(self) -> None:
        if self.kind not in CHAIN_KINDS:
            raise ValueError(f"chain kind must be one of {', '.join(CHAIN_KINDS)}, got {self.kind!r}")
        if isinstance(self.stages, (str, bytes)) or not hasattr(self.stages, "__iter__"):
            raise ValueError(f"chain {self.kind}'s stages must be a sequence of Stage, got {self.stages!r}")
        object.__setattr__(self, "stages", tuple(self.stages))
        if not self.stages:
            raise ValueError(f"chain {self.kind} is empty; pass None for a chain that has no ops at this point")
        for stage in self.stages:
            if not isinstance(stage, Stage):
                raise ValueError(f"chain {self.kind}'s stages must be Stage objects, got {type(stage).__name__}")

    def __len__(self) -> int:
        return len(self.stages)

    @property
    def duration_ns(self) -> int:
        return sum(s.duration_ns for s in self.stages)


@dataclass(frozen=True)
class Chains:
    """The chains of one scheduling point; a chain is None when it has no ops (warmup, cooldown, no mitigation)."""

    forward: Chain | None = None
    backward: Chain | None = None
    offload: Chain | None = None
    recovery: Chain | None = None
    label: str = ""

    def __post_init__(self) -> None:
        for kind, chain in zip(CHAIN_KINDS, (self.forward, self.backward, self.offload, self.recovery)):
            if chain is not None and (not isinstance(chain, Chain) or chain.kind != kind):
                raise ValueError(f"chain {kind} must be a Chain of kind {kind!r} or None")
        total_ns = sum(chain.duration_ns for chain in self.present())
        if total_ns > MAX_POINT_NS:
            raise ValueError(f"the chains of {self.label or 'the point'} take {total_ns * 1e-9:.3g} s together (at "
                             f"most {MAX_POINT_NS * 1e-9:.3g} s, so that every sum of nanoseconds stays an int64)")

    def get(self, kind: str) -> Chain | None:
        if kind not in CHAIN_KINDS:
            raise ValueError(f"chain kind must be one of {', '.join(CHAIN_KINDS)}, got {kind!r}")
        return {"F": self.forward, "B": self.backward, "O": self.offload, "R": self.recovery}[kind]

    def present(self) -> Iterator[Chain]:
        return (c for c in (self.forward, self.backward, self.offload, self.recovery) if c is not None)

    def counts(self) -> tuple[int, int, int, int]:
        return tuple(len(c) if c is not None else 0 for c in (self.forward, self.backward, self.offload,
                                                               self.recovery))  # type: ignore[return-value]

    def resource_ns(self) -> dict[Resource, int]:
        load = {r: 0 for r in Resource}
        for chain in self.present():
            for stage in chain.stages:
                load[stage.resource] += stage.duration_ns
        return load

    @property
    def lower_bound_ns(self) -> int:
        """No order beats the busiest resource or the longest chain."""
        chains = [c.duration_ns for c in self.present()]
        return max([*self.resource_ns().values(), *chains, 0])

    @property
    def sequential_ns(self) -> int:
        return sum(c.duration_ns for c in self.present())


RawOp = tuple[str, Resource, int]


def check_chains(chains) -> Chains:
    """``chains`` if it is a :class:`Chains` (``build_chains``), else a one-line ``ValueError``."""
    if not isinstance(chains, Chains):
        raise ValueError(f"chains must be a Chains (build_chains), got {type(chains).__name__}")
    return chains


def compact(kind: str, ops: list[RawOp], *, copy_split_ns: int | None = None) -> Chain | None:
    """Merge consecutive same-resource ops into stages; cut copy stages longer than ``copy_split_ns`` (into at
    most ``MAX_PIECES`` pieces)."""
    if copy_split_ns is not None:
        require_int("copy_split_ns", copy_split_ns, 1)
    stages: list[Stage] = []
    for resource, run in groupby(ops, key=itemgetter(1)):
        run = list(run)
        total = sum(op[2] for op in run)
        names = tuple(op[0] for op in run)
        pieces = 1
        if copy_split_ns and resource in COPY_RESOURCES and total > copy_split_ns:
            pieces = min(-(-total // copy_split_ns), MAX_PIECES)
        for piece in range(pieces):
            share = total // pieces + (1 if piece < total % pieces else 0)
            stages.append(Stage(f"{kind}{len(stages)}", resource, share, names))
    return Chain(kind, tuple(stages)) if stages else None


def _stream(kind: str) -> Resource:
    return Resource.COMM if kind in EP_COMM_KINDS else Resource.COMPUTE


def build_chains(forward_graph: OpGraph | None, forward_plan: Plan | None, backward_graph: OpGraph | None,
                 backward_plan: Plan | None, *, hardware: Hardware | None = None,
                 copy_split_ns: int | None = None) -> Chains:
    """Chains of the scheduling point F_x B_y from the graphs and plans of x and y (None: no such batch).

    ``hardware`` defaults to the graphs' own; durations come from the graphs (built for that hardware) and the
    evaluator's mitigation ops. ``copy_split_ns`` defaults to the median forward/backward stage duration.
    """
    for name, graph in (("forward_graph", forward_graph), ("backward_graph", backward_graph)):
        if graph is not None and not isinstance(graph, OpGraph):
            raise ValueError(f"{name} must be an OpGraph or None, got {type(graph).__name__}")
    if hardware is not None:
        for graph in (forward_graph, backward_graph):
            if graph is not None and graph.hardware != hardware:
                raise ValueError("hardware differs from the hardware the graphs were built for")
    forward = backward = extra = None
    offload_ops: list[RawOp] = []
    if forward_graph is not None:
        extra = _mitigation_ops(forward_graph, forward_plan)
        forward_ops, forward = _plain(forward_graph)[:2]
        if extra.quantized:  # the FP8 casts run right after their producer (graph inputs' casts first)
            casts: dict[str | None, list[RawOp]] = {}
            for tensor, producer, cast_ns, _ in extra.quantized:
                casts.setdefault(producer, []).append((f"cast:{tensor}", Resource.COMPUTE, cast_ns))
            with_casts = list(casts.get(None, ()))
            for op in forward_ops:
                with_casts.append(op)
                with_casts.extend(casts.get(op[0], ()))
            forward = compact("F", with_casts)
        offload_ops = [(f"d2h:{t}:{d}", Resource.D2H, down) for t, d, _, down, _ in extra.offloads]
    recovery_ops: list[RawOp] = []
    if backward_graph is not None:
        backward = _plain(backward_graph)[2]
        if extra is None or backward_graph is not forward_graph or backward_plan != forward_plan:
            extra = _mitigation_ops(backward_graph, backward_plan)  # else: the same graph and plan as forward
        recovery_ops = [(f"h2d:{t}:{d}", Resource.H2D, up) for t, d, _, _, up in extra.offloads]
        recovery_ops += [(f"dequant:{t}", Resource.COMPUTE, back) for t, _, _, back in extra.quantized]
        rerun = [backward_graph.op(name) for name in extra.rerun]
        recovery_ops += [(f"{op.name}.re", _stream(op.kind), op.forward_ns) for op in rerun]
    if copy_split_ns is None:
        main = sorted(stage.duration_ns for chain in (forward, backward) if chain is not None
                      for stage in chain.stages)
        copy_split_ns = max(main[len(main) // 2], 1) if main else None
    labels = [g.label for g in (forward_graph, backward_graph) if g is not None]
    label = labels[0] if len(set(labels)) == 1 else " / ".join(labels)
    return Chains(forward, backward, compact("O", offload_ops, copy_split_ns=copy_split_ns),
                  compact("R", recovery_ops, copy_split_ns=copy_split_ns), label=label)


_PLAIN: "weakref.WeakKeyDictionary[OpGraph, tuple]" = weakref.WeakKeyDictionary()
_MITIGATION: "weakref.WeakKeyDictionary[OpGraph, dict]" = weakref.WeakKeyDictionary()


def _mitigation_ops(graph: OpGraph, plan: Plan | None) -> MitigationOps:
    """``mitigation_ops(graph, plan)``, memoised per graph object and plan entries (a pure function of them; the
    runtime asks for the warmup and the steady point of one plan, and repeats plans)."""
    return memoised_per_plan(_MITIGATION, graph, plan, mitigation_ops)


def _plain(graph: OpGraph) -> tuple[tuple[RawOp, ...], Chain | None, Chain | None]:
    """What does not depend on the plan (cached per graph object): the forward ops, the forward chain without
    casts and the backward chain (the backward ops of y in reverse program order)."""
    found = _PLAIN.get(graph)
    if found is None:
        forward_ops = tuple((op.name, _stream(op.kind), op.forward_ns) for op in graph.ops)
        backward_ops = [(f"{op.name}.bwd", _stream(op.kind), op.backward_ns) for op in reversed(graph.ops)]
        found = _PLAIN[graph] = (forward_ops, compact("F", list(forward_ops)), compact("B", backward_ops))
    return found
