"""Trace an instrumented model into an ordinary :class:`~bagualu2.costmodel.OpGraph` (one forward + backward).

While ``model(*args, **kwargs)`` runs, the instrument's module hooks open a :class:`~bagualu2.exec.scope.Frame`
per call of a mapped module and the recorder notes, per call: the activation tensors it takes (tensors that
require grad or that an earlier op made), the tensors it returns, and every tensor autograd saves while it is the
innermost mapped module (storage identity, bytes, dtype; parameters and buffers excluded). A dispatch mode counts
each call's matrix-product and attention FLOPs (torch's FLOP formulas, attention in the cost model's convention),
notes random ops (``nondeterministic_seeded``: RECOMPUTE needs a deterministic module) and collectives.

Graph tensors are storages, as the tracker counts them: a storage returned by op ``P`` is ``P.out<n>`` (produced
by ``P``: a re-run of ``P`` regenerates it); one ``P`` saves without returning it is ``P.saved<n>`` (regenerated as
the re-run's own saving); one no mapped module made (the block input, what unmapped code computes between ops, a
constant passed in such as rotary tables) is ``<first op>.in<n>``, a graph input: kept, offloaded or quantised,
never recomputed. Savings outside every mapped module are the pinned savings of one more op, ``unmapped``: kept
by every plan and counted. Every saved storage is held until the trace ends, so no address is reused (two
storages are never taken for one). A call that takes an object with state of its own (a KV cache) is noted:
re-running it is refused. Calls of modules with the same label in one layer (the
experts of a ``ModuleList``, q/k/v projections) are one op. Δt: the roofline of ``build_graph`` on the counted
FLOPs and the bytes the op reads and writes (backward: twice); collectives on the communication resource; or,
with ``timed=True``, the measured wall time of each op's forward and backward. Routed tensors (one row per routed
token copy the experts received) are those first seen inside ``exec.routed()`` where the model marks them, else
what the ``dispatch`` and expert ops make; the gate's reports give the copies each MoE layer received. The graph
itself is assembled by :mod:`bagualu2.exec.tracegraph`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Mapping

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry, shape_wrapper

from bagualu2.costmodel.build import FLASH_BACKWARD_FACTOR
from bagualu2.costmodel.graph import OpGraph

from .callargs import draws_random, nested_tensors, stateful_type, tensors_of
from .flops import attention_formulas
from .record import TORCH_TO_NAME
from .scope import FRAME, ROUTED, TRACER, Frame
from .tracker import is_parameter, storage_bytes, storage_key

ROUTED_KINDS = frozenset({"dispatch", "expert_fc1", "expert_act", "expert_fc2"})  # sizes follow the routing
COMM_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})
VALUE_READS = frozenset({torch.ops.aten._local_scalar_dense, torch.ops.aten.equal})  # .item(), .tolist(), ==
COPIES = frozenset({torch.ops.aten._to_copy, torch.ops.aten.clone})  # what casts or copies a weight


@dataclass(frozen=True)
class TraceResult:
    """What :meth:`InstrumentedModel.trace_graph` found. ``slots`` names the savings of a call: ``(module path, call,
    slot) -> (tensor, dtype, storage bytes, whether the call took it as an input)``; ``saved_bytes`` is every
    storage ``model(...)`` saved (deduplicated, as the tracker counts), ``unmapped_bytes`` those saved only outside
    mapped modules (not in the graph, never mitigated); ``outside_bytes`` what a forward like the traced one keeps
    outside every mapped module, counted as the executor counts it (the pinned ``unmapped`` op's savings, a storage
    a mapped op also saved included); ``random_ops`` the ops that drew random numbers; ``modules`` the module paths
    of each op; ``mutating_ops`` the ops that changed one of their inputs in place (a re-run would change it again)
    or replaced a buffer; ``buffer_modules`` the module paths whose calls changed their buffers in place (a re-run
    starts from the buffers as the forward found them)."""

    graph: OpGraph
    slots: Mapping[tuple[str, int, int], tuple[str, str, int, bool]]
    saved_bytes: int
    unmapped_bytes: int
    num_unmapped_savings: int
    random_ops: frozenset[str]
    value_dependent_ops: frozenset[str]
    modules: Mapping[str, tuple[str, ...]]
    stateful_ops: Mapping[str, str] = field(default_factory=dict)  # op -> type of an argument that holds state
    mutating_ops: frozenset[str] = frozenset()
    buffer_modules: frozenset[str] = frozenset()
    outside_bytes: int = 0


class _Call:
    __slots__ = ("binding", "inputs", "outputs", "saves", "flops", "backward_flops", "attention_flops", "start_s",
                 "inner_s", "forward_s", "random", "comm", "value_dependent", "stateful", "versions", "mutates",
                 "buffers", "updates_buffers")

    def __init__(self, binding):
        self.binding = binding
        self.inputs: list = []
        self.outputs: list = []
        self.saves: list = []
        self.flops = 0
        self.backward_flops = 0.0  # 2 x the forward's, 2.5 x a fused attention kernel's (it re-computes the scores)
        self.attention_flops = 0  # the forward FLOPs of fused attention kernels (``Hardware.attention_share``)
        self.start_s = self.inner_s = self.forward_s = 0.0
        self.random = self.comm = self.value_dependent = False
        self.stateful: str | None = None  # the type of an argument that holds state (a KV cache), if any
        self.versions: list = []  # (input tensor, its in-place counter) while the call runs
        self.mutates = False  # the call changed one of its input tensors in place (or replaced a buffer)
        self.buffers: list = []  # (buffer, its in-place counter) of the module while the call runs
        self.updates_buffers = False  # the call changed one of its module's buffers in place


class _Storage:
    __slots__ = ("nbytes", "dtype", "producer", "role", "first_op", "routed", "version", "modified")

    def __init__(self, tensor: torch.Tensor, producer: str | None, role: str, first_op: str):
        self.nbytes, self.dtype = storage_bytes(tensor), tensor.dtype
        self.producer, self.role, self.first_op = producer, role, first_op
        self.routed = ROUTED.get()  # first seen while the model made its routed rows (``exec.routed``)
        self.version = tensor._version  # autograd's in-place counter when its producer was done with it
        self.modified = False  # changed in place after that: a re-run of the producer would not remake it

    def seen(self, tensor: torch.Tensor) -> None:
        """``tensor`` (this storage) is read again: note an in-place change since its producer made it."""
        self.modified = self.modified or tensor._version != self.version


class _Counter(TorchDispatchMode):
    """Per-call FLOPs, random ops and collectives of the innermost mapped module (see the module docstring)."""

    def __init__(self):
        super().__init__()
        fused = attention_formulas()
        self.registry = {**flop_registry, **{k: shape_wrapper(v) for k, v in fused.items()}}
        self.fused = frozenset(fused)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        frame = FRAME.get()
        call = frame.state if frame is not None else None
        if call is not None:
            formula = self.registry.get(func._overloadpacket)
            if formula is not None:
                flops = int(formula(*args, **kwargs, out_val=out))
                call.flops += flops
                if func._overloadpacket in self.fused:
                    call.attention_flops += flops
                    call.backward_flops += flops * FLASH_BACKWARD_FACTOR
                else:
                    call.backward_flops += flops * 2
            if torch.Tag.nondeterministic_seeded in func.tags and draws_random(func, args, kwargs):
                call.random = True
            if func.namespace in COMM_NAMESPACES:
                call.comm = True
            if torch.Tag.dynamic_output_shape in func.tags or func._overloadpacket in VALUE_READS:
                call.value_dependent = True
        if func._overloadpacket in COPIES and args and isinstance(args[0], torch.Tensor) and isinstance(
                out, torch.Tensor):
            tracer, source = TRACER.get(), storage_key(args[0])
            if tracer is not None and (is_parameter(args[0]) or source in tracer.excluded
                                       or source in tracer.weight_copies):
                tracer.weight_copies.add(storage_key(out))  # a cast or copy of a weight: not routed rows
                tracer.alive.append(out)  # its address is not reused by a later tensor while the trace runs
        return out


class TraceRecorder:
    """The hooks' side of one trace (see the module docstring); ``excluded`` are parameter and buffer storages."""

    def __init__(self, excluded: Container, *, timed: bool):
        self.excluded, self.timed = excluded, timed
        self.calls: list[_Call] = []
        self.storages: dict[tuple, _Storage] = {}
        self.constants: set[tuple] = set()  # storages passed to a mapped module that need no grad and nothing made
        self.unmapped: dict[tuple, tuple[int, torch.dtype]] = {}  # storage -> (bytes, dtype), saved outside
        self.num_unmapped = 0
        self.slots: list[tuple[str, int, int, tuple, str, bool]] = []  # ..., whether the call took it as input
        self.counts: dict[str, int] = {}
        self.alive: list[torch.Tensor] = []  # storages stay alive until the trace ends: no address is reused
        self.events: list[tuple[float, str]] = []  # (time, op) when the gradient of an op's output was ready
        self.received: dict[int, int] = {}  # MoE layer -> routed copies its experts received (the gate's report)
        self.sent: dict[int, int] = {}      # MoE layer -> routed copies this rank's router sent
        self.reports: dict[int, int] = {}   # MoE layer -> gate reports (router calls)
        self.weight_copies: set[tuple] = set()  # storages made by casting or copying a parameter
        self.autocast: tuple | None = None  # the autocast state the forward ran under (autocast_of_forward)

    def routed_tokens(self, layer: int, received: int, sent: int) -> None:
        """The gate's report after MoE layer ``layer``'s router (a layer seen twice: the counts add up, and the
        graph gets no counts: the gate at run time reports one call)."""
        self.received[layer] = self.received.get(layer, 0) + received
        self.sent[layer] = self.sent.get(layer, 0) + sent
        self.reports[layer] = self.reports.get(layer, 0) + 1

    def enter(self, frame: Frame, args: tuple, kwargs: dict, buffers: tuple = ()) -> None:
        """A mapped module's call begins (``buffers``: the module's ``(name, buffer)``, to see whether the call
        changes them)."""
        binding = frame.binding
        frame.call = self.counts.get(binding.path, 0)
        self.counts[binding.path] = frame.call + 1
        call = frame.state = _Call(binding)
        call.buffers = [(name, buffer, buffer._version) for name, buffer in buffers]
        self.calls.append(call)
        for value in (*args, *kwargs.values()):
            if not isinstance(value, torch.Tensor):
                call.stateful = call.stateful or stateful_type(value)
                inner = nested_tensors(value)
                self.constants.update(storage_key(t) for t in inner
                                      if not t.requires_grad and storage_key(t) not in self.excluded)
                self.alive.extend(inner)
                continue
            key = storage_key(value)
            if key in self.excluded or not (value.requires_grad or key in self.storages):
                if key not in self.excluded:  # a constant (held as it is by a replay): saved, it is an input
                    self.constants.add(key)
                    self.alive.append(value)
                continue
            if key not in self.storages:
                self.storages[key] = _Storage(value, None, "in", binding.op)
                self.alive.append(value)
            else:
                self.storages[key].seen(value)
            call.inputs.append(key)
            call.versions.append((value, value._version))
        if self.timed:
            call.start_s = time.perf_counter()

    def exit(self, frame: Frame, output: Any, buffers: tuple = ()) -> None:
        """The call ends (``buffers``: the module's ``(name, buffer)`` now: one replaced by another tensor cannot be
        restored for a re-run, one changed in place can; one made by the call, a cache built on the first call, is
        as a re-run finds it)."""
        call, op = frame.state, frame.binding.op
        now = dict(buffers)
        call.mutates = (any(tensor._version != version for tensor, version in call.versions)
                        or any(name in now and now[name] is not buffer for name, buffer, _ in call.buffers))
        call.updates_buffers = any(buffer._version != version for _, buffer, version in call.buffers)
        call.versions = call.buffers = []
        if self.timed:
            elapsed = time.perf_counter() - call.start_s
            call.forward_s = elapsed - call.inner_s
            if frame.parent is not None and frame.parent.state is not None:
                frame.parent.state.inner_s += elapsed
        for tensor in tensors_of(output):
            key = storage_key(tensor)
            if key in self.excluded:
                continue
            info = self.storages.get(key)
            if info is None:
                self.storages[key] = _Storage(tensor, op, "out", op)
                self.alive.append(tensor)
            elif info.producer == op and info.role == "saved":
                info.role = "out"  # a saving of its own that it returns
                info.version = tensor._version  # as it leaves its producer
            else:
                continue  # an input or an earlier op's tensor passed through
            call.outputs.append(key)
            if self.timed and tensor.requires_grad:
                tensor.register_hook(lambda grad, op=op: self.events.append((time.perf_counter(), op)))

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key in self.excluded or is_parameter(tensor):
            return tensor
        frame = FRAME.get()
        if frame is None or frame.state is None:
            self.num_unmapped += 1
            self.unmapped.setdefault(key, (storage_bytes(tensor), tensor.dtype))
            if key not in self.storages:
                self.alive.append(tensor)  # no address reused while the trace runs
            return tensor.detach()
        binding = frame.binding
        dtype = TORCH_TO_NAME.get(tensor.dtype)
        if dtype is None:
            raise ValueError(f"module {binding.path} saves a {tensor.dtype} tensor; traced savings must be one of "
                             f"{', '.join(sorted(set(TORCH_TO_NAME.values())))}")
        if key not in self.storages:  # made by this op, unless it came in as a constant argument (cos/sin tables)
            made = key not in self.constants
            self.storages[key] = _Storage(tensor, binding.op if made else None, "saved" if made else "in",
                                          binding.op)
            self.alive.append(tensor)  # a saving whose graph branch dies in the forward must not lend its address
        elif self.storages[key].producer != binding.op:
            self.storages[key].seen(tensor)  # saved by another op: as that op reads it
        frame.state.saves.append((key, dtype))
        self.slots.append((binding.path, frame.call, frame.slot, key, dtype, key in frame.state.inputs))
        frame.slot += 1
        return tensor.detach()


def autocast_of_forward() -> tuple:
    """The autocast state a forward runs under now: per device type, its autocast dtype or None when off."""
    return tuple((device, torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None)
                 for device in ("cpu", "cuda"))


def run_trace(model: torch.nn.Module, recorder: TraceRecorder, args: tuple, kwargs: dict,
              loss: Callable[[Any], torch.Tensor] | None) -> None:
    """``model(*args, **kwargs)`` under the recorder's pack hook and the counter, ``loss(output)`` under the hook,
    then backward (gradients are computed, not accumulated into ``.grad``)."""
    if loss is not None and not callable(loss):
        raise ValueError(f"trace_graph: loss must be a callable (output -> scalar tensor), got {type(loss).__name__}")
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        raise ValueError("trace_graph runs a forward and a backward: call it outside torch.no_grad() and "
                         "torch.inference_mode()")
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        with _Counter():
            output = model(*args, **kwargs)
        # the loss the training computes inside its micro-batch: what it saves is kept there too (outside every op)
        value = loss(output) if loss is not None else None
    if loss is not None:
        if not (isinstance(value, torch.Tensor) and value.numel() == 1 and value.requires_grad):
            raise ValueError("trace_graph: loss(output) must be a one-element tensor that needs grad, got "
                             + (f"a tensor of shape {tuple(value.shape)} (requires_grad={value.requires_grad})"
                                if isinstance(value, torch.Tensor) else type(value).__name__))
    else:
        # every tensor the model returns, in tuples, lists and dicts too (a transformers ModelOutput is a dict)
        parts = [t.float().sum() for t in nested_tensors(output) if t.requires_grad]
        if not parts:
            raise ValueError(f"trace_graph: the model's output ({type(output).__name__}) holds no tensor that needs "
                             "grad for the backward (no parameter and no input requires grad?); pass loss=...")
        value = torch.stack(parts).sum()
    targets = list({id(t): t for t in (*model.parameters(), *nested_tensors((args, kwargs)))
                    if t.requires_grad}.values())
    try:
        if targets:  # computed, not accumulated into any .grad (an input made upstream stops the backward there)
            torch.autograd.grad(value.reshape(()), targets, allow_unused=True)
        else:  # only tensors made inside the forward need grad
            value.backward()
    except RuntimeError as error:
        if "use_reentrant=True" not in str(error):
            raise
        raise ValueError("trace_graph: the model calls torch.utils.checkpoint with use_reentrant=True, whose saved "
                         "tensors no plan can name; use use_reentrant=False or leave the checkpointing to the "
                         "plans") from None
    recorder.events.append((time.perf_counter(), ""))  # the end of backward
