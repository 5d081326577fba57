"""The one evaluator: memory and time of a plan on an op graph. Every solver's cost comes from here.

Semantics (see docs/costmodel.md):

* Each saving resolves to a strategy (explicit entry > kind policy > KEEP; pinned savings are always KEEP;
  kind policies skip savings a strategy does not apply to: QUANTIZE of masks, indices and FP32 copies).
* Device bytes are counted per distinct stored copy of a tensor: all ``KEEP`` savings of one tensor in one
  precision share one copy; ``QUANTIZE`` savings share one FP8 copy; ``OFFLOAD`` savings share one host copy per
  precision. So a tensor offloaded at one consumer but kept at another still occupies the device
  (multi-device conflict) and a tensor quantised at one consumer but kept at another holds two copies
  (multi-precision conflict): the evaluator charges what really happens, the conflict checker flags it.
* A tensor that is ``RECOMPUTE`` at some consumer and has no stored copy is regenerated in backward by re-running
  its producer; the producer's inputs that are not stored themselves are regenerated too (least closure). Each op
  is re-run at most once. A graph input that would need regenerating cannot be, and is reported in
  ``PlanCost.unavailable``.
* Times are integer nanoseconds internally (``*_ns``) so that exact solvers reproduce them; ``*_s`` are floats.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, Collection, Mapping

from .graph import ITEM_BYTES, MATMUL_KINDS, OpGraph, Resource, Saving
from .plan import Plan
from .strategy import Strategy, tensor_offload_ns, tensor_quantize_ns


@dataclass(frozen=True)
class PlanCost:
    """Cost of one plan for one micro-batch of one chunk. Bytes are ints; ``*_s`` are seconds."""

    activation_bytes: int
    host_bytes: int
    forward_ns: int
    backward_ns: int
    recompute_ns: int
    offload_ns: int
    quantize_ns: int
    resource_ns: Mapping[str, int]
    num_recomputed_ops: int
    unavailable: tuple[str, ...] = ()
    recompute_flops: int = 0  # matrix-product and attention FLOPs of the re-run ops (``graph.MATMUL_KINDS``)
    routed_bytes: int = 0  # the part of ``activation_bytes`` held by routed-expert tensors (scales with imbalance)
    routed_bytes_by_layer: Mapping[int, int] = field(default_factory=dict)  # ``routed_bytes`` per MoE layer

    def activation_bytes_received(self, graph: OpGraph, received_tokens: Mapping[int, int]) -> int:
        """``activation_bytes`` when MoE layer ``l``'s experts received ``received_tokens[l]`` routed token copies
        (layers not listed: as ``graph`` holds them), exactly: per layer, routed bytes are proportional to them."""
        total = self.activation_bytes
        for layer, nbytes in self.routed_bytes_by_layer.items():
            tokens, built = received_tokens.get(layer), graph.built_routed_tokens(layer)
            if tokens is None or tokens == built:
                continue
            if not built:
                raise ValueError(f"MoE layer {layer} of {graph.label!r} holds no routed token copies: its bytes at "
                                 f"{tokens} copies are unknown")
            total += nbytes // built * tokens - nbytes
        return total

    def activation_bytes_at(self, graph: OpGraph, imbalance: float) -> int:
        """``activation_bytes`` of the same plan on ``graph`` rebuilt at ``imbalance``, exactly: routed tensors
        hold ``graph.routed_tokens(r)`` token copies each, so their bytes are proportional to it."""
        if not self.routed_bytes:
            return self.activation_bytes
        if not graph.layer_routed_tokens:
            built = graph.routed_tokens(graph.imbalance)
            if not built:
                return self.activation_bytes
            return (self.activation_bytes - self.routed_bytes
                    + self.routed_bytes // built * graph.routed_tokens(imbalance))
        target = graph.routed_tokens(imbalance)
        return self.activation_bytes_received(graph, {layer: target for layer in self.routed_bytes_by_layer})

    @property
    def overhead_ns(self) -> int:
        """Added time over the unmitigated micro-batch if nothing overlapped: recompute + copies + casts."""
        return self.recompute_ns + self.offload_ns + self.quantize_ns

    @property
    def overhead_s(self) -> float:
        return self.overhead_ns * 1e-9

    @property
    def forward_s(self) -> float:
        return self.forward_ns * 1e-9

    @property
    def backward_s(self) -> float:
        return self.backward_ns * 1e-9

    @property
    def recompute_s(self) -> float:
        return self.recompute_ns * 1e-9

    @property
    def offload_s(self) -> float:
        return self.offload_ns * 1e-9

    @property
    def quantize_s(self) -> float:
        return self.quantize_ns * 1e-9

    @property
    def resource_s(self) -> dict[str, float]:
        return {name: ns * 1e-9 for name, ns in self.resource_ns.items()}


OUTPUT_RECOMPUTE_KINDS = frozenset({"norm", "rope", "mlp_act", "expert_act", "shared_act"})


def resolve(graph: OpGraph, plan: Plan | None) -> dict[tuple[str, str], Strategy]:
    """The strategy of every saving of ``graph`` under ``plan``; raises ``ValueError`` on an invalid entry.

    Kind policies: OFFLOAD and QUANTIZE of kind X apply to everything ops of kind X save. RECOMPUTE of kind X
    means "re-run X in backward" (Megatron's selective recompute of a module): X's inputs stay, what X produced
    and keeps for itself is dropped (``core_attn``: softmax, dropout mask, ... — Korthikanti's selective
    recompute); for the cheap elementwise kinds in ``OUTPUT_RECOMPUTE_KINDS`` (norms, RoPE, activations) the
    output is dropped too, wherever it is kept (Megatron's layernorm / moe_act recompute). Explicit
    ``OP/TENSOR`` entries override kind policies.
    """
    resolved = dict.fromkeys(_savings_of(graph)[0], Strategy.KEEP)
    plan = Plan.coerce(plan)
    if plan is None or not plan.entries:
        return resolved
    kinds = plan.kind_policies()
    if kinds:
        tensors = graph.tensors
        kind_of = {op.name: op.kind for op in graph.ops}
        for op, saving in graph.savings:
            if (op.name, saving.tensor) in graph.pinned:
                continue
            strategy = kinds.get(op.kind)
            producer = tensors[saving.tensor].producer
            if strategy is Strategy.RECOMPUTE and producer != op.name:
                strategy = None  # re-running an op keeps its inputs (selective recompute) ...
            if strategy is None and producer is not None and kind_of[producer] in OUTPUT_RECOMPUTE_KINDS \
                    and kinds.get(kind_of[producer]) is Strategy.RECOMPUTE:
                strategy = Strategy.RECOMPUTE  # ... and drops a cheap op's output wherever it is kept
            if strategy is None or (strategy is Strategy.QUANTIZE and not graph.quantizable(saving)):
                continue
            resolved[(op.name, saving.tensor)] = strategy
    for (op_name, tensor), strategy in plan.explicit().items():
        key = (op_name, tensor)
        if key not in resolved:
            raise ValueError(f"plan entry {op_name}/{tensor}: op {op_name!r} does not save tensor {tensor!r} "
                             "in this graph")
        if key in graph.pinned and strategy is not Strategy.KEEP:
            raise ValueError(f"plan entry {op_name}/{tensor}: the block input is pinned to KEEP "
                             "(full recomputation restarts from it)")
        if strategy is Strategy.QUANTIZE and not graph.quantizable(_saving(graph, op_name, tensor)):
            raise ValueError(f"plan entry {op_name}/{tensor}: QUANTIZE needs a floating saving no wider than "
                             f"the activation dtype {graph.activation_dtype}, not "
                             f"{_saving(graph, op_name, tensor).dtype}")
        resolved[key] = strategy
    return resolved


_SAVINGS: "weakref.WeakKeyDictionary[OpGraph, tuple]" = weakref.WeakKeyDictionary()


def _savings_of(graph: OpGraph) -> tuple[tuple, tuple]:
    """``(keys, rows)`` of every saving in program order: ``keys`` the ``(op, tensor)`` pairs, ``rows`` the
    ``((op, tensor), tensor, dtype)`` triples. Built once per graph object: the evaluator runs for many plans of
    one graph, and this spares it re-reading the ops each time."""
    found = _SAVINGS.get(graph)
    if found is None:
        rows = tuple(((op.name, s.tensor), s.tensor, s.dtype) for op, s in graph.savings)
        found = _SAVINGS[graph] = (tuple(key for key, _, _ in rows), rows)
    return found


def _saving(graph: OpGraph, op_name: str, tensor: str) -> Saving:
    return next(s for s in graph.op(op_name).saves if s.tensor == tensor)


_CLASSIFIED: "weakref.WeakKeyDictionary[OpGraph, dict]" = weakref.WeakKeyDictionary()
MAX_PLANS_PER_GRAPH = 512  # plans whose result a per-plan memo remembers per graph object


def check_graph(graph) -> OpGraph:
    """``graph`` if it is an :class:`OpGraph`, else a one-line ``ValueError``."""
    if not isinstance(graph, OpGraph):
        raise ValueError(f"graph must be an OpGraph (build_graph or a traced graph), got {type(graph).__name__}")
    return graph


def memoised_per_plan(cache: "weakref.WeakKeyDictionary[OpGraph, dict]", graph: OpGraph, plan, compute):
    """``compute(graph, plan)``, memoised in ``cache`` per graph object and plan entries (a pure function of them),
    at most ``MAX_PLANS_PER_GRAPH`` plans per graph; a plan that is not a :class:`Plan` (its text form) is not
    memoised."""
    check_graph(graph)
    if plan is not None and not isinstance(plan, Plan):
        return compute(graph, plan)
    memo = cache.setdefault(graph, {})
    key = () if plan is None else plan.entries
    found = memo.get(key)
    if found is None:
        if len(memo) >= MAX_PLANS_PER_GRAPH:
            memo.clear()
        found = memo[key] = compute(graph, plan)
    return found


def _classified(graph: OpGraph, plan: Plan | None) -> tuple:
    """``_classify(graph, resolve(graph, plan))`` and the least re-run closure, memoised per graph object and plan
    (the evaluator and :func:`mitigation_ops` ask for the same plans: the runtime costs a plan, then orders it)."""
    return memoised_per_plan(_CLASSIFIED, graph, plan, lambda g, p: _classify_closed(g, resolve(g, p)))


def _classify_closed(graph: OpGraph, strategies: Mapping[tuple[str, str], Strategy]) -> tuple:
    device, host, quantized, recomputed = _classify(graph, strategies)
    stored = device.keys() | host.keys() | quantized.keys()
    rerun, unavailable = graph_closure(graph, recomputed - stored, stored)
    return device, host, quantized, rerun, unavailable


def evaluate(graph: OpGraph, plan: Plan | None = None) -> PlanCost:
    """Activation bytes, forward/backward/overhead time and per-resource time of ``plan`` on ``graph``."""
    return _cost(graph, *_classified(graph, plan))


def evaluate_resolved(graph: OpGraph, strategies: Mapping[tuple[str, str], Strategy]) -> PlanCost:
    """:func:`evaluate` on an already resolved ``{(op, tensor): Strategy}`` map (missing savings are KEEP)."""
    check_graph(graph)
    return _cost(graph, *_classify_closed(graph, strategies))


def _cost(graph: OpGraph, device: dict, host: dict, quantized: dict, rerun: set, unavailable: set) -> PlanCost:
    hardware = graph.hardware
    tensors = graph.tensors
    activation_bytes = routed_bytes = 0
    by_layer: dict[int, int] = {}
    for name, dtypes in device.items():
        spec = tensors[name]
        nbytes = spec.numel * sum(map(ITEM_BYTES.__getitem__, dtypes))  # one copy per stored precision
        activation_bytes += nbytes
        if spec.routed:
            routed_bytes += nbytes
            layer = graph.tensor_layers[name]
            by_layer[layer] = by_layer.get(layer, 0) + nbytes
    for name in quantized:  # one FP8 byte per element
        spec = tensors[name]
        activation_bytes += spec.numel
        if spec.routed:
            routed_bytes += spec.numel
            layer = graph.tensor_layers[name]
            by_layer[layer] = by_layer.get(layer, 0) + spec.numel
    host_bytes = 0
    d2h_ns = h2d_ns = 0
    for name, dtypes in host.items():
        for dtype in dtypes:
            host_bytes += tensors[name].numel * ITEM_BYTES[dtype]
            down, up = tensor_offload_ns(tensors[name], dtype, hardware)
            d2h_ns += down
            h2d_ns += up
    quant_fwd_ns = quant_bwd_ns = 0
    for name in quantized:
        fwd, bwd = tensor_quantize_ns(tensors[name], hardware)
        quant_fwd_ns += fwd
        quant_bwd_ns += bwd

    recompute_by_resource = {Resource.COMPUTE: 0, Resource.COMM: 0}
    recompute_flops = 0
    for op_name in rerun:
        op = graph.op(op_name)
        recompute_by_resource[op.resource] += op.forward_ns
        if op.kind in MATMUL_KINDS:
            recompute_flops += op.flops
    recompute_total = sum(recompute_by_resource.values())

    base = graph.base_resource_ns
    resource_ns = {
        Resource.COMPUTE.value: base[Resource.COMPUTE] + recompute_by_resource[Resource.COMPUTE]
        + quant_fwd_ns + quant_bwd_ns,
        Resource.COMM.value: base[Resource.COMM] + recompute_by_resource[Resource.COMM],
        Resource.D2H.value: d2h_ns,
        Resource.H2D.value: h2d_ns,
    }
    return PlanCost(
        activation_bytes=activation_bytes,
        host_bytes=host_bytes,
        forward_ns=graph.forward_ns + quant_fwd_ns + d2h_ns,
        backward_ns=graph.backward_ns + recompute_total + quant_bwd_ns + h2d_ns,
        recompute_ns=recompute_total,
        offload_ns=d2h_ns + h2d_ns,
        quantize_ns=quant_fwd_ns + quant_bwd_ns,
        resource_ns=MappingProxyType(resource_ns),
        num_recomputed_ops=len(rerun),
        unavailable=tuple(sorted(unavailable)),
        recompute_flops=recompute_flops,
        routed_bytes=routed_bytes,
        routed_bytes_by_layer=MappingProxyType(by_layer),
    )


def _classify(graph: OpGraph, strategies: Mapping[tuple[str, str], Strategy]):
    """Per tensor: device copies (dtypes), host copies (dtypes), the quantised and the recomputed tensors. The
    maps and ``quantized`` are in program order (a set's order would follow the string hash seed)."""
    device: dict[str, set[str]] = {}
    host: dict[str, set[str]] = {}
    quantized: dict[str, None] = {}
    recomputed: set[str] = set()
    keep, recompute, offload = Strategy.KEEP, Strategy.RECOMPUTE, Strategy.OFFLOAD
    for key, tensor, dtype in _savings_of(graph)[1]:
        strategy = strategies.get(key, keep)
        if strategy is keep:
            device.setdefault(tensor, set()).add(dtype)
        elif strategy is recompute:
            recomputed.add(tensor)
        elif strategy is offload:
            host.setdefault(tensor, set()).add(dtype)
        else:
            quantized[tensor] = None
    return device, host, quantized, recomputed


@dataclass(frozen=True)
class MitigationOps:
    """The extra operators a plan adds, in program order, with the evaluator's durations (ns).

    ``offloads``: ``(tensor, dtype, nbytes, d2h_ns, h2d_ns)`` per host copy; ``quantized``: ``(tensor, producer,
    cast_ns, dequantize_ns)``; ``rerun``: ops backward re-runs (the least recompute closure).
    """

    offloads: tuple[tuple[str, str, int, int, int], ...]
    quantized: tuple[tuple[str, str | None, int, int], ...]
    rerun: tuple[str, ...]


def mitigation_ops(graph: OpGraph, plan: Plan | None) -> MitigationOps:
    """The copies, casts and re-runs ``plan`` adds to ``graph`` — the same ones :func:`evaluate` charges."""
    _, host, quantized, rerun, _ = _classified(graph, plan)
    order = {name: i for i, name in enumerate(graph.tensors)}
    offloads = []
    for name in sorted(host, key=order.__getitem__):
        for dtype in sorted(host[name]):
            spec = graph.tensors[name]
            offloads.append((name, dtype, spec.numel * ITEM_BYTES[dtype],
                             *tensor_offload_ns(spec, dtype, graph.hardware)))
    casts = []
    for name in sorted(quantized, key=order.__getitem__):
        spec = graph.tensors[name]
        casts.append((name, spec.producer, *tensor_quantize_ns(spec, graph.hardware)))
    return MitigationOps(tuple(offloads), tuple(casts), tuple(op.name for op in graph.ops if op.name in rerun))


def recompute_closure(missing: Collection[str], is_stored: Callable[[str], bool],
                      producer_of: Callable[[str], str | None], inputs_of: Callable[[str], tuple[str, ...]],
                      rerun: Collection[str] = ()) -> tuple[set[str], set[str]]:
    """The least set of ops to re-run (beyond the ops in ``rerun``, already re-run) so that every tensor in
    ``missing`` is regenerated: its producer re-runs, and so, transitively, do the producers of its inputs that
    are not stored. Returns ``(new ops, unavailable graph inputs)``. The one recompute closure: the evaluator and
    the solvers call it."""
    new: set[str] = set()
    unavailable: set[str] = set()
    needed = set(missing)
    work = list(missing)
    while work:
        name = work.pop()
        producer = producer_of(name)
        if producer is None:
            unavailable.add(name)
            continue
        if producer in rerun or producer in new:
            continue
        new.add(producer)
        for source in inputs_of(producer):
            if source not in needed and not is_stored(source):
                needed.add(source)
                work.append(source)
    return new, unavailable


def graph_closure(graph: OpGraph, missing: set[str], stored: Collection[str]) -> tuple[set[str], set[str]]:
    """:func:`recompute_closure` on ``graph`` with the stored tensors ``stored``."""
    tensors = graph.tensors
    return recompute_closure(missing, stored.__contains__, lambda t: tensors[t].producer,
                             lambda op: graph.op(op).inputs)
