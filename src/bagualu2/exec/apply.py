"""Apply an OFFLOAD / QUANTIZE plan to a model's forward through saved-tensor hooks, with the tracker's accounting.

Usage (one micro-batch at a time, several may be in flight)::

    executor = apply_plan(graph, plan, exclude=[model])        # ValueError if the plan has RECOMPUTE savings
    with executor.micro_batch("mb0"):
        loss = model(tokens)...                                # the forward of micro-batch "mb0"
    executor.device_bytes("mb0"), executor.host_bytes("mb0")   # compare with evaluate(graph, plan)
    loss.backward()
    executor.release("mb0")

The model marks its ops with :class:`op_scope` (``with op_scope("L0.qkv"): ...``; a no-op unless a micro-batch
of some executor is being recorded). The pack hook takes the op from the scope and names the saved tensor by its
*storage*: a storage seen before in this micro-batch keeps its name; a new one gets the first saving of the
current op (graph order) with the same dtype and exactly its expected bytes (``numel * itemsize``), else, for
a routed-expert tensor (one storage per expert), the first whose expected bytes are not used up yet. Where size
and dtype are ambiguous (core attention's q/o, k/v) the model names the storages in its ``op_scope``. The strategy is
``resolve(graph, plan)[(op, tensor)]``:

* ``KEEP``      the tensor itself is kept (device bytes: its storage, once per storage);
* ``OFFLOAD``   one host copy of the whole storage (``pin_memory`` when CUDA is available), shared by every
                consumer that offloads it; unpack copies it back to the original device (host bytes);
* ``QUANTIZE``  one FP8 e4m3 copy of the whole storage with one per-tensor FP32 scale ``amax / 448`` (1 if the
                storage is all zeros), shared by the consumers that quantise it; unpack dequantises to the
                original dtype, shape and strides (device bytes: one byte per element; the 4-byte scale is
                reported as ``scale_bytes`` and not counted, like the cost model);
* ``RECOMPUTE`` not implemented yet: :func:`apply_plan` raises ``ValueError`` up front (any saving resolving to
                it, or any RECOMPUTE entry in the plan).

Savings that cannot be named (no op scope, an op the graph does not know, no matching saving) are kept,
counted in the device bytes and reported as ``unknown`` (count and bytes). Parameters and buffers of the
modules in ``exclude`` (or of the given tracker) are not activations. With a ``tracker``, its cap applies to
the device bytes and ``tracker.kept_bytes(name)`` reports them too.

Not implemented: copies are synchronous (``.to(..., copy=True)`` on the current stream); there are no side CUDA
streams, events or prefetch of offloaded tensors before backward, and on CUDA each consumer's unpack copies the
storage back separately.
"""

from __future__ import annotations

import contextlib
import itertools
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from bagualu2.costmodel.evaluate import resolve
from bagualu2.costmodel.graph import ITEM_BYTES, OpGraph
from bagualu2.costmodel.plan import Plan
from bagualu2.costmodel.strategy import Strategy

from .tracker import ActivationOutOfMemoryError, ActivationTracker, MicroBatchBytes, _storage_key

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_BYTES = 4  # one FP32 scale per FP8 copy (not counted in device bytes, as in the cost model)
TORCH_TO_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "int32",
                 torch.int64: "int64", torch.bool: "bool"}

#: The cost-model op running now (set by :class:`op_scope`, read by the pack hook).
OP_SCOPE: ContextVar[str | None] = ContextVar("bagualu2_op_scope", default=None)
_RECORDING = [0]  # micro-batches being recorded right now (op_scope does nothing when 0)


#: Names the current op gives to some of its inputs' storages (``{storage key: tensor name}``), for savings the
#: hook cannot tell apart by size and dtype (core attention's q/o and k/v).
OP_HINTS: ContextVar[dict | None] = ContextVar("bagualu2_op_hints", default=None)


class op_scope:
    """``with op_scope("L3.expert_fc1"): ...`` — names the cost-model op that runs inside (no-op when idle).

    ``names`` optionally maps tensors the op will save to their cost-model names
    (``op_scope("L0.core_attn", {"L0.q_rope": q, "L0.k_rope": k, "L0.v": v})``): the hook uses them for storages
    it has not named yet, where size and dtype alone are ambiguous.
    """

    __slots__ = ("name", "names", "_tokens")

    def __init__(self, name: str, names: dict[str, torch.Tensor] | None = None):
        self.name = name
        self.names = names
        self._tokens = None

    def __enter__(self) -> None:
        if _RECORDING[0]:
            hints = ({_storage_key(t): n for n, t in self.names.items()} if self.names else None)
            self._tokens = (OP_SCOPE.set(self.name), OP_HINTS.set(hints))

    def __exit__(self, *exc) -> None:
        if self._tokens is not None:
            OP_SCOPE.reset(self._tokens[0])
            OP_HINTS.reset(self._tokens[1])
            self._tokens = None


# ---- packed forms ----------------------------------------------------------------------------------------------
def _flat_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``tensor`` as a flat tensor of its dtype (no copy)."""
    numel = tensor.untyped_storage().nbytes() // tensor.element_size()
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(tensor.untyped_storage(), 0, (numel,))


@dataclass(frozen=True)
class _View:
    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    device: torch.device
    dtype: torch.dtype
    requires_grad: bool

    @classmethod
    def of(cls, t: torch.Tensor) -> "_View":
        return cls(t.size(), t.stride(), t.storage_offset(), t.device, t.dtype, t.requires_grad)

    def rebuild(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.size, self.stride, self.offset)


@dataclass
class _Offloaded:
    host: torch.Tensor  # flat host copy of the storage (shared)
    view: _View

    def unpack(self) -> torch.Tensor:
        flat = self.host.to(self.view.device, non_blocking=False)
        return self.view.rebuild(flat)


@dataclass
class _Quantized:
    data: torch.Tensor   # flat FP8 copy of the storage (shared)
    scale: torch.Tensor  # 0-dim FP32
    view: _View

    def unpack(self) -> torch.Tensor:
        flat = (self.data.to(torch.float32) * self.scale).to(self.view.dtype)
        return self.view.rebuild(flat)


def _unpack(packed):
    return packed if isinstance(packed, torch.Tensor) else packed.unpack()


def quantize_fp8(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, scale)`` with ``fp8 * scale ~= flat``; one per-tensor scale ``amax / 448`` (1 for all zeros)."""
    wide = flat.detach().to(torch.float32)
    amax = wide.abs().max() if wide.numel() else torch.zeros((), device=wide.device)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(torch.float32)
    return (wide / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


# ---- per micro-batch state ---------------------------------------------------------------------------------------
@dataclass
class _Storage:
    sid: int
    ref: StorageWeakRef
    nbytes: int
    name: str | None = None
    host: torch.Tensor | None = None
    fp8: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass
class MicroBatchRecord:
    """What one micro-batch stored. Bytes are deduplicated per storage (host: per storage and dtype)."""

    name: str
    device: MicroBatchBytes = field(default_factory=MicroBatchBytes)  # shared with the tracker
    host: dict[int, int] = field(default_factory=dict)          # storage id -> host bytes
    scales: set[int] = field(default_factory=set)               # storage ids with an FP8 copy
    unknown: dict[int, int] = field(default_factory=dict)       # storage id -> bytes kept without a name
    unknown_count: int = 0                                      # pack calls that could not be named
    storages: dict[tuple[str, int], _Storage] = field(default_factory=dict)
    used: dict[tuple[str, str], int] = field(default_factory=dict)  # (op, tensor) -> bytes named so far
    strategies: dict[tuple[str, str], Strategy] = field(default_factory=dict)  # what the hook applied

    @property
    def device_bytes(self) -> int:
        return self.device.nbytes

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def unknown_bytes(self) -> int:
        return sum(self.unknown.values())

    @property
    def scale_bytes(self) -> int:
        return SCALE_BYTES * len(self.scales)


class PlanExecutor:
    """Saved-tensor hooks that apply ``plan`` (OFFLOAD / QUANTIZE / KEEP) to micro-batches of ``graph``'s ops."""

    def __init__(self, graph: OpGraph, plan: Plan | str | None, *, tracker: ActivationTracker | None = None,
                 exclude: Iterable[torch.nn.Module] = ()):
        self.graph = graph
        self.plan = Plan.from_str(plan) if isinstance(plan, str) else (plan or Plan())
        self.strategies = resolve(graph, self.plan)
        # a RECOMPUTE kind policy is refused even where it matches no op of this graph
        recomputed = [k for k, s in self.plan.entries if s is Strategy.RECOMPUTE and "/" not in k]
        recomputed += sorted(f"{op}/{t}" for (op, t), s in self.strategies.items() if s is Strategy.RECOMPUTE)
        if recomputed:
            raise ValueError(f"RECOMPUTE is not implemented yet in plan execution ({', '.join(recomputed[:4])}"
                             f"{', ...' if len(recomputed) > 4 else ''}); use OFFLOAD, QUANTIZE or KEEP")
        self.tracker = tracker if tracker is not None else ActivationTracker(exclude=exclude)
        if tracker is not None:
            self.tracker.exclude(*exclude)
        # op name -> [(tensor, dtype name, expected bytes)] in graph order
        self._savings = {op.name: [(s.tensor, s.dtype, graph.tensors[s.tensor].numel * ITEM_BYTES[s.dtype])
                                   for s in op.saves] for op in graph.ops if op.saves}
        self._records: dict[str, MicroBatchRecord] = {}
        self._current: MicroBatchRecord | None = None
        self._ids = itertools.count()

    # ---- micro-batches ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def micro_batch(self, name: str) -> Iterator[MicroBatchRecord]:
        """Apply the plan to what autograd saves while the forward of micro-batch ``name`` runs in this block."""
        tracker = self.tracker
        if name in self._records:
            raise ValueError(f"micro-batch {name!r} is already in flight")
        record = self._records[name] = MicroBatchRecord(name, tracker.open(name))
        previous, self._current = self._current, record
        _RECORDING[0] += 1
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield record
        except BaseException:
            self._records.pop(name, None)
            tracker.drop(name)
            raise
        finally:
            _RECORDING[0] -= 1
            self._current = previous
            record.storages.clear()  # naming is per forward; the packed copies live in autograd's graph

    def record(self, name: str) -> MicroBatchRecord:
        try:
            return self._records[name]
        except KeyError:
            raise ValueError(f"micro-batch {name!r} is not in flight; in flight: {sorted(self._records)}") from None

    def device_bytes(self, name: str) -> int:
        """Device bytes micro-batch ``name`` keeps: kept storages + FP8 copies (compare ``activation_bytes``)."""
        return self.record(name).device_bytes

    def host_bytes(self, name: str) -> int:
        """Host bytes of its offloaded copies (compare ``evaluate(graph, plan).host_bytes``)."""
        return self.record(name).host_bytes

    def release(self, name: str) -> MicroBatchRecord:
        """Forget micro-batch ``name`` (its backward ran); returns its record."""
        record = self.record(name)
        del self._records[name]
        self.tracker.drop(name)
        return record

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
        tracker.peak_bytes = max(tracker.peak_bytes, tracker.in_flight_bytes)

    def _storage(self, record: MicroBatchRecord, tensor: torch.Tensor, key) -> _Storage:
        entry = record.storages.get(key)
        if entry is None or entry.ref.expired():  # a freed storage's address may be reused: a new storage
            entry = _Storage(next(self._ids), StorageWeakRef(tensor.untyped_storage()),
                             tensor.untyped_storage().nbytes())
            record.storages[key] = entry
        return entry

    def _name(self, record: MicroBatchRecord, op: str | None, entry: _Storage, dtype: str | None,
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
                used = record.used.get((op, tensor), 0)
                fits = (used + entry.nbytes <= expected and self.graph.tensors[tensor].routed) if partial \
                    else (used == 0 and entry.nbytes == expected)
                if fits:
                    record.used[(op, tensor)] = used + entry.nbytes
                    entry.name = tensor
                    return tensor
        return None

    def _pack(self, tensor: torch.Tensor):
        record = self._current
        key = _storage_key(tensor)
        if record is None or self.tracker.excludes(tensor):
            return tensor
        entry = self._storage(record, tensor, key)
        op = OP_SCOPE.get()
        name = self._name(record, op, entry, TORCH_TO_NAME.get(tensor.dtype), key)
        if name is None:
            record.unknown_count += 1
            record.unknown[entry.sid] = entry.nbytes
            self._charge(record, ("keep", entry.sid), entry.nbytes)
            return tensor
        strategy = self.strategies.get((op, name), Strategy.KEEP)
        record.strategies[(op, name)] = strategy
        if strategy is Strategy.KEEP or entry.nbytes == 0:
            self._charge(record, ("keep", entry.sid), entry.nbytes)
            return tensor
        if strategy is Strategy.OFFLOAD:
            if entry.host is None:
                host = _flat_storage(tensor).detach().to("cpu", copy=True)
                if torch.cuda.is_available():
                    host = host.pin_memory()
                entry.host = host
                record.host[entry.sid] = entry.nbytes
            return _Offloaded(entry.host, _View.of(tensor))
        if strategy is Strategy.QUANTIZE:
            if entry.fp8 is None:
                entry.fp8 = quantize_fp8(_flat_storage(tensor))
                record.scales.add(entry.sid)
                self._charge(record, ("fp8", entry.sid), entry.fp8[0].numel())
            return _Quantized(entry.fp8[0], entry.fp8[1], _View.of(tensor))
        raise ValueError(f"{strategy.value} is not implemented yet in plan execution")  # RECOMPUTE: checked up front


def apply_plan(graph: OpGraph, plan: Plan | str | None, *, tracker: ActivationTracker | None = None,
               exclude: Iterable[torch.nn.Module] = ()) -> PlanExecutor:
    """A :class:`PlanExecutor` for ``plan`` on ``graph``; use ``with executor.micro_batch(name):`` per micro-batch.

    Raises ``ValueError`` for an invalid plan or one that resolves any saving to RECOMPUTE (not implemented yet).
    """
    return PlanExecutor(graph, plan, tracker=tracker, exclude=exclude)
