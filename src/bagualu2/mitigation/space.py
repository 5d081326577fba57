"""The conflict-free decision space: one strategy per tensor, shared by all of its consumers.

The conflict rules (see :mod:`.conflicts`) require every consumer of a tensor to agree on placement and
precision, so a conflict-free plan is a choice per tensor. Tensors kept by a pinned saving (block inputs) are
fixed to KEEP. QUANTIZE is offered only where every consumer's saving may be quantised.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

from ..costmodel import OpGraph, Plan, Strategy
from ..costmodel.graph import ITEM_BYTES
from ..costmodel.strategy import tensor_offload_ns, tensor_quantize_ns


@dataclass(frozen=True, slots=True)
class TensorChoice:
    """One decision: ``tensor`` with its consumer savings, bytes kept by each strategy and the fixed costs."""

    tensor: str
    savings: tuple[tuple[str, str], ...]
    strategies: tuple[Strategy, ...]     # applicable mitigations
    keep_bytes: int                      # device bytes under KEEP (one copy per stored precision)
    quantized_bytes: int                 # device bytes under QUANTIZE (one FP8 copy)
    offload_ns: int                      # d2h + h2d of every host copy
    quantize_ns: int                     # cast + dequantise


@dataclass(frozen=True, eq=False)
class Space:
    """Decisions plus flat look-up tables of the graph for fast solvers."""

    choices: tuple[TensorChoice, ...]
    fixed_bytes: int                       # bytes of tensors with a pinned consumer (always kept)
    producer: dict[str, str | None]        # tensor -> producing op (None: graph input)
    inputs: dict[str, tuple[str, ...]]     # op -> input tensors
    forward_ns: dict[str, int]             # op -> forward nanoseconds (the cost of re-running it)
    position: dict[str, int]               # op -> its index in program order (deterministic tie-breaks)
    produces: dict[str, tuple[str, ...]]   # op -> mitigable tensors it produces
    readers: dict[str, tuple[str, ...]]    # tensor -> ops that take it as an input
    saved: frozenset[str]                  # tensors some op saves
    pinned: frozenset[str]                 # tensors with a pinned (always kept) saving

    def plan(self, chosen: dict[str, Strategy]) -> Plan:
        """Plan assigning ``chosen[tensor]`` to every consumer saving of each tensor (KEEP omitted)."""
        by_name = {c.tensor: c for c in self.choices}
        return Plan.from_decisions({key: strategy for tensor, strategy in chosen.items()
                                    if strategy is not Strategy.KEEP for key in by_name[tensor].savings})


_CACHE: "weakref.WeakKeyDictionary[OpGraph, Space]" = weakref.WeakKeyDictionary()


_LIKE: "weakref.WeakKeyDictionary[OpGraph, OpGraph]" = weakref.WeakKeyDictionary()


def share_decisions(graph: OpGraph, like: OpGraph) -> None:
    """When ``graph``'s decisions are first needed, reuse ``like``'s (a graph of the same chunk at another
    imbalance, say) for every tensor that is the same in both — same spec, same consumers, same hardware — instead
    of costing it again. Nothing is built now."""
    if like is not graph and like.hardware == graph.hardware and like.activation_dtype == graph.activation_dtype:
        _LIKE[graph] = like


def decision_space(graph: OpGraph) -> Space:
    """The tensor-level decisions of ``graph`` (cached per graph object; see :func:`share_decisions`)."""
    space = _CACHE.get(graph)
    if space is None:
        like = _LIKE.get(graph)
        space = _CACHE[graph] = _build(graph, None if like is None else (like, decision_space(like)))
    return space


def _build(graph: OpGraph, base: tuple[OpGraph, Space] | None = None) -> Space:
    reuse: dict[str, TensorChoice] = {}
    if base is not None:
        like, like_space = base
        reuse = {c.tensor: c for c in like_space.choices}
    consumers: dict[str, list] = {}
    pinned_tensors = {tensor for _, tensor in graph.pinned}
    for op, saving in graph.savings:
        consumers.setdefault(saving.tensor, []).append((op, saving))
    hw = graph.hardware
    choices = []
    fixed = 0
    for tensor, users in consumers.items():
        spec = graph.tensors[tensor]
        found = reuse.get(tensor)
        if found is not None and tensor not in pinned_tensors and like.tensors[tensor] == spec \
                and like.consumers(tensor) == graph.consumers(tensor):
            choices.append(found)  # the same tensor, saved by the same ops in the same precisions
            continue
        dtypes = sorted({s.dtype for _, s in users})
        keep = sum(spec.numel * ITEM_BYTES[d] for d in dtypes)
        if tensor in pinned_tensors:
            fixed += keep
            continue
        strategies = [Strategy.RECOMPUTE, Strategy.OFFLOAD]
        if all(graph.quantizable(s) for _, s in users):
            strategies.append(Strategy.QUANTIZE)
        off = sum(sum(tensor_offload_ns(spec, d, hw)) for d in dtypes)
        quant = sum(tensor_quantize_ns(spec, hw))
        choices.append(TensorChoice(tensor, tuple((op.name, tensor) for op, _ in users), tuple(strategies),
                                    keep, spec.numel, off, quant))
    produces: dict[str, list[str]] = {}
    for c in choices:
        producer = graph.tensors[c.tensor].producer
        if producer is not None:
            produces.setdefault(producer, []).append(c.tensor)
    readers: dict[str, list[str]] = {}
    for op in graph.ops:
        for source in op.inputs:
            readers.setdefault(source, []).append(op.name)
    return Space(choices=tuple(choices), fixed_bytes=fixed,
                 readers={t: tuple(ops) for t, ops in readers.items()},
                 producer={name: spec.producer for name, spec in graph.tensors.items()},
                 inputs={op.name: op.inputs for op in graph.ops},
                 forward_ns={op.name: op.forward_ns for op in graph.ops},
                 position={op.name: i for i, op in enumerate(graph.ops)},
                 produces={op: tuple(ts) for op, ts in produces.items()},
                 saved=frozenset(consumers), pinned=frozenset(pinned_tensors))
