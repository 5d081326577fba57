"""A graph at another MoE imbalance, from the graph itself: its routed tensors resized to the copies received.

:func:`build_graph` builds a chunk at any imbalance from the model's configuration. A graph traced from a running
model (``bagualu2.exec``) has no configuration behind it, only the tensors one micro-batch made and the routed
token copies each MoE layer's experts received (``OpGraph.layer_routed_tokens``). A routed tensor holds one row
per received copy, so at another imbalance ``r`` every routed tensor of layer ``l`` holds
``numel / built(l) * routed_tokens(r)`` elements; the ops that read or make routed tensors (the dispatch and
combine of the received copies, the experts' GEMMs and activation) take their time beyond the kernel launch in
the same proportion (an estimate: the weights they read do not grow with the copies). Everything else is as it was. For a built graph
this gives exactly the tensors, and so the bytes of every plan, that :func:`build_graph` builds at ``r`` (a
property test checks it); op times are estimates.
"""

from __future__ import annotations

from .build import check_imbalance
from .graph import Op, OpGraph
from .strategy import seconds_to_ns


def at_imbalance(graph: OpGraph, imbalance: float) -> OpGraph:
    """``graph`` with every MoE layer's routed tensors holding ``graph.routed_tokens(imbalance)`` token copies
    (module docstring). ``ValueError`` for a graph with no routed tokens (dense, or traced without gate reports),
    for a layer whose experts received no copies when the graph was made (nothing to scale from), or for a routed
    tensor that is not one row per copy."""
    imbalance = check_imbalance(imbalance)
    if not graph.mean_routed_tokens:
        raise ValueError(f"graph {graph.label!r} has no routed token copies to rescale (a dense graph, or one traced "
                         "without gate reports)")
    try:
        target = graph.routed_tokens(imbalance)
    except OverflowError:  # more copies than a float holds: no routing sends that
        raise ValueError(f"imbalance {imbalance:g} x the mean {graph.mean_routed_tokens} routed copies is beyond "
                         "any routing") from None
    factors: dict[int, tuple[int, int]] = {}
    tensors = dict(graph.tensors)
    for name, spec in graph.tensors.items():
        if not spec.routed:
            continue
        layer = graph.tensor_layers[name]
        built = graph.built_routed_tokens(layer)
        if not built:
            raise ValueError(f"MoE layer {layer} of {graph.label!r} received no routed token copies: nothing to "
                             "rescale from (trace a micro-batch whose routing reaches this rank's experts)")
        if spec.numel % built:
            raise ValueError(f"routed tensor {name!r} holds {spec.numel} elements, not one row per each of the "
                             f"{built} routed copies of layer {layer}")
        factors[layer] = (target, built)
        tensors[name] = spec._replace(numel=spec.numel // built * target)
    launch = seconds_to_ns(graph.hardware.kernel_launch_s)

    def scaled(ns: int, num: int, den: int) -> int:  # the launch stays, the rest follows the copies
        return ns if ns <= launch else launch + (ns - launch) * num // den

    ops = []
    for op in graph.ops:
        factor = factors.get(op.layer)
        if factor is not None and any(graph.tensors[t].routed for t in (*op.inputs, *op.outputs)):
            num, den = factor
            op = Op(op.name, op.kind, op.layer, op.resource, op.inputs, op.outputs, op.saves,
                    op.flops * num // den, op.moved_bytes * num // den, scaled(op.forward_ns, num, den),
                    scaled(op.backward_ns, num, den))
        ops.append(op)
    return OpGraph(ops=tuple(ops), tensors=tensors, hardware=graph.hardware, pinned=graph.pinned,
                   imbalance=imbalance, label=graph.label, activation_dtype=graph.activation_dtype,
                   mean_routed_tokens=graph.mean_routed_tokens, quantize=graph.quantize)
