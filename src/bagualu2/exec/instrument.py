"""Apply the exec layer to a model from outside: :func:`instrument` puts forward hooks on the modules an op map
names, so an architecture-only model needs no ``run_op`` calls.

    instrumented = instrument(model, {"layers.*.attn_norm": "norm1", "layers.*.attn.wq": "qkv", ...})
    graph = instrumented.trace_graph(sample, hardware=presets.hardware("cpu"), loss=loss_fn)  # an OpGraph
    executor = apply_plan(instrumented, greedy.solve(graph, budget).plan)
    with executor.micro_batch("mb0") as record:
        loss = loss_fn(model(sample))
    loss.backward(); executor.release("mb0")

The op map: ``{fnmatch pattern on named_modules() paths: label}``. A label is a cost-model kind (``qkv``), a kind
with a number (``norm1``, ``residual2``: two ops of one kind in a layer), ``name:kind`` (any name, the kind
given), or any other name (a generic memory-bound op, graph kind ``residual``). The op of a module is
``L{layer}.{label}``, the layer being the first integer in its path (ops outside numbered layers are named by
their label, layer 0); modules with the same label in one layer (the experts of a ``ModuleList``) are one op.

While a plan executor records a micro-batch, the pre-hook opens the module's op scope (the pack hook attributes
every saving to the innermost mapped module) and, when the plan re-runs the op, starts a
:class:`~bagualu2.exec.recompute.Replay` of ``module.forward`` on the call's arguments (tensors that need grad or
that an earlier op made are activations, read back or regenerated in backward; other arguments are held as they
are); the post-hook ends it, gates the dual-batch executor's backward, and after a ``router`` calls ``gate`` and
reports the routed copies to the deferred planner (:func:`bagualu2.exec.after_gate`); while tracing, the counts go
into the traced graph (``OpGraph.mean_routed_tokens``, ``layer_routed_tokens``).
"""

from __future__ import annotations

import contextlib
import fnmatch
import re
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping

import torch

from bagualu2.costmodel.config import Hardware
from bagualu2.costmodel.graph import OP_KINDS, OpGraph

from .callargs import stateful_type
from .ops import ACTIVE, OP_SCOPE, after_gate, gate_report, hook_outputs
from .scope import FRAME, REPLAYING, TRACER, Frame, OpBinding
from .trace import TraceRecorder, TraceResult, autocast_of_forward, run_trace
from .tracegraph import build_graph_of
from .tracker import OP_WEIGHTS, WeightStorages, storage_key, weight_keys

# kinds whose savings have the sizes the input's shape gives, whatever the routing (every token passes them)
SHAPE_KINDS = frozenset({"norm", "qkv", "rope", "core_attn", "attn_out", "router", "shared_fc1", "shared_act",
                         "shared_fc2", "mlp_fc1", "mlp_act", "mlp_fc2"})
GENERIC_KIND = "residual"  # the graph kind of a label that names no cost-model kind: memory-bound, no role
SUPPORTED_DEVICES = ("cpu", "cuda")
_LABEL = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DROPOUT_MODULES = (torch.nn.Dropout, torch.nn.Dropout1d, torch.nn.Dropout2d, torch.nn.Dropout3d, torch.nn.AlphaDropout,
                   torch.nn.FeatureAlphaDropout)  # modules whose mode decides whether they draw and save a mask


class _Held:
    """A non-activation tensor argument of a replayed module (a mask, routing metadata): held as it is."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def label_kind(label: str) -> tuple[str, str]:
    """``(label, kind)`` of an op-map value (see the module docstring); ``ValueError`` for a malformed one."""
    if not isinstance(label, str):
        raise ValueError(f"op_map values must be op labels (str), got {type(label).__name__}")
    label, sep, kind = label.partition(":")
    if not _LABEL.match(label):
        raise ValueError(f"op_map label {label!r} must be a name (letters, digits, _)")
    if sep:
        if kind not in OP_KINDS:
            raise ValueError(f"op_map label {label}:{kind}: kind must be one of {', '.join(OP_KINDS)}")
        return label, kind
    if label in OP_KINDS:
        return label, label
    stripped = label.rstrip("0123456789")
    return label, stripped if stripped in OP_KINDS else GENERIC_KIND


def _layer(path: str) -> int | None:
    return next((int(part) for part in path.split(".") if part.isdigit()), None)


def bind(model: torch.nn.Module, op_map: Mapping[str, str]) -> dict[str, OpBinding]:
    """``{module path: OpBinding}`` of every module the op map names (``ValueError`` on a bad op map)."""
    if not isinstance(op_map, Mapping) or not op_map:
        raise ValueError("op_map must be a non-empty mapping {module-path pattern: op label}")
    paths = [path for path, _ in model.named_modules() if path]
    bindings: dict[str, OpBinding] = {}
    for pattern, value in op_map.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"op_map patterns must be non-empty strings, got {pattern!r}")
        label, kind = label_kind(value)
        matched = [path for path in paths if fnmatch.fnmatchcase(path, pattern)]
        if not matched:
            example = ", ".join(paths[:4]) or "none"
            raise ValueError(f"op_map pattern {pattern!r} matches no module of {type(model).__name__} "
                             f"(paths look like: {example})")
        for path in matched:
            if path in bindings:
                raise ValueError(f"op_map names module {path!r} twice (patterns {bindings[path].pattern!r} and "
                                 f"{pattern!r}); each module may belong to one op")
            layer = _layer(path)
            bindings[path] = OpBinding(path, pattern, label, kind, layer or 0,
                                       label if layer is None else f"L{layer}.{label}")
    return bindings


@contextlib.contextmanager
def restored_scope() -> Iterator[None]:
    """The op scope as it was before the block, however the block ends: torch runs the forward hooks that close a
    mapped module's scope for an ``Exception`` only, so a ``KeyboardInterrupt`` inside a mapped module would leave
    its scope open for every later trace and micro-batch."""
    saved = FRAME.get(), OP_SCOPE.get(), OP_WEIGHTS.get()
    try:
        yield
    finally:
        for var, value in zip((FRAME, OP_SCOPE, OP_WEIGHTS), saved):
            if var.get() is not value:
                var.set(value)


def check_device(model: torch.nn.Module) -> None:
    """``ValueError`` unless every parameter and buffer is on a device the executor supports."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.device.type not in SUPPORTED_DEVICES:
            raise ValueError(f"model: {name} is on device {tensor.device.type!r}; the executor supports "
                             f"{', '.join(SUPPORTED_DEVICES)}")


# the modules that carry op hooks (weakly held: a model dropped with its hooks leaves the set)
_HOOKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_OP_HOOKS: weakref.WeakSet = weakref.WeakSet()  # the hook functions: a copy of a hooked module holds them too


class UntracedSavingsWarning(UserWarning):
    """A micro-batch of a traced model saved tensors its traced forward did not: they are kept, unplanned, beyond
    the plan's bytes."""


class InstrumentedModel:
    """A model with op-map hooks (see the module docstring). Call it like the model; :meth:`trace_graph` makes
    its :class:`OpGraph`; :func:`~bagualu2.exec.apply_plan` runs plans on it; :meth:`remove` takes the hooks
    off."""

    def __init__(self, model: torch.nn.Module, bindings: Mapping[str, OpBinding],
                 gate: Callable[..., Any] | None = None):
        self.model = model
        self.bindings = dict(bindings)
        self.gate = gate
        self.trace: TraceResult | None = None
        self.traced_autocast: tuple | None = None  # the autocast state the traced forward ran under
        self.traced_calls: dict[str, int] = {}
        self.traced_training: list[bool] = []  # the mode modules' training flags in the traced forward
        self._mode_modules: list[tuple[str, torch.nn.Module]] = []  # mapped modules and dropout modules
        self.removed = False
        self._restores: list[Callable[[], None]] = []  # what remove() undoes besides the hooks (on_remove)
        # UntracedSavingsWarning once per trace: a model whose savings follow the routing would give it at every
        # micro-batch
        self._warned_untraced = False
        self._warned_outside = False
        self._warned_sizes = False
        modules = dict(model.named_modules())
        self._hooked = [modules[path] for path in self.bindings]
        # the layers transformers' activation checkpointing switches (those with the attribute), found once: every
        # micro-batch reads their flags
        self._checkpointable = [module for module in modules.values() if hasattr(module, "gradient_checkpointing")]
        _HOOKED.update(self._hooked)
        self._handles = []
        self._hook_ids: dict[str, tuple[int, int]] = {}  # per module path: (pre-hook, hook) handle ids
        for path, binding in self.bindings.items():
            module = modules[path]
            # the op is the module's forward, as a replay re-runs it: the pre-hook goes after the module's own
            # pre-hooks and the hook before its own hooks (an expert-parallel dispatch and combine put on the
            # module run outside the op, in its parent)
            pre = module.register_forward_pre_hook(self._pre_hook(binding, module), with_kwargs=True)
            post = module.register_forward_hook(self._post_hook(binding, module), with_kwargs=True,
                                                always_call=True, prepend=True)
            self._handles += [pre, post]
            self._hook_ids[path] = (pre.id, post.id)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    @property
    def graph(self) -> OpGraph:
        """The graph of the latest :meth:`trace_graph`."""
        if self.trace is None:
            raise ValueError("the instrumented model has no traced graph yet: call trace_graph(...) first")
        return self.trace.graph

    def remove(self) -> None:
        """Take the hooks off the model and undo what :meth:`on_remove` was given (it runs as before
        instrumenting)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if not self.removed:
            self.removed = True
            for module in self._hooked:
                _HOOKED.discard(module)
            failed = None
            while self._restores:  # every one, the latest first, whatever one of them raises
                try:
                    self._restores.pop()()
                except BaseException as exc:  # noqa: BLE001 - re-raised once the others ran
                    failed = failed or exc
            if failed is not None:
                raise failed

    def on_remove(self, restore: Callable[[], None]) -> None:
        """Call ``restore()`` when :meth:`remove` takes the hooks off: what an integration changed on the model to
        instrument it is undone with them (the latest given first)."""
        if not callable(restore):
            raise ValueError(f"restore must be a callable, got {type(restore).__name__}")
        if self.removed:
            raise ValueError("the instrumented model's hooks were removed already")
        self._restores.append(restore)

    # ---- tracing --------------------------------------------------------------------------------------------
    @property
    def self_checkpointed(self) -> bool:
        """Whether the model, or a model inside it, runs its layers under its own activation checkpointing
        (transformers' ``activation_checkpointing_enable()`` sets ``gradient_checkpointing`` on the layers): then
        it saves nothing a plan names, and plans are refused."""
        return any(module.gradient_checkpointing is True for module in self._checkpointable)

    def trace_graph(self, *args, hardware: Hardware, timed: bool = False,
                    loss: Callable[[Any], torch.Tensor] | None = None, **kwargs) -> OpGraph:
        """One forward + backward of ``model(*args, **kwargs)`` recorded into an :class:`OpGraph`
        (:mod:`bagualu2.exec.trace`); ``loss(output)`` (default: the sum of the tensors it returns, in tuples,
        lists and dicts too) drives the backward, and what it saves is traced outside every op (give the loss each
        micro-batch computes in its block);
        ``timed``: Δt measured instead of the roofline of ``hardware``. Also kept as :attr:`trace`."""
        if not isinstance(timed, bool):
            raise ValueError(f"timed must be True or False, got {timed!r}")
        if self.removed:
            raise ValueError("the instrumented model's hooks were removed (InstrumentedModel.remove()): nothing can "
                             "be traced; instrument the model again")
        if self.self_checkpointed:
            raise ValueError("the model's own activation checkpointing is on: its layers save nothing a plan could "
                             "name; turn it off (activation_checkpointing_disable())")
        if ACTIVE.get() is not None:
            raise ValueError("trace_graph runs outside micro_batch blocks (a plan executor is recording one)")
        if not isinstance(hardware, Hardware):
            raise ValueError(f"hardware must be a bagualu2 Hardware (e.g. presets.hardware('cpu')), "
                             f"got {type(hardware).__name__}")
        check_device(self.model)
        recorder = TraceRecorder(WeightStorages([self.model]), timed=timed)
        token = TRACER.set(recorder)
        try:
            with restored_scope():
                run_trace(self.model, recorder, args, kwargs, loss)
        finally:
            TRACER.reset(token)
        self.trace = build_graph_of(recorder, self.model, hardware, activation_dtype=self._activation_dtype())
        # a new trace: its first untraced saving (or saving of another size) is said again
        self._warned_untraced = self._warned_outside = self._warned_sizes = False
        self.traced_autocast = recorder.autocast
        self._mode_modules = [(path, module) for path, module in self.model.named_modules()
                              if path in self.bindings or isinstance(module, DROPOUT_MODULES)]
        self.traced_training = [module.training for _, module in self._mode_modules]
        self.traced_calls = dict(recorder.counts)  # module path -> its calls in the traced forward
        return self.trace.graph

    def _check_forward_state(self, record) -> None:
        """The first mapped module of a micro-batch: ``ValueError`` when the forward runs under another autocast
        state than the traced one (its savings have other dtypes than the traced slots: the plan would not
        apply), or with a mapped module or a dropout module in another mode (``train()`` / ``eval()``: dropout
        draws, or does not, and saves its mask, or does not) than traced."""
        record.state_checked = True
        training = [module.training for _, module in self._mode_modules]
        if training != self.traced_training:
            path, module = next((path, module) for (path, module), then in
                                zip(self._mode_modules, self.traced_training) if module.training != then)
            mode = "train" if module.training else "eval"
            raise ValueError(f"micro-batch {record.name!r} runs module {path or type(module).__name__} in {mode} "
                             f"mode, but the model was traced in {'eval' if mode == 'train' else 'train'} mode: "
                             "trace it in the mode it runs (model.train() or model.eval() before trace_graph)")
        now = autocast_of_forward()
        if now != self.traced_autocast:
            on = ", ".join(f"{device} {dtype}" for device, dtype in now if dtype is not None) or "off"
            then = ", ".join(f"{device} {dtype}" for device, dtype in self.traced_autocast or () if dtype is not None)
            raise ValueError(f"micro-batch {record.name!r} runs under autocast {on}, but the model was traced under "
                             f"autocast {then or 'off'}: trace it as it runs (trace_graph inside the same autocast)")

    def check_slots(self, record) -> None:
        """After a micro-batch's forward: ``ValueError`` when most of its savings met their traced slot with
        another dtype — the model was cast (``model.to(dtype)``) since :meth:`trace_graph`, and the plan did not
        apply — or when most savings of the ops every token passes (attention, norms, router, dense and shared MLPs:
        ``SHAPE_KINDS``) have another size than traced — the input's shape (batch size, sequence length) changed,
        and the plan's bytes are not the ones the micro-batch keeps. (A few dtypes may differ where routing shifts
        the slots of a module whose calls save per expert; a wrapper such as FSDP2 that casts parameters for the
        forward casts them in the trace too.)"""
        for path, calls in record.calls.items():
            traced = self.traced_calls.get(path, 0)
            if calls > traced and self.bindings[path].kind in SHAPE_KINDS:
                raise ValueError(f"micro-batch {record.name!r}: module {path} ran {calls} times, {traced} in the "
                                 "traced forward: run one forward per micro_batch block (the savings of another are "
                                 "not the plan's)")
        if record.slot_dtype_misses > record.slot_hits:
            raise ValueError(f"micro-batch {record.name!r}: {record.slot_dtype_misses} savings have other dtypes than "
                             f"their traced slots ({record.slot_hits} match): the model was cast since trace_graph; "
                             "trace it again and make a new executor")
        misses = record.slot_size_misses
        if 2 * len(misses) > record.slot_fixed:
            name, now, traced = misses[0]
            raise ValueError(f"micro-batch {record.name!r}: {len(misses)} of {record.slot_fixed} savings have other "
                             f"sizes than traced (e.g. {name}: {now} bytes, traced {traced}): the input's shape, "
                             "or its path through the model (an attention mask of another layout), changed since "
                             "trace_graph; trace with a batch like the ones the model runs and make a new executor")
        if misses and not self._warned_sizes:  # a few: said once per trace, as below
            self._warned_sizes = True
            name, now, traced = misses[0]
            warnings.warn(f"micro-batch {record.name!r}: {len(misses)} of {record.slot_fixed} savings have other "
                          f"sizes than traced (e.g. {name}: {now} bytes, traced {traced}): the input's shape (the "
                          "same tokens in another batch size and sequence length) or its path through the model "
                          "changed since trace_graph, and it keeps other bytes than its plan's; trace with a batch "
                          "like the ones it trains on", UntracedSavingsWarning, stacklevel=2)
        untraced = {op: nbytes for op, nbytes in record.unknown_ops.items() if op is not None}
        if untraced and not self._warned_untraced:  # savings of an op that met none of its traced slots: said once
            self._warned_untraced = True
            ops = ", ".join(f"{op} {nbytes:,} B" for op, nbytes in list(untraced.items())[:3])
            warnings.warn(f"micro-batch {record.name!r} keeps savings its traced forward did not make ({ops}): it "
                          "took another path through the model than the traced batch (an attention mask of another "
                          "layout, a data-dependent branch, a cache the traced call built, a parameter's "
                          "requires_grad changed since) and keeps other bytes than its plan's; trace with a batch "
                          "like the ones it trains on, after a first call",
                          UntracedSavingsWarning, stacklevel=2)
        outside = record.unknown_ops.get(None, 0)
        if self.trace is not None and outside > self.trace.outside_bytes and not self._warned_outside:
            self._warned_outside = True  # said once per trace, as above
            warnings.warn(f"micro-batch {record.name!r} keeps {outside:,} B saved outside every mapped module, its "
                          f"traced forward {self.trace.outside_bytes:,} B: the code around the modules differs from "
                          "the traced call (another loss, a model around the instrumented one) and the micro-batch "
                          "keeps more than its plan's bytes; trace with the loss it trains with, on the module it "
                          "calls", UntracedSavingsWarning, stacklevel=2)

    def _activation_dtype(self) -> str:
        counts: dict[torch.dtype, int] = {}
        for p in self.model.parameters():
            if p.is_floating_point():
                counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
        dtype = max(counts, key=counts.get) if counts else torch.float32
        return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")

    # ---- executor hooks -------------------------------------------------------------------------------------
    def name_saving(self, record, op: str | None, entry, dtype: str | None, key) -> str | None:
        """The executor's namer on a traced graph: the saving's slot in its module call, as traced."""
        frame = FRAME.get()
        if frame is None or op is None or op != frame.binding.op or self.trace is None:
            return None
        slot = frame.slot
        frame.slot += 1
        found = self.trace.slots.get((frame.binding.path, frame.call, slot))
        if found is None:
            return None
        if found[1] != dtype:
            record.slot_dtype_misses += 1
            return None
        own = found[0].startswith((f"{op}.out", f"{op}.saved"))  # the traced slot held a tensor this op made
        if (found[3] and key not in frame.inputs) or (own and key in frame.inputs):
            # the traced call saved its input here (another op's tensor) and this is none, or it saved a tensor of
            # its own here and this is its input (an earlier saving is gone: a parameter's requires_grad changed):
            # a re-run must not stand in for either, so it is kept as it is, unnamed (the micro-batch warns)
            record.slot_input_misses.append((found[0], frame.binding.path))
            return None
        record.slot_hits += 1
        name = found[0]
        if frame.binding.kind in SHAPE_KINDS:
            record.slot_fixed += 1
            if entry.nbytes != found[2]:
                record.slot_size_misses.append((name, entry.nbytes, found[2]))
        if entry.name is None:
            entry.name = name
            record.named_as(entry, name)
        elif entry.name != name:
            return None
        return name

    def _while_hooked(self, op: str, fn: Callable):
        """``fn``, the op's re-run, refused once :meth:`remove` restored what instrumenting changed (the experts'
        implementation among them): the re-run would save other tensors than the forward did."""
        def rerun(*args):
            if self.removed:
                raise RuntimeError(f"cannot re-run {op} for its backward: InstrumentedModel.remove() took the hooks "
                                   "off while its micro-batch awaited the backward; call remove() after the backward "
                                   "of every micro-batch")
            return fn(*args)

        return rerun

    def _pre_hook(self, binding: OpBinding, own: torch.nn.Module):
        own = weakref.ref(own)

        def hook(module, args, kwargs):
            if REPLAYING.get() or module is not own():  # a copy of the module (copy.deepcopy) runs unhooked
                return None
            active, tracer = ACTIVE.get(), TRACER.get()
            if active is None and tracer is None:
                return None
            if active is not None and (binding.op in active[0].standby or binding.op in active[1].rerun):
                _check_stateless(binding, args, kwargs)  # before any state is set: nothing to undo
                _check_own_hooks_outermost(binding, module, self._hook_ids[binding.path])
            frame = Frame(binding, FRAME.get())
            if active is not None:
                record = active[1]
                frame.call = record.calls.get(binding.path, 0)
                record.calls[binding.path] = frame.call + 1
            frame.tokens = (FRAME.set(frame), OP_SCOPE.set(binding.op),
                            OP_WEIGHTS.set(OP_WEIGHTS.get() | weight_keys(module)))
            if tracer is not None:
                if tracer.autocast is None:
                    tracer.autocast = autocast_of_forward()
                tracer.enter(frame, args, kwargs, tuple(module.named_buffers()))
            if active is not None:
                executor, record = active
                if self.trace is not None:  # what a saving of the call's input must be (name_saving)
                    frame.inputs = frozenset(storage_key(value) for value in (*args, *kwargs.values())
                                             if isinstance(value, torch.Tensor))
                if not record.state_checked and executor.traced is not None:
                    self._check_forward_state(record)
                if record.forward_gate is not None:
                    record.forward_gate(binding.op)  # the dual-batch executor lets this op's stage run
                standby = binding.op in executor.standby
                # under inference_mode nothing is saved for a backward, so nothing is re-run
                if (standby or binding.op in record.rerun) and not torch.is_inference_mode_enabled():
                    snapshot = self.trace is not None and binding.path in self.trace.buffer_modules
                    flat, fn = _replay_call(module, args, kwargs, record, op=binding.op, snapshot=snapshot)
                    fn = self._while_hooked(binding.op, fn)
                    frame.replay = executor.begin_replay(record, binding.op, fn, flat, active=not standby)
            return None

        _OP_HOOKS.add(hook)
        return hook

    def _post_hook(self, binding: OpBinding, own: torch.nn.Module):
        own = weakref.ref(own)

        def hook(module, args, kwargs, output):
            frame = FRAME.get()
            if REPLAYING.get() or frame is None or frame.binding is not binding or module is not own():
                return None
            active, tracer = ACTIVE.get(), TRACER.get()
            try:
                if tracer is not None:
                    tracer.exit(frame, output, tuple(module.named_buffers()))
                if active is not None:
                    executor, record = active
                    if frame.replay is not None:
                        executor.end_replay(record, frame.replay, output)
                    if executor.stage_hooks:
                        hook_outputs(record, binding.op, output)
            finally:
                FRAME.reset(frame.tokens[0])
                OP_SCOPE.reset(frame.tokens[1])
                OP_WEIGHTS.reset(frame.tokens[2])
            if self.gate is not None and binding.kind == "router" and (active is not None or tracer is not None):
                with torch.no_grad():  # the gate counts; what it computes is not part of any op (nothing saved)
                    report = gate_report(self.gate(module, args, output))
                if tracer is not None:
                    tracer.routed_tokens(binding.layer, int(report.received),
                                         int(report.received if report.sent is None else report.sent))
                if active is not None:
                    after_gate(binding.layer, int(report.received), report.group, report.most)
            return None

        _OP_HOOKS.add(hook)
        return hook


def _check_stateless(binding: OpBinding, args: tuple, kwargs: dict) -> None:
    """``ValueError`` if a call the plan re-runs takes an object with state of its own (a cache passed now that
    was not there when the graph was traced): re-running it would change or read that state."""
    held = next((found for value in (*args, *kwargs.values()) if (found := stateful_type(value)) is not None), None)
    if held is not None:
        raise ValueError(f"plan: RECOMPUTE re-runs {binding.op} (module {binding.path}), whose call takes a {held} "
                         "object: a re-run could change or read its state; keep, offload or quantize its savings, "
                         "or run without it (use_cache=False)")


def _check_own_hooks_outermost(binding: OpBinding, module: torch.nn.Module, ids: tuple[int, int]) -> None:
    """``ValueError`` if a call the plan re-runs has a forward pre-hook that runs after the op's (or a forward hook
    before it), i.e. one registered after :func:`instrument`: the op would record other arguments (or outputs) than
    the module's forward takes, and a re-run, which calls ``module.forward``, would compute other values."""
    pre_id, post_id = ids
    if next(reversed(module._forward_pre_hooks), None) != pre_id or next(iter(module._forward_hooks), None) != post_id:
        raise ValueError(f"plan: RECOMPUTE re-runs {binding.op} (module {binding.path}), which got a forward hook "
                         "after instrument(): a re-run calls the module's forward without it and could compute other "
                         "values; register the hook before instrument(), or keep, offload or quantize its savings")


def _replay_call(module: torch.nn.Module, args: tuple, kwargs: dict, record, *, op: str = "the op",
                 snapshot: bool = False) -> tuple[tuple, Callable]:
    """``(flat arguments, fn)`` so that ``fn(*flat)`` re-runs ``module.forward`` on the call's arguments, with the
    hooks silent; non-activation tensors are wrapped so the replay holds them as they are. A re-run leaves the
    module's buffers as they were before it (a module that updates a buffer in its forward, e.g. a MoE module
    counting the tokens it routed, updates it once, as the plain run does). ``snapshot`` (a module whose traced
    call changed its buffers in place, e.g. a running mean it reads and then updates): the buffers are copied
    now, before the forward, and the re-run reads those copies, as the forward read them."""
    keys = tuple(kwargs)
    num_args = len(args)

    def activation(value: torch.Tensor) -> bool:
        known = record.storages.get(storage_key(value))
        return value.requires_grad or (known is not None and not known.ref.expired())

    flat = tuple(_Held(v) if isinstance(v, torch.Tensor) and not activation(v) else v
                 for v in (*args, *kwargs.values()))
    found = [(buffer, buffer.detach().clone()) for buffer in module.buffers()] if snapshot else []
    # what a re-run reads as it is now, not as the forward read it: changed in place in between (a mask buffer the
    # loop refills, a buffer another module updates), the re-run would compute other values, so it refuses
    watched = [v.value for v in flat if isinstance(v, _Held)] + ([] if snapshot else list(module.buffers()))
    versions = [tensor._version for tensor in watched]

    def run(*values):
        changed = sum(tensor._version != version for tensor, version in zip(watched, versions))
        if changed:
            raise RuntimeError(f"re-running {op}: {changed} of the tensors it reads that are no activations (an "
                               "argument held as it is, a buffer) changed in place after its forward, so the re-run "
                               "would compute other values than the forward did; keep, offload or quantize its "
                               "savings instead of recomputing it, or change them only after the backward")
        values = [v.value if isinstance(v, _Held) else v for v in values]
        token = REPLAYING.set(True)
        buffers = [(buffer, buffer.detach().clone(), buffer._version) for buffer in module.buffers()]
        with torch.no_grad():
            for buffer, before in found:  # as the forward found them
                if not torch.equal(buffer, before):
                    buffer.copy_(before)
        try:
            return module.forward(*values[:num_args], **dict(zip(keys, values[num_args:])))
        finally:
            REPLAYING.reset(token)
            with torch.no_grad():  # only what the re-run changed: a copy counts as a change for other ops' checks
                for buffer, before, version in buffers:
                    if buffer._version != version:
                        buffer.copy_(before)
            versions[:] = [tensor._version for tensor in watched]  # the restore above is no change

    return flat, run


def instrument(model: torch.nn.Module, op_map: Mapping[str, str], *,
               gate: Callable[..., Any] | None = None) -> InstrumentedModel:
    """Hooks on the modules ``op_map`` names (see the module docstring). ``gate(router_module, inputs, output)``,
    optional, returns the routed token copies this rank's experts receive (an ``int``, or a
    :class:`~bagualu2.exec.ops.GateReport`: with the expert-parallel group, the group's most and the copies this
    rank sent); it runs after every module of kind ``router``, feeds the deferred planner and, while tracing, gives
    the traced graph its routed token counts (what lets it be rescaled to another imbalance). Raises one
    ``ValueError`` for a pattern that matches nothing, a module named twice, a bad label or an unsupported
    device."""
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if gate is not None and not callable(gate):
        raise ValueError(f"gate must be a callable (router_module, inputs, output) -> int, got {type(gate).__name__}")
    check_instrumentable(model)
    return InstrumentedModel(model, bind(model, op_map), gate)


def check_instrumentable(model: torch.nn.Module) -> None:
    """One ``ValueError`` unless ``model`` is on a supported device and carries no op hooks yet: a second set of
    hooks on a module (of this model, an enclosing one or a part of it) would open its op scope twice, and no
    saving would be named."""
    check_device(model)
    hooked = next((path for path, module in model.named_modules() if module in _HOOKED), None)
    if hooked is not None:
        raise ValueError(f"model is instrumented already (module {hooked or '<root>'!r} has op hooks); call remove() "
                         "on its InstrumentedModel first")
    copied = next((path for path, module in model.named_modules()
                   if any(hook in _OP_HOOKS for hook in (*module._forward_pre_hooks.values(),
                                                         *module._forward_hooks.values()))), None)
    if copied is not None:
        raise ValueError(f"module {copied or '<root>'!r} carries the op hooks of another instrumented model (a copy "
                         "made while that one was instrumented, e.g. copy.deepcopy, keeps its hooks, which no "
                         "remove() takes off the copy): copy the model before instrument() or after remove()")
