"""Measure the activation bytes a micro-batch keeps for backward, and enforce a cap on CPU.

:class:`ActivationTracker` installs ``torch.autograd.graph.saved_tensors_hooks`` for one micro-batch at a time.
Every tensor autograd saves passes its pack hook; the tracker counts the bytes of its *storage* once per
micro-batch (views and several consumers of one tensor share a storage), skips parameters and buffers of the
modules it was given, and, with ``cap_bytes``, raises :class:`ActivationOutOfMemoryError` (a
``torch.OutOfMemoryError``) as soon as the micro-batches in flight would exceed the cap — on CPU this stands in
for the device allocator; on CUDA the real allocator is also reported (``allocator_bytes``).
"""

from __future__ import annotations

from bagualu2.costmodel.validate import require_int

import contextlib
import itertools
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .packing import check_unchanged, saved_alias


_FREED = itertools.count()  # keys of storages freed in a forward whose address a new one took


class ActivationOutOfMemoryError(torch.OutOfMemoryError):
    """The activations in flight exceed the tracker's cap (caught like ``torch.OutOfMemoryError``)."""


@dataclass
class MicroBatchBytes:
    """Device bytes one micro-batch keeps, by storage."""

    storages: dict[tuple, int] = field(default_factory=dict)  # (device, storage id) -> bytes
    refs: dict[tuple[str, int], StorageWeakRef] = field(default_factory=dict, repr=False)  # the tracker's own keys

    @property
    def nbytes(self) -> int:
        return sum(self.storages.values())


def check_name(name) -> None:
    """A micro-batch name: a string or an integer (one-line ``ValueError`` otherwise)."""
    if not isinstance(name, (str, int)) or isinstance(name, bool):
        raise ValueError(f"micro-batch names are strings or integers, got {type(name).__name__}")


def names_text(names) -> str:
    """The micro-batch names in flight, for an error message (strings and integers together)."""
    return ", ".join(sorted(map(repr, names))) or "none"


class ActivationTracker:
    """Per-micro-batch accounting of saved activations.

      cap_bytes   raise ActivationOutOfMemoryError when the bytes in flight would exceed it (None: no cap).
      exclude     modules whose parameters and buffers are not activations.
    """

    def __init__(self, *, cap_bytes: int | None = None, exclude: Iterable[torch.nn.Module] = ()):
        if cap_bytes is not None:
            cap_bytes = require_int("cap_bytes", cap_bytes, 0)
        self.cap_bytes = cap_bytes
        self._excluded = WeightStorages()
        self._modules: list[torch.nn.Module] = []
        containers = (torch.nn.ModuleList, torch.nn.Sequential)  # modules that iterate over modules
        if (isinstance(exclude, torch.nn.Module) and not isinstance(exclude, containers)) \
                or isinstance(exclude, (str, bytes)) or not isinstance(exclude, Iterable):
            raise ValueError(f"exclude must be an iterable of torch modules (e.g. [model]), got "
                             f"{type(exclude).__name__}")
        self.exclude(*exclude)
        self._in_flight: dict[str, MicroBatchBytes] = {}
        self._current: MicroBatchBytes | None = None
        self.peak_bytes = 0
        self.high_water_bytes = 0  # the most in flight since the last ``watch()``

    def exclude(self, *modules: torch.nn.Module) -> None:
        """Do not count the parameters and buffers of ``modules`` as activations."""
        for module in modules:
            if not isinstance(module, torch.nn.Module):
                raise ValueError(f"exclude takes torch modules, got {type(module).__name__}")
        self._modules.extend(modules)
        self._excluded.note(modules)

    def excludes(self, tensor: torch.Tensor) -> bool:
        return storage_key(tensor) in self._excluded or is_parameter(tensor)

    def open(self, name: str) -> MicroBatchBytes:
        """Start the accounting of micro-batch ``name`` (for hooks that do their own packing, e.g. plans)."""
        check_name(name)
        if name in self._in_flight:
            raise ValueError(f"micro-batch {name!r} is already in flight")
        self._excluded.note(self._modules, buffers_only=True)  # buffers a forward replaced since the last one
        record = self._in_flight[name] = MicroBatchBytes()
        return record

    def drop(self, name: str) -> None:
        """Forget micro-batch ``name`` without asking whether it was in flight (failure paths)."""
        self._in_flight.pop(name, None)

    def watch(self) -> int:
        """Start a new high-water mark of the bytes in flight (``high_water_bytes``, e.g. over one forward that
        runs beside another micro-batch's backward); returns the bytes in flight now."""
        self.high_water_bytes = self.in_flight_bytes
        return self.high_water_bytes

    def observe(self) -> int:
        """Raise ``peak_bytes`` and ``high_water_bytes`` to the bytes in flight now (after an activation was
        counted); returns them."""
        in_flight = self.in_flight_bytes
        self.peak_bytes = max(self.peak_bytes, in_flight)
        self.high_water_bytes = max(self.high_water_bytes, in_flight)
        return in_flight

    @property
    def in_flight_bytes(self) -> int:
        return sum(mb.nbytes for mb in self._in_flight.values())

    def kept_bytes(self, name: str) -> int:
        """Bytes micro-batch ``name`` keeps for backward (storage-deduplicated, parameters excluded)."""
        try:
            return self._in_flight[name].nbytes
        except KeyError:
            raise ValueError(f"micro-batch {name!r} is not in flight; in flight: {names_text(self._in_flight)}") \
                from None

    @contextlib.contextmanager
    def micro_batch(self, name: str) -> Iterator["ActivationTracker"]:
        """Track what autograd saves while the forward of micro-batch ``name`` runs inside this block."""
        record = self.open(name)
        previous, self._current = self._current, record
        try:
            with recording(name), torch.autograd.graph.saved_tensors_hooks(self._pack, check_unchanged):
                yield self
        except BaseException:
            self._in_flight.pop(name, None)
            raise
        finally:
            self._current = previous

    def release(self, name: str) -> int:
        """Forget micro-batch ``name`` (its backward ran); returns the bytes it kept."""
        kept = self.kept_bytes(name)
        del self._in_flight[name]
        return kept

    def allocator_bytes(self, device: torch.device | str | None = None) -> int | None:
        """The CUDA caching allocator's allocated bytes (None on CPU)."""
        if not torch.cuda.is_available():
            return None
        return torch.cuda.memory_allocated(device)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        record = self._current
        key = storage_key(tensor)
        if record is not None and key in record.storages and key in record.refs and record.refs[key].expired():
            # the storage counted at this address was freed in the forward and a new one took the address: the
            # freed one stays counted (as the trace counts it) under a key of its own, the new one is counted too
            record.storages[("freed", next(_FREED), *key)] = record.storages.pop(key)
        if record is not None and key not in record.storages and not self.excludes(tensor):
            nbytes = storage_bytes(tensor)
            if self.cap_bytes is not None and self.in_flight_bytes + nbytes > self.cap_bytes:
                raise ActivationOutOfMemoryError(
                    f"activations in flight would reach {self.in_flight_bytes + nbytes} bytes, over the cap of "
                    f"{self.cap_bytes} bytes")
            record.storages[key] = nbytes
            record.refs[key] = StorageWeakRef(tensor.untyped_storage())
            self.observe()
        return saved_alias(tensor)


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """Identity of the storage behind ``tensor`` (shared by its views), also for empty storages (null data)."""
    return str(tensor.device), tensor.untyped_storage()._cdata


def weight_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """``module``'s parameters and buffers; a sharded parameter (a ``DTensor``) also by its local shard, the tensor
    its module computes with."""
    found = []
    for tensor in [*module.parameters(), *module.buffers()]:
        if hasattr(tensor, "to_local") and hasattr(tensor, "device_mesh"):
            found.append(tensor.to_local())
        found.append(tensor)
    return found


def weight_keys(module: torch.nn.Module) -> set[tuple[str, int]]:
    """Storage keys of ``module``'s parameters and buffers (:func:`weight_tensors`)."""
    return {storage_key(tensor) for tensor in weight_tensors(module)}


def _weak(tensor: torch.Tensor) -> StorageWeakRef | None:
    """A weak reference to ``tensor``'s storage, None where it has none of its own to refer to (a wrapper)."""
    try:
        return StorageWeakRef(tensor.untyped_storage())
    except (RuntimeError, TypeError, AttributeError):
        return None


_UNKNOWN = object()
PRUNE_AFTER = 4096  # storages noted before the dead ones are dropped (a buffer replaced at every forward)


class WeightStorages:
    """The storage keys of parameters and buffers, each with a weak reference to its storage: a key whose storage
    was freed since (a buffer a forward replaced, ``self.ema = 0.9 * self.ema + ...``) is no weight any more, so an
    activation the allocator places at that address is counted as one. ``key in storages``."""

    def __init__(self, modules: Iterable[torch.nn.Module] = ()) -> None:
        self._refs: dict[tuple[str, int], StorageWeakRef | None] = {}
        self._added = 0  # storages noted since the dead ones were last dropped
        self.note(modules)

    def note(self, modules: Iterable[torch.nn.Module], *, buffers_only: bool = False) -> None:
        """Add the parameters and buffers of ``modules`` as they are now, or only the buffers (at every micro-batch:
        a forward may replace a buffer; a parameter is told by its type anyway); a weak reference is made only for a
        storage not known yet, and the dead ones are dropped now and then."""
        for module in modules:
            for tensor in (module.buffers() if buffers_only else weight_tensors(module)):
                key = storage_key(tensor)
                ref = self._refs.get(key, _UNKNOWN)
                if ref is _UNKNOWN or (ref is not None and ref.expired()):
                    self._refs[key] = _weak(tensor)
                    self._added += 1
        if self._added > PRUNE_AFTER:
            self._refs = {key: ref for key, ref in self._refs.items() if ref is None or not ref.expired()}
            self._added = 0

    def __contains__(self, key: object) -> bool:
        if key not in self._refs:
            return False
        ref = self._refs[key]
        return ref is None or not ref.expired()


#: Storage keys of the parameters of the instrumented op modules running now, read when each op starts (after a
#: wrapper such as FSDP has gathered them into storages of their own for the forward).
OP_WEIGHTS: ContextVar[frozenset] = ContextVar("bagualu2_op_weights", default=frozenset())
#: The micro-batch whose forward records in this thread (a tracker's or an executor's block), None outside.
RECORDING: ContextVar[object] = ContextVar("bagualu2_recording", default=None)


@contextlib.contextmanager
def recording(name: object) -> Iterator[None]:
    """Mark this thread's forward as recording micro-batch ``name``; ``ValueError`` inside another's block: autograd's
    saved-tensor hooks do not nest (the inner block's would take every saving, the outer's plan none)."""
    if not isinstance(name, (str, int)) or isinstance(name, bool):
        raise ValueError(f"micro-batch names are strings or integers, got {type(name).__name__}")
    outer = RECORDING.get()
    if outer is not None:
        raise ValueError(f"micro-batch {name!r} begins inside micro-batch {outer!r}'s block: blocks do not nest "
                         "(autograd's saved-tensor hooks take the innermost only); end one block before the next")
    token = RECORDING.set(name)
    try:
        yield
    finally:
        RECORDING.reset(token)


def is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one, or a tensor on the storage of a parameter of an op running now: never an
    activation, wherever its storage lives (FSDP gathers a sharded parameter into a storage of its own for the
    forward and backward; an expert-parallel weight is used through its local shard)."""
    return (isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)
            or storage_key(tensor) in OP_WEIGHTS.get())


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage behind ``tensor`` (what keeping it alive costs)."""
    return tensor.untyped_storage().nbytes()
