"""The :class:`~bagualu2.costmodel.OpGraph` of a finished trace (:mod:`bagualu2.exec.trace` records it): graph
tensors named after the storages' makers, one op per mapped label and layer with its savings, Δt (roofline,
collectives, or measured), the pinned ``unmapped`` op, the routed tensors and the routed token copies each MoE
layer received (what lets the graph be resized to another imbalance, ``costmodel.rescale``)."""

from __future__ import annotations

import dataclasses

import torch

from bagualu2.costmodel.build import FLASH_BACKWARD_FACTOR
from bagualu2.costmodel.config import Hardware
from bagualu2.costmodel.graph import COMM_KINDS, ITEM_BYTES, Op, OpGraph, Resource, Saving, TensorSpec
from bagualu2.costmodel.strategy import roofline_ns, seconds_to_ns

from .record import TORCH_TO_NAME
from .trace import ROUTED_KINDS, TraceRecorder, TraceResult


def build_graph_of(recorder: TraceRecorder, model: torch.nn.Module, hardware: Hardware, *,
                   activation_dtype: str) -> TraceResult:
    """The :class:`OpGraph` of a finished trace (see the module docstring)."""
    if not isinstance(hardware, Hardware):
        raise ValueError(f"hardware must be a bagualu2 Hardware (e.g. presets.hardware('cpu')), "
                         f"got {type(hardware).__name__}")
    if not recorder.calls:
        raise ValueError("trace_graph: no mapped module ran in the forward; check the op map's patterns")
    names: dict[tuple, str] = {}
    counters: dict[tuple[str, str], int] = {}
    for key, info in recorder.storages.items():
        owner, role = (info.producer, info.role) if info.producer is not None else (info.first_op, "in")
        n = counters.get((owner, role), 0)
        counters[(owner, role)] = n + 1
        names[key] = f"{owner}.{role}{n}"
    by_op: dict[str, list] = {}
    for call in recorder.calls:
        by_op.setdefault(call.binding.op, []).append(call)
    backward_s = _backward_times(recorder)
    params = {name: _param_bytes(model, {c.binding.path for c in calls}) for name, calls in by_op.items()}
    tensors: dict[str, TensorSpec] = {}
    enclosing = _enclosing_ops(by_op)
    random_ops = _flag_enclosing(enclosing, {name for name, calls in by_op.items() if any(c.random for c in calls)})
    own_state = {name: next(c.stateful for c in calls if c.stateful) for name, calls in by_op.items()
                 if any(c.stateful for c in calls)}
    stateful: dict[str, str] = {}
    for inner, kind in own_state.items():  # an op's own argument type, else its first child's
        for outer in (inner, *enclosing[inner]):
            stateful.setdefault(outer, kind)
    stateful.update(own_state)
    mutating = {name for name, calls in by_op.items() if any(c.mutates for c in calls)}
    fixed = _not_regenerable(recorder, random_ops | stateful.keys() | mutating)
    marked = any(info.routed for info in recorder.storages.values())
    ops = []
    for name, calls in by_op.items():
        kind, layer = calls[0].binding.kind, calls[0].binding.layer
        inputs = _unique(names[k] for c in calls for k in c.inputs if recorder.storages[k].producer != name)
        outputs = _unique(names[k] for c in calls for k in c.outputs)
        saves = _unique((names[k], d) for c in calls for k, d in c.saves)
        for key in {k for c in calls for k in (*c.inputs, *c.outputs, *(k for k, _ in c.saves))}:
            info = recorder.storages[key]
            dtype = TORCH_TO_NAME.get(info.dtype)
            if dtype is None:
                raise ValueError(f"op {name} uses a {info.dtype} tensor; traced tensors must be one of "
                                 f"{', '.join(sorted(set(TORCH_TO_NAME.values())))}")
            routed = _is_routed(info, by_op, marked) and key not in recorder.weight_copies  # a weight's cast: fixed
            producer = None if key in fixed else info.producer
            tensors[names[key]] = TensorSpec(names[key], info.nbytes // ITEM_BYTES[dtype], dtype, producer, routed)
        flops = sum(c.flops for c in calls)
        moved = params[name] + sum(tensors[t].nbytes for t in (*inputs, *outputs))
        comm = kind in COMM_KINDS or any(c.comm for c in calls)
        if recorder.timed:
            forward_ns = seconds_to_ns(sum(c.forward_s for c in calls))
            backward_ns = seconds_to_ns(backward_s.get(name, 0.0))
        elif comm:
            forward_ns = backward_ns = _comm_ns(hardware, sum(tensors[t].nbytes for t in outputs)
                                                if any(c.comm for c in calls) else 0)
        else:
            attention = sum(c.attention_flops for c in calls)  # the fused attention kernels' FLOPs only
            forward_ns = roofline_ns(hardware, flops, moved, attention_flops=attention)
            backward_ns = roofline_ns(hardware, sum(c.backward_flops for c in calls), 2 * moved,
                                      attention_flops=FLASH_BACKWARD_FACTOR * attention)
        ops.append(Op(name, kind, layer, Resource.COMM if comm else Resource.COMPUTE, inputs, outputs,
                      tuple(Saving(t, d) for t, d in saves), flops, moved, forward_ns, backward_ns))
    tensors = _without_unrunnable_producers(ops, tensors)
    unmapped = _unmapped_op(recorder, names, tensors, {op.name for op in ops})
    pinned = frozenset()
    if unmapped is not None:
        ops.append(unmapped)
        pinned = frozenset((unmapped.name, s.tensor) for s in unmapped.saves)
    graph = _with_routed_counts(recorder, OpGraph(ops=tuple(ops), tensors=tensors, hardware=hardware,
                                                  label=f"traced {type(model).__name__}",
                                                  activation_dtype=activation_dtype, pinned=pinned))
    mapped = {k for c in recorder.calls for k, _ in c.saves}
    outside = {k: b for k, (b, _) in recorder.unmapped.items() if k not in mapped}
    saved = sum(recorder.storages[k].nbytes for k in mapped) + sum(outside.values())
    slots = {(path, call, slot): (names[key], dtype, recorder.storages[key].nbytes, was_input)
             for path, call, slot, key, dtype, was_input in recorder.slots}
    modules = {name: _unique(c.binding.path for c in calls) for name, calls in by_op.items()}
    dependent = _flag_enclosing(enclosing, {name for name, calls in by_op.items()
                                            if any(c.value_dependent for c in calls)})
    kept_outside = graph.copies_bytes({(s.tensor, s.dtype) for s in unmapped.saves}) if unmapped else 0
    return TraceResult(graph, slots, saved, sum(outside.values()), recorder.num_unmapped, frozenset(random_ops),
                       frozenset(dependent), modules, stateful, frozenset(mutating),
                       frozenset(c.binding.path for c in recorder.calls if c.updates_buffers), kept_outside)


def _enclosing_ops(by_op: dict) -> dict[str, set]:
    """Per op, the other ops one of whose modules encloses one of its modules (a re-run of such an op re-runs this
    one too): each module path's dotted ancestors looked up among the mapped paths."""
    op_of_path = {c.binding.path: name for name, calls in by_op.items() for c in calls}
    out: dict[str, set] = {name: set() for name in by_op}
    for path, name in op_of_path.items():
        parts = path.split(".")
        for depth in range(1, len(parts)):
            outer = op_of_path.get(".".join(parts[:depth]))
            if outer is not None and outer != name:
                out[name].add(outer)
    return out


def _flag_enclosing(enclosing: dict[str, set], flagged: set) -> set:
    """``flagged`` ops and every op enclosing one of them (whose re-run re-runs the flagged one)."""
    return set(flagged).union(*(enclosing[name] for name in flagged))


def _is_routed(info, by_op: dict, marked: bool) -> bool:
    """Does the storage hold one row per routed copy? Where the model marks its routed rows (``exec.routed``),
    those first seen there (also one an op made and passed on without returning it: a graph input of the next);
    otherwise what the ``dispatch`` and expert ops make."""
    if marked:
        return info.routed
    return info.producer is not None and by_op[info.producer][0].binding.kind in ROUTED_KINDS


def _mean_routed_tokens(recorder: TraceRecorder) -> int:
    """The routed copies one MoE layer's router sends (tokens x top-k): a rank's mean load, the imbalance's
    denominator. 0 (no counts: the graph cannot be rescaled) when a layer's router ran more than once or the
    layers send different numbers of copies, where one layer's count is no measure of another's."""
    if any(n > 1 for n in recorder.reports.values()) or len(set(recorder.sent.values())) > 1:
        return 0
    return next(iter(recorder.sent.values()), 0)


def _with_routed_counts(recorder: TraceRecorder, graph: OpGraph) -> OpGraph:
    """``graph`` with the routed copies each MoE layer's experts received in the trace (the gate's reports; none
    without a gate): a routed tensor of a layer with no report, or not one row per reported copy, is not routed
    (it keeps its traced size: experts padded to a capacity hold as many rows whatever the routing). A layer whose
    gate reported more copies than any of its routed tensors has elements is a ``ValueError``: the gate counts
    something else, and the graph could not follow the imbalance."""
    mean = _mean_routed_tokens(recorder)
    if not recorder.received or not mean:
        return graph
    tensors = dict(graph.tensors)
    largest: dict[int, int] = {}  # MoE layer -> the most elements one of its routed tensors has
    for name, spec in graph.tensors.items():
        if spec.routed:
            layer = graph.tensor_layers[name]
            largest[layer] = max(largest.get(layer, 0), spec.numel)
            received = recorder.received.get(layer)
            if received is None or (received and spec.numel % received):
                tensors[name] = spec._replace(routed=False)
    for layer, numel in sorted(largest.items()):
        received = recorder.received.get(layer)
        if received and received > numel:
            raise ValueError(f"gate: MoE layer {layer}'s report says its experts received {received} routed token "
                             f"copies, more than the {numel} elements of the largest tensor they keep; the gate "
                             "must report the token copies this rank's experts received")
    return dataclasses.replace(graph, tensors=tensors, mean_routed_tokens=mean,
                               layer_routed_tokens=dict(recorder.received))


def _unmapped_op(recorder: TraceRecorder, names: dict, tensors: dict, taken: set) -> Op | None:
    """The savings made outside every mapped module (the loss, code between modules) as one op, ``unmapped``,
    whose savings are pinned: kept whatever the plan, and counted. A storage that is also a graph tensor keeps its
    name, so a plan that mitigates it elsewhere frees nothing (the outside saving still holds it)."""
    if not recorder.unmapped:
        return None
    name = next(n for n in ("unmapped", *(f"unmapped{i}" for i in range(1, len(taken) + 2))) if n not in taken)
    saves = []
    for n, (key, (nbytes, dtype)) in enumerate(recorder.unmapped.items()):
        dtype_name = TORCH_TO_NAME.get(dtype)
        if dtype_name is None or nbytes % ITEM_BYTES[dtype_name]:
            dtype_name = "int32" if nbytes % 4 == 0 else "bool"  # its bytes are what counts: it is never mitigated
        tensor = names.get(key)
        if tensor is None or tensors[tensor].dtype != dtype_name:
            tensor = f"{name}.saved{n}"
            tensors[tensor] = TensorSpec(tensor, nbytes // ITEM_BYTES[dtype_name], dtype_name, name, False)
        saves.append(Saving(tensor, dtype_name))
    outputs = tuple(dict.fromkeys(s.tensor for s in saves if tensors[s.tensor].producer == name))
    return Op(name, "residual", 0, Resource.COMPUTE, (), outputs, tuple(dict.fromkeys(saves)), 0, 0, 0, 0)


def _not_regenerable(recorder: TraceRecorder, unrepeatable: set) -> set:
    """Storages no re-run may regenerate: those made by an op that drew random numbers, took an object with
    state, itself or a mapped module inside it, or changed one of its inputs in place (it is never re-run:
    ``unrepeatable``), those an op saved without
    returning them that another op reads (a re-run regenerates its own savings, not another op's inputs), and
    those changed in place after their producer made them (router jitter: ``hidden *= noise``; a re-run would
    remake them without the change). They stay graph tensors: kept, offloaded or quantised."""
    read_elsewhere = {k for c in recorder.calls for k in c.inputs
                      if recorder.storages[k].role == "saved" and recorder.storages[k].producer != c.binding.op}
    return {k for k, info in recorder.storages.items()
            if info.producer in unrepeatable or info.modified} | read_elsewhere


def _without_unrunnable_producers(ops: list, tensors: dict) -> dict:
    """``tensors`` with no producer for what an op that can never re-run makes: an op with an input that no op
    makes or saves (made between modules and kept only as another copy: a norm whose bf16 input only its own fp32
    copy keeps, experts that keep bf16 copies of fp32 rows) cannot re-run in backward, nor can an op that reads what
    only such an op makes. Their tensors stay graph tensors: kept, offloaded or quantised, never recomputed."""
    saved = {saving.tensor for op in ops for saving in op.saves}
    never: set[str] = set()
    grown = True
    while grown:
        grown = False
        for op in ops:
            if op.name not in never and any(t not in saved and (tensors[t].producer is None or
                                                                tensors[t].producer in never) for t in op.inputs):
                never.add(op.name)
                grown = True
    return {name: (spec._replace(producer=None) if spec.producer in never else spec)
            for name, spec in tensors.items()}


def _unique(items) -> tuple:
    return tuple(dict.fromkeys(items))


def _param_bytes(model: torch.nn.Module, paths: set[str]) -> int:
    """Bytes of the parameters the modules at ``paths`` own directly (what their op reads besides activations)."""
    modules = dict(model.named_modules())
    return sum(p.numel() * p.element_size() for path in paths for p in modules[path].parameters(recurse=False))


def _backward_times(recorder: TraceRecorder) -> dict[str, float]:
    """Seconds of backward per op: from the moment its output's gradient was ready to the next such moment."""
    events = sorted(recorder.events)
    times: dict[str, float] = {}
    for (at, op), (following, _) in zip(events, events[1:]):
        if op:
            times[op] = times.get(op, 0.0) + following - at
    return times




def _comm_ns(hardware: Hardware, nbytes: float) -> int:
    """A collective that moves ``nbytes`` over the intra-node links (launch only when nothing moves)."""
    rate = hardware.intra_node_bytes_per_s * hardware.link_efficiency
    return seconds_to_ns(hardware.kernel_launch_s + nbytes / rate)
