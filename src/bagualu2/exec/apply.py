"""Apply a plan (KEEP / OFFLOAD / QUANTIZE / RECOMPUTE) to a model's forward through saved-tensor hooks.

    executor = apply_plan(model_or_graph, plan)                 # ValueError on an invalid plan
    with executor.micro_batch("mb0") as record:                # the forward of micro-batch "mb0"
        loss = model(tokens)...
    record.device_bytes, record.host_bytes                     # compare with evaluate(graph, plan)
    executor.prefetch("mb0")                                   # optional: start reloading its host copies
    loss.backward()
    executor.release("mb0")

The model is instrumented (:func:`~bagualu2.exec.instrument`: module hooks open op scopes) or runs its ops through
:func:`~bagualu2.exec.ops.run_op`. The pack hook names each saved tensor by its
storage (a storage seen before keeps its name; a new one gets the current op's first saving of the same dtype and
exactly its expected bytes, or, routed, any size; ambiguous ones are named by the op) and applies
``resolve(graph, plan)[(op, tensor)]`` in this order: KEEP the tensor; OFFLOAD one host copy per storage through
the :class:`~bagualu2.exec.packing.CopyEngine` (side CUDA streams, pinned pool; synchronous on CPU); QUANTIZE one
FP8 e4m3 copy per storage with a per-tensor scale; RECOMPUTE nothing, regenerated in backward by replaying the
plan's re-run closure (:mod:`bagualu2.exec.recompute`). Unnamed savings are kept and reported as ``unknown``.
Device bytes (kept storages + FP8 copies) are what the tracker's cap applies to. With a
:class:`~bagualu2.exec.deferred.DeferredPlanner`, a MoE module whose routed tokens do not fit switches to full
recompute after its gate. docs/exec.md has the details and the measurements.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bagualu2.costmodel.evaluate import mitigation_ops, resolve
from bagualu2.costmodel.graph import ITEM_BYTES, OpGraph
from bagualu2.costmodel.plan import Plan
from bagualu2.costmodel.strategy import Strategy

from .instrument import InstrumentedModel, check_device, restored_scope
from .plancheck import check_replayable, check_sources
from .ops import ACTIVE, FORWARD_GATE, OP_HINTS, OP_SCOPE
from .provisional import Provisional, settle, standby_ops
from .packing import (CopyEngine, HostCopy, Offloaded, Quantized, View, flat_storage, quantize_fp8, saved_alias,
                      unpack)
from .record import TORCH_TO_NAME, MicroBatchRecord
from .recompute import Regenerated, Replay, Source, Stored, autocast_state, checksums
from .tracker import (ActivationOutOfMemoryError, ActivationTracker, check_name, names_text, recording,
                      storage_key)


class PlanExecutor:
    """Saved-tensor hooks that apply ``plan`` to micro-batches of ``graph``'s ops (see the module docstring)."""

    def __init__(self, graph: OpGraph, plan: Plan | str | None, *, tracker: ActivationTracker | None = None,
                 exclude: Iterable[torch.nn.Module] = (), deferred=None, engine: CopyEngine | None = None,
                 namer: Callable | None = None, verify: bool = False, instrumented=None):
        self.graph = graph
        self.instrumented = instrumented  # the InstrumentedModel whose hooks name the savings (None: none)
        self.traced = None  # the trace whose slots name the savings (apply_plan on an InstrumentedModel's graph)
        if not isinstance(verify, bool):
            raise ValueError(f"verify must be True or False, got {verify!r}")
        self.verify = verify
        # names each saving ``(record, op, entry, dtype name, storage key) -> tensor name | None``: by default the
        # op's savings of that dtype and size (cost-model graphs); a traced graph names them by call and slot
        self.namer = namer or self._name
        self.plan = Plan.coerce(plan) or Plan()
        self.strategies = resolve(graph, self.plan)
        self.rerun = frozenset(mitigation_ops(graph, self.plan).rerun)
        self.tracker = tracker if tracker is not None else ActivationTracker(exclude=exclude)
        if tracker is not None:
            self.tracker.exclude(*exclude)
        self.deferred = deferred
        # ops before a MoE gate whose outputs the gate may still re-plan (graded deferred planning): they run as
        # standby replays and what they save of those outputs is held provisionally until the gate settles it
        self.standby, self._provisional = standby_ops(graph, deferred)
        self.engine = engine or CopyEngine()
        self.stage_hooks = False    # gate backward per op (set by the dual-batch executor)
        # every EP rank runs the same plan and budget per micro-batch (the trainer agrees on them): the gates then
        # decide for the group's busiest rank without a collective
        self.agreed = False
        self.defer_offloads = False  # OFFLOAD copies wait for offload_now() (the dual-batch executor's O stages)
        # op name -> [(tensor, dtype name, expected bytes)] in graph order
        self._savings = {op.name: [(s.tensor, s.dtype, graph.tensors[s.tensor].numel * ITEM_BYTES[s.dtype])
                                   for s in op.saves] for op in graph.ops if op.saves}
        self._records: dict[str, MicroBatchRecord] = {}
        self._ids = itertools.count()
        self._resolved: dict[tuple, tuple] = {self.plan.entries: (self.strategies, self.rerun)}

    def _resolve(self, plan: Plan) -> tuple[dict, frozenset[str]]:
        """``(strategies, re-run ops)`` of ``plan`` on this graph (memoised per plan)."""
        found = self._resolved.get(plan.entries)
        if found is None:
            if len(self._resolved) > 256:
                self._resolved.clear()
            found = self._resolved[plan.entries] = (resolve(self.graph, plan),
                                                    frozenset(mitigation_ops(self.graph, plan).rerun))
        return found

    # ---- micro-batches ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, name: str, *, plan: Plan | str | None = None,
                    budget_bytes: int | None = None) -> Iterator[MicroBatchRecord]:
        """Apply the plan to what autograd saves while the forward of micro-batch ``name`` runs in this block.

        ``plan`` (default: the executor's) is this micro-batch's plan before its gates; ``budget_bytes`` (default:
        the deferred planner's) the budget its gates decide against. Under a dual-batch executor whose forward
        records its own micro-batch, the executor's gate is picked up here (``FORWARD_GATE``)."""
        check_name(name)
        if name in self._records:
            raise ValueError(f"micro-batch {name!r} is already in flight")
        if self.traced is not None:
            if self.instrumented.trace is not self.traced:
                raise ValueError("the model was traced again (trace_graph) after this executor was made: its plan "
                                 "names the savings of the earlier trace; make a new executor (apply_plan)")

        if self.instrumented is not None and self.instrumented.removed:
            raise ValueError("the instrumented model's hooks were removed (InstrumentedModel.remove()): the plan "
                             "cannot apply; instrument the model again and make a new executor")
        if self.instrumented is not None and self.instrumented.self_checkpointed:
            raise ValueError("the model's own activation checkpointing is on (turned on after instrument): its "
                             "layers save nothing the plan names; turn it off (activation_checkpointing_disable())")
        plan = self.plan if plan is None else Plan.coerce(plan)
        strategies, rerun = self._resolve(plan)
        record = self._records[name] = MicroBatchRecord(name, plan, strategies, rerun, self.tracker.open(name))
        record.budget_bytes = budget_bytes
        record.forward_gate = FORWARD_GATE.get()
        token = ACTIVE.set((self, record))

        def unpack_here(packed):
            if record.forwarding:  # a backward inside the block: its copies and re-runs are not settled yet
                record.backward_inside = True
            return unpack(packed)

        try:
            record.forwarding = True
            with recording(name), restored_scope(), torch.autograd.graph.saved_tensors_hooks(
                    lambda t: self._pack(record, t), unpack_here):
                yield record
                record.forwarding = False
                if record.backward_inside:
                    raise ValueError(f"micro-batch {name!r}: backward ran inside its micro_batch block; end the "
                                     "block after the forward, then call backward")
                if self.traced is not None:
                    self.instrumented.check_slots(record)
                self._settle(record, None)  # layers whose gate was never reported: the plan in force
                check_sources(record)
        except BaseException:
            self._records.pop(name, None)
            self.tracker.drop(name)
            raise
        finally:
            record.forwarding = False
            ACTIVE.reset(token)
            record.storages.clear()  # naming is per forward; the packed copies live in autograd's graph

    def __contains__(self, name: object) -> bool:
        """Is micro-batch ``name`` in flight here (recorded, not yet released)?"""
        return name in self._records

    def record(self, name: str) -> MicroBatchRecord:
        try:
            return self._records[name]
        except (KeyError, TypeError):  # TypeError: an unhashable name
            raise ValueError(f"micro-batch {name!r} is not in flight; in flight: {names_text(self._records)}") \
                from None

    def device_bytes(self, name: str) -> int:
        """Device bytes micro-batch ``name`` keeps: kept storages + FP8 copies (compare ``activation_bytes``)."""
        return self.record(name).device_bytes

    def host_bytes(self, name: str) -> int:
        """Host bytes of its offloaded copies (compare ``evaluate(graph, plan).host_bytes``)."""
        return self.record(name).host_bytes

    def prefetch(self, name: str) -> int:
        """Start the host->device copies of micro-batch ``name``'s offloaded storages (before its backward, on
        the copy stream on CUDA; on CPU the copies run now). Returns how many were started."""
        return sum(copy.prefetch(self.engine) for copy in self.record(name).host_copies)

    def offload_now(self, name: str, tensors: Iterable[str] | None = None) -> int:
        """Start the deferred device->host copies of micro-batch ``name`` (of ``tensors``, default all); returns
        how many started. Only with ``defer_offloads``; until then the storage stays on the device."""
        record = self.record(name)
        started = 0
        for tensor in list(record.pending_offloads) if tensors is None else sorted(_names("tensors", tensors)):
            for entry in record.pending_offloads.pop(tensor, ()):
                copy = self.engine.offload(entry.host.pending)
                entry.host.host, entry.host.done, entry.host.pending = copy.host, copy.done, None
                started += 1
        return started

    def recover(self, name: str, tensors: Iterable[str] = (), ops: Iterable[str] = ()) -> int:
        """Recovery ahead of micro-batch ``name``'s backward: reload the host copies of ``tensors`` and re-run the
        replays of ``ops`` now (cached until backward uses them). Returns how many actions started."""
        record = self.record(name)
        wanted, rerun = _names("tensors", tensors), _names("ops", ops)
        started = sum(copy.prefetch(self.engine) for copy in record.host_copies if copy.name in wanted)
        for replay in record.replays:
            if replay.op in rerun and replay.runs == 0:
                replay.output(0)
                started += 1
        return started

    def release(self, name: str) -> MicroBatchRecord:
        """Forget micro-batch ``name`` (its backward ran); its host buffers go back to the pool. A host copy that a
        saved-tensor handle has not read back yet (released before its backward, or never backwarded) stays with
        the autograd graph that holds it: only copies every handle read are reused."""
        record = self.record(name)
        del self._records[name]
        self.tracker.drop(name)
        for copy in record.host_copies:
            if copy.host is not None and copy.users <= 0:
                self.engine.pool.give(copy.host, copy.last_read)
        record.clear()
        return record

    # ---- deferred planning ------------------------------------------------------------------------------------
    def gate(self, record: MicroBatchRecord, layer: int, received_tokens: int, group,
             group_max_tokens: int | None = None) -> bool:
        """MoE layer ``layer``'s gate has routed ``received_tokens`` copies here: ask the deferred planner which
        plan runs now (under EP all ranks agree, see :func:`~bagualu2.exec.ops.after_gate`), then settle what the
        layer held provisionally. Returns whether the plan changed."""
        record.received_tokens[layer] = received_tokens
        record.group_max_tokens[layer] = received_tokens if group_max_tokens is None else group_max_tokens
        agreed = group is not None and self.agreed and group_max_tokens is not None
        plan = self.deferred.after_gate(record.plan, layer, group_max_tokens if agreed else received_tokens,
                                        budget_bytes=record.budget_bytes)
        changed = plan is not None
        if group is not None and not agreed and not getattr(self.deferred, "fixed", False):
            device = (torch.device("cuda", torch.cuda.current_device())
                      if torch.distributed.get_backend(group) == "nccl" else torch.device("cpu"))
            flag = torch.tensor([int(changed)], device=device)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=group)
            changed = bool(flag.item())
            if changed:  # ranks may have decided differently: all run the same full downgrade (same re-runs)
                plan = self.deferred.downgrade(record.plan, layer)
        if changed:
            record.plan = plan
            record.strategies, record.rerun = self._resolve(plan)
            record.downgraded.append(layer)
        self._settle(record, layer)
        return changed

    def _settle(self, record: MicroBatchRecord, layer: int | None) -> None:
        settle(record, self.graph, layer, self._apply)

    # ---- recompute ------------------------------------------------------------------------------------------
    def replayable(self, record: MicroBatchRecord, name: str, fn, args, *, active: bool = True) -> Any:
        """Run op ``name`` as ``fn(*args)`` recording it as a :class:`Replay` backward can re-run. A standby
        replay (``active=False``) takes no holds until the gate activates it."""
        replay = self.begin_replay(record, name, fn, args, active=active)
        try:
            outputs = fn(*args)
        except BaseException:
            record.active = replay.parent
            raise
        return self.end_replay(record, replay, outputs)

    def begin_replay(self, record: MicroBatchRecord, name: str, fn, args, *, active: bool = True) -> Replay:
        """Start recording op ``name``, about to run as ``fn(*args)``, as a :class:`Replay` (the first half of
        :meth:`replayable`, for callers that run the op themselves, e.g. module hooks); it is the micro-batch's
        active replay until :meth:`end_replay`. Replays nest: a saving counts in every enclosing replay."""
        sources = []
        holds = []
        inputs = list(self.graph.op(name).inputs) if self.graph.has_op(name) else []
        lookup = lambda tensor_name: record.stored_as(tensor_name, self.engine)  # noqa: E731
        given: dict[int, Source] = {}  # one tensor given twice (self-attention's query, key and value) is one Source
        for arg in args:
            if isinstance(arg, torch.Tensor) and id(arg) in given:
                sources.append(given[id(arg)])  # the re-run gets one tensor for both, as the forward did
            elif isinstance(arg, torch.Tensor) and not self.tracker.excludes(arg):
                stored = self._storage(record, arg, storage_key(arg))
                # the op's graph input of its size and dtype, if one: where to look for a copy in another precision
                input_name = self._input_name(inputs, arg)
                if active:
                    if stored.producer is not None:
                        stored.producer[0].pending += 1
                    stored.hold()
                    record.hold_name(stored.name or input_name, arg.dtype)
                else:
                    holds.append((stored, stored.name or input_name, arg.dtype))
                sources.append(Source(stored, View.of(arg), arg.requires_grad, lookup, input_name))
                given[id(arg)] = sources[-1]
            else:
                sources.append(arg)
        replay = Replay(name, fn, tuple(sources), self.engine, inactive=None if active else holds,
                        parent=record.active, autocast=autocast_state())
        record.active = replay
        return replay

    def end_replay(self, record: MicroBatchRecord, replay: Replay, outputs: Any) -> Any:
        """Finish recording ``replay`` (started by :meth:`begin_replay`) with the op's ``outputs``."""
        record.active = replay.parent
        if self.verify:
            replay.expected = checksums(outputs)
        active = replay.inactive is None
        sources = replay.args
        name = replay.op
        names = self.graph.op(name).outputs if self.graph.has_op(name) else ()
        makes = False
        for index, out in enumerate(outputs if isinstance(outputs, tuple) else (outputs,)):
            if isinstance(out, torch.Tensor):
                stored = self._storage(record, out, storage_key(out))
                if stored.producer is None:
                    stored.producer = (replay, index)
                    makes = makes or index < len(names) or not names  # an activation output of its own
                if index < len(names):
                    record.producers.setdefault(names[index], (replay, index))
        if not makes and active:  # an identity (dispatch at EP=1): its outputs are its inputs, made by their makers
            for source in {id(source): source for source in sources}.values():
                if isinstance(source, Source) and source.stored.producer is not None:
                    source.stored.producer[0].pending -= 1
        record.replays.append(replay)
        if not active:
            record.standby.append(replay)
        return outputs

    def _input_name(self, inputs: list[str], tensor: torch.Tensor) -> str | None:
        dtype = TORCH_TO_NAME.get(tensor.dtype)
        for candidate in inputs:
            spec = self.graph.tensors[candidate]
            if spec.dtype == dtype and spec.numel == tensor.numel():
                inputs.remove(candidate)
                return candidate
        return None

    # ---- the hook -------------------------------------------------------------------------------------------
    def _charge(self, record: MicroBatchRecord, key, nbytes: int) -> None:
        if key in record.device.storages:
            return
        tracker = self.tracker
        if tracker.cap_bytes is not None and tracker.in_flight_bytes + nbytes > tracker.cap_bytes:
            raise ActivationOutOfMemoryError(
                f"activations in flight would reach {tracker.in_flight_bytes + nbytes} bytes, over the cap of "
                f"{tracker.cap_bytes} bytes")
        record.device.storages[key] = nbytes
        tracker.observe()

    def _storage(self, record: MicroBatchRecord, tensor: torch.Tensor, key) -> Stored:
        entry = record.storages.get(key)
        if entry is None or entry.ref.expired():  # a freed storage's address may be reused: a new storage
            entry = Stored(next(self._ids), StorageWeakRef(tensor.untyped_storage()),
                           tensor.untyped_storage().nbytes(), tensor.dtype, tensor.device)
            record.storages[key] = entry
        return entry

    def _name(self, record: MicroBatchRecord, op: str | None, entry: Stored, dtype: str | None,
              key) -> str | None:
        savings = self._savings.get(op) if op is not None else None
        if not savings or dtype is None:
            return None
        if entry.name is not None:
            return entry.name if any(t == entry.name and d == dtype for t, d, _ in savings) else None
        hints = OP_HINTS.get()
        hint = hints.get(key) if hints else None
        for partial in (False, True):  # an exact first storage, else a slice of a routed tensor (one per expert)
            for tensor, saved_dtype, expected in savings:
                if (hint is not None and tensor != hint) or saved_dtype != dtype:
                    continue
                fits = self.graph.tensors[tensor].routed if partial else (  # one storage per name and dtype
                    entry.nbytes == expected and all(e.dtype != entry.dtype for e in record.named.get(tensor, ())))
                if fits:
                    entry.name = tensor
                    record.named_as(entry, tensor)
                    return tensor
        return None

    def _pack(self, record: MicroBatchRecord, tensor: torch.Tensor):
        record.pack_count += 1
        index = None
        if record.active is not None:  # the k-th saving of a replayable op (matched again on re-run)
            index = record.active.num_saves
            enclosing = record.active
            while enclosing is not None:  # a re-run of an enclosing op captures this saving too
                enclosing.num_saves += 1
                enclosing = enclosing.parent
        key = storage_key(tensor)
        if self.tracker.excludes(tensor):
            return tensor
        entry = self._storage(record, tensor, key)
        op = OP_SCOPE.get()
        name = self.namer(record, op, entry, TORCH_TO_NAME.get(tensor.dtype), key)
        if name is None:
            record.unknown_count += 1
            if entry.sid not in record.unknown:
                record.unknown_ops[op] = record.unknown_ops.get(op, 0) + entry.nbytes
            record.unknown[entry.sid] = entry.nbytes
            return self._keep(record, tensor, entry)
        if op in self.standby and name in self._provisional and self.graph.op(op).layer not in record.gated:
            held = Provisional(tensor.detach(), op, name, entry, record.active, index)
            record.provisional.append(held)  # the gate decides how it is stored
            return held
        strategy = record.strategies.get((op, name), Strategy.KEEP)
        record.applied[(op, name)] = strategy
        return self._apply(record, tensor, entry, name, strategy, record.active, index)

    def _apply(self, record: MicroBatchRecord, tensor: torch.Tensor, entry: Stored, name: str, strategy: Strategy,
               active: Replay | None, index: int | None):
        """Pack one named saving under ``strategy``; ``active`` is the replay of the op that saved it, if any
        (its ``index``-th saving)."""
        if strategy is Strategy.KEEP or (entry.nbytes == 0 and strategy is not Strategy.RECOMPUTE):
            # an empty RECOMPUTE saving is still regenerated: under EP every rank must re-run the same
            # collectives in backward, whatever its experts received
            return self._keep(record, tensor, entry)
        if strategy is Strategy.OFFLOAD:
            if entry.host is None:
                if self.defer_offloads:
                    entry.host = HostCopy(None, device=tensor.device, pending=flat_storage(tensor).detach())
                    record.pending_offloads.setdefault(name, []).append(entry)
                else:
                    entry.host = self.engine.offload(flat_storage(tensor).detach())
                entry.host.name = name
                record.host_copies.append(entry.host)
                record.host[entry.sid] = entry.nbytes
            entry.host.users += 1
            return Offloaded(entry.host, self.engine, View.of(tensor))
        if strategy is Strategy.QUANTIZE:
            fp8 = entry.fp8
            if fp8 is None:
                fp8 = quantize_fp8(flat_storage(tensor))
                entry.keep_fp8(*fp8)
                record.scales.add(entry.sid)
                self._charge(record, ("fp8", entry.sid), fp8[0].numel())
            return Quantized(fp8[0], fp8[1], View.of(tensor))
        # RECOMPUTE: an earlier replay's output, else this replayable op's own k-th saving, else (not re-run:
        # another consumer stores it) read from that copy on unpack
        entry.hold()  # another consumer may store this storage: unpack reads that copy first
        if entry.producer is not None and entry.producer[0] is not active:
            replay, output = entry.producer
            replay.pending += 1
            return Regenerated(entry, View.of(tensor), self.engine, replay, output=output)
        if active is not None:
            active.pending += 1
            return Regenerated(entry, View.of(tensor), self.engine, active, save=index)
        if name in record.producers:  # a copy in another precision of a tensor a replay makes
            replay, output = record.producers[name]
            replay.pending += 1
            return Regenerated(entry, View.of(tensor), self.engine, replay, output=output)
        record.hold_name(name, tensor.dtype)
        return Regenerated(entry, View.of(tensor), self.engine,
                           lookup=lambda tensor_name: record.stored_as(tensor_name, self.engine))

    def _keep(self, record: MicroBatchRecord, tensor: torch.Tensor, entry: Stored) -> torch.Tensor:
        self._charge(record, ("keep", entry.sid), entry.nbytes)
        # a detached alias (packing.saved_alias): a saved *output* packed as itself would form a reference cycle
        # through its own autograd node, leaking the whole forward if backward never runs (an out-of-memory error
        # mid-forward). Saved tensors come back without grad_fn: no double backward.
        kept = saved_alias(tensor)
        entry.keep(kept)
        return kept


def apply_plan(target: "OpGraph | torch.nn.Module | InstrumentedModel", plan: Plan | str | None, *,
               tracker: ActivationTracker | None = None, exclude: Iterable[torch.nn.Module] = (),
               deferred=None, graph: OpGraph | None = None, verify: bool = False) -> PlanExecutor:
    """A :class:`PlanExecutor` for ``plan``; use ``with executor.micro_batch(name):`` per micro-batch.

    ``target`` is one of:

    * an :class:`~bagualu2.exec.instrument.InstrumentedModel` (a model instrumented from outside): the plan runs
      on its traced graph (``trace_graph`` first), savings named by their slot in each module call — or, with
      ``graph``, on that graph (e.g. ``build_graph``'s), savings named by the op scopes the hooks open;
    * the op graph of the layers the forward runs (the model marks its ops with ``run_op`` or is instrumented);
    * a model with a ``config`` (a :class:`~bagualu2.costmodel.ModelConfig`, e.g. the reference ``GLMMoEModel``,
      instrumented with ``reference_trainer.instrumented.instrument_reference``):
      the graph is built for all its layers as one stage (expert parallelism from its ``ep_size``, default 1).

    Model parameters and buffers are excluded. ``deferred``: an optional
    :class:`~bagualu2.exec.deferred.DeferredPlanner` consulted after every MoE gate. Raises ``ValueError`` for an
    invalid plan or target, a plan that needs to regenerate a graph input, or one that re-runs a module that draws
    random numbers (RECOMPUTE needs a deterministic module). ``verify=True``: every re-run's outputs are compared
    with checksums of what the forward produced, and a mismatch raises ``RuntimeError`` naming the op (a module
    with a side effect, such as a KV cache it updates, would otherwise give silently wrong gradients).
    """
    exclude = _check_arguments(tracker, exclude, deferred, graph)
    namer = instrumented = None
    if isinstance(target, InstrumentedModel):
        if target.removed:
            raise ValueError("the instrumented model's hooks were removed (InstrumentedModel.remove()); instrument "
                             "the model again")
        instrumented = target
        check_device(target.model)
        exclude = (*exclude, target.model)
        traced = target.graph if target.trace is not None else None
        if graph is None or (traced is not None and _same_but_fp8(graph, traced)):
            graph = target.graph if graph is None else graph  # the traced graph (without FP8, too): its slot names
            namer = target.name_saving
            check_replayable(target, plan)
        else:  # the hooks name savings by the ops they open: the plan's ops must be the model's
            plan = Plan.coerce(plan)
            bound = {binding.op for binding in target.bindings.values()}
            missing = sorted({op for (op, _), strategy in resolve(graph, plan or Plan()).items()
                              if strategy is not Strategy.KEEP} - bound)
            if missing:
                raise ValueError(f"the plan mitigates ops the instrumented model does not have: "
                                 f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (graph "
                                 f"{graph.label!r} is not this model's)")
    elif isinstance(target, torch.nn.Module):
        graph = graph_of(target) if graph is None else graph
        exclude = (*exclude, target)
    elif isinstance(target, OpGraph):
        graph = target
    else:
        raise ValueError(f"apply_plan needs an OpGraph or a model (an InstrumentedModel, or one with a config), "
                         f"got {type(target).__name__}")
    if deferred is not None:
        _check_deferred(deferred, graph)
    executor = PlanExecutor(graph, plan, tracker=tracker, exclude=exclude, deferred=deferred, namer=namer,
                            verify=verify, instrumented=instrumented)
    if namer is not None:
        executor.traced = instrumented.trace
    return executor


def _same_but_fp8(graph: OpGraph, traced: OpGraph) -> bool:
    """Is ``graph`` the traced graph, with or without FP8 storage (``dataclasses.replace(traced, quantize=...)``)?"""
    return graph is traced or all(getattr(graph, field.name) == getattr(traced, field.name)
                                  for field in dataclasses.fields(OpGraph) if field.name != "quantize")


def _check_arguments(tracker, exclude, deferred, graph) -> tuple:
    """:func:`apply_plan`'s keywords, one ``ValueError`` each (before anything is built on them); returns
    ``exclude`` as a tuple."""
    if tracker is not None and not isinstance(tracker, ActivationTracker):
        raise ValueError(f"tracker must be an ActivationTracker or None, got {type(tracker).__name__}")
    modules = None
    if not isinstance(exclude, (torch.nn.Module, str, bytes)) and isinstance(exclude, Iterable):
        modules = tuple(exclude)
    if modules is None or not all(isinstance(module, torch.nn.Module) for module in modules):
        raise ValueError(f"exclude must be an iterable of torch modules (e.g. [model]), got {type(exclude).__name__}")
    if deferred is not None and not all(callable(getattr(deferred, name, None)) for name in ("after_gate",
                                                                                              "downgrade")):
        raise ValueError(f"deferred must be a DeferredPlanner or None, got {type(deferred).__name__}")
    if graph is not None and not isinstance(graph, OpGraph):
        raise ValueError(f"graph must be an OpGraph or None, got {type(graph).__name__}")
    return modules


def _check_deferred(deferred, graph: OpGraph) -> None:
    """One ``ValueError`` when the deferred planner decides on another graph than the one the plan runs on (another
    model's, another stage's): its decisions would name other ops and predict other bytes."""
    graph_of_planner = getattr(deferred, "graph", None)
    if not callable(graph_of_planner):  # a planner of its own making: it answers for its graph
        return
    planned = graph_of_planner()
    if ([op.name for op in planned.ops] != [op.name for op in graph.ops]
            or planned.tensors.keys() != graph.tensors.keys()):
        raise ValueError(f"deferred: the planner decides on graph {planned.label!r}, not on the graph the plan runs on "
                         f"({graph.label!r}: other ops or tensors); make it from this graph "
                         "(DeferredPlanner.for_graph(instrumented.graph, ...))")


def _names(what: str, names) -> set[str]:
    """A collection of tensor or op names as a set (one-line ``ValueError`` otherwise)."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Iterable):
        raise ValueError(f"{what} must be a collection of names, got {type(names).__name__}")
    names = set(names)
    if not all(isinstance(name, str) for name in names):
        raise ValueError(f"{what} must be a collection of names (strings)")
    return names


def graph_of(model: torch.nn.Module, imbalance: float = 1.0) -> OpGraph:
    """The cost-model graph of every layer of ``model`` (one stage, CPU hardware profile: bytes do not depend on
    it), from ``model.config`` and ``model.ep_size``."""
    from bagualu2.costmodel import ModelConfig, ParallelConfig, build_graph, presets

    config = getattr(model, "config", None)
    if not isinstance(config, ModelConfig):
        raise ValueError(f"target: {type(model).__name__} has no bagualu2 ModelConfig as its 'config'; pass the "
                         "InstrumentedModel that instrumenting it returned (e.g. integrations.hf.instrument), an "
                         "OpGraph of its ops, or a model built from a ModelConfig")
    ep = int(getattr(model, "ep_size", 1))
    return build_graph(config, ParallelConfig(dp=ep, ep=ep), presets.hardware("cpu"), imbalance=imbalance)
