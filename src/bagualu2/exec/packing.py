"""Packed forms of saved tensors (host copies, FP8 copies) and the copy engine that moves them.

A saved tensor is packed per *storage*: one host copy or one FP8 copy of the whole storage, shared by every
consumer that mitigates it the same way; each consumer keeps a :class:`View` (size, stride, offset) to rebuild its
own tensor from the flat copy on unpack.

:class:`CopyEngine` does the device<->host copies. On CUDA it owns two side streams (device->host, host->device):
an offload waits for the producer on the compute stream (an event), copies into a pinned buffer from a reusable
:class:`HostPool` and records a completion event; the source storage is marked as used by the copy stream
(``record_stream``) so the allocator does not reuse it early. A reload (or a prefetch issued before backward)
copies back on the host->device stream, and the consumer's stream waits for its event before use. On CPU the same
calls copy synchronously (no streams, no events, no pinning).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
POS_INF_CODE, NEG_INF_CODE = 0x7F, 0xFF  # e4m3's NaN codes, which hold +inf and -inf here
SCALE_BYTES = 4  # one FP32 scale per FP8 copy (not counted in device bytes, as in the cost model)


def flat_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage behind ``tensor`` as a flat tensor of its dtype (no copy)."""
    numel = tensor.untyped_storage().nbytes() // tensor.element_size()
    return torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(tensor.untyped_storage(), 0, (numel,))


@dataclass(frozen=True)
class View:
    """How one consumer's tensor sits in its storage: rebuilt on a flat copy of that storage."""

    size: torch.Size
    stride: tuple[int, ...]
    offset: int
    device: torch.device
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> "View":
        return cls(t.size(), t.stride(), t.storage_offset(), t.device, t.dtype)

    def rebuild(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.as_strided(self.size, self.stride, self.offset)


def quantize_fp8(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(fp8, scale)`` with ``fp8 * scale ~= flat``; one per-tensor scale ``amax / 448`` over the finite values
    (1 when there are none but zeros).

    Infinities are kept exactly (an additive attention mask holds -inf): e4m3 has no infinity, so +inf and -inf are
    stored in its two NaN codes, which finite values never take (they saturate at +-448). A NaN comes back as the
    infinity of its sign bit: still not finite. All on the device, with no host synchronisation."""
    wide = flat.detach().to(torch.float32)
    magnitude = wide.abs().nan_to_num_(nan=0.0, posinf=0.0)
    amax = magnitude.max() if magnitude.numel() else torch.zeros((), device=wide.device)
    del magnitude  # one full-size temporary at a time
    tiny = torch.finfo(torch.float32).tiny  # subnormal-only values: amax / 448 would underflow to 0
    scale = torch.where(amax > 0, (amax / FP8_MAX).clamp_min(tiny), torch.ones_like(amax)).to(torch.float32)
    codes = (wide / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(torch.uint8)
    codes.masked_fill_(torch.isposinf(wide), POS_INF_CODE).masked_fill_(torch.isneginf(wide), NEG_INF_CODE)
    return codes.view(FP8_DTYPE), scale


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    codes = data.view(torch.uint8)
    wide = (data.to(torch.float32) * scale).masked_fill_(codes == POS_INF_CODE, float("inf"))
    return wide.masked_fill_(codes == NEG_INF_CODE, float("-inf")).to(dtype)


class HostPool:
    """Reusable host buffers (pinned when CUDA is available), by ``(numel, dtype)``."""

    def __init__(self, *, pin: bool | None = None):
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self.allocated = self.reused = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        free = self._free.get((numel, dtype))
        if free:
            self.reused += 1
            return free.pop()
        self.allocated += 1
        return torch.empty(numel, dtype=dtype, pin_memory=self.pin)

    def give(self, buffer: torch.Tensor, busy_until: object = None) -> None:
        """Return ``buffer``; ``busy_until`` (a CUDA event) is waited for first, so no copy still reads it."""
        if busy_until is not None:
            busy_until.synchronize()
        self._free.setdefault((buffer.numel(), buffer.dtype), []).append(buffer)


class CopyEngine:
    """Device->host offloads and host->device reloads; asynchronous on CUDA side streams, synchronous on CPU."""

    def __init__(self, pool: HostPool | None = None):
        self.pool = pool or HostPool()
        cuda = torch.cuda.is_available()
        self.d2h = torch.cuda.Stream() if cuda else None
        self.h2d = torch.cuda.Stream() if cuda else None
        self.num_offloads = self.num_reloads = 0  # copies started (device->host, host->device)

    def offload(self, flat: torch.Tensor) -> "HostCopy":
        """Start copying the flat device storage ``flat`` into a host buffer from the pool."""
        self.num_offloads += 1
        host = self.pool.take(flat.numel(), flat.dtype)
        if flat.device.type != "cuda" or self.d2h is None:
            host.copy_(flat)
            return HostCopy(host, None, flat.device)
        ready = torch.cuda.current_stream(flat.device).record_event()
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ready)
            host.copy_(flat, non_blocking=True)
            flat.record_stream(self.d2h)  # the allocator may not reuse the source before the copy ran
            done = self.d2h.record_event()
        return HostCopy(host, done, flat.device)

    def reload(self, copy: "HostCopy", device: torch.device) -> tuple[torch.Tensor, object]:
        """Start copying ``copy`` back to ``device``; returns ``(flat device tensor, event or None)``."""
        self.num_reloads += 1
        if device.type != "cuda" or self.h2d is None:
            return copy.host.to(device, copy=True), None
        with torch.cuda.stream(self.h2d):
            if copy.done is not None:
                self.h2d.wait_event(copy.done)
            flat = copy.host.to(device, non_blocking=True)
            event = self.h2d.record_event()
        return flat, event


@dataclass
class HostCopy:
    """A storage's host copy and the event that marks the end of its device->host copy (None on CPU)."""

    host: torch.Tensor | None           # None while the copy is deferred (``pending``)
    done: object = None
    device: torch.device | None = None  # where the storage came from (and goes back to)
    pending: torch.Tensor | None = None  # the device storage of a deferred offload, not copied yet
    name: str | None = None              # the cost-model tensor (set by the executor)
    users: int = 0                       # consumers' handles that will unpack it
    cached: torch.Tensor | None = None   # the device copy, shared by the consumers until the last one unpacked
    prefetched: tuple[torch.Tensor, object] | None = None  # (device copy, event) issued before backward
    last_read: object = None  # event of the latest host->device copy (the buffer is busy until it completed)

    def prefetch(self, engine: CopyEngine) -> bool:
        """Start copying back to the device now (before backward); False if there is nothing to start."""
        if self.host is None or self.prefetched is not None or self.cached is not None:
            return False
        self.prefetched = engine.reload(self, self.device)
        self.last_read = self.prefetched[1]
        return True

    def to_device(self, engine: CopyEngine, device: torch.device) -> torch.Tensor:
        """The flat storage on ``device``: the prefetched copy if there is one, else a reload now (a deferred
        offload that never ran still has its device storage)."""
        if self.pending is not None:
            return self.pending
        if self.cached is None:
            flat, event = self.prefetched if self.prefetched is not None else engine.reload(self, device)
            self.prefetched = None
            if event is not None:
                self.last_read = event
                torch.cuda.current_stream(device).wait_event(event)
                flat.record_stream(torch.cuda.current_stream(device))
            self.cached = flat
        return self.cached

    def used(self) -> None:
        """One consumer unpacked: the device copy is dropped after the last one."""
        self.users -= 1
        if self.users <= 0:
            self.cached = None


@dataclass
class Offloaded:
    """A consumer's saving that lives on the host (shared :class:`HostCopy` of its storage)."""

    copy: HostCopy
    engine: CopyEngine
    view: View

    def unpack(self) -> torch.Tensor:
        tensor = self.view.rebuild(self.copy.to_device(self.engine, self.view.device))
        self.copy.used()
        return tensor


@dataclass
class Quantized:
    """A consumer's saving stored as a shared FP8 copy of its storage with one FP32 scale."""

    data: torch.Tensor
    scale: torch.Tensor
    view: View

    def unpack(self) -> torch.Tensor:
        return self.view.rebuild(dequantize_fp8(self.data, self.scale, self.view.dtype))


def saved_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A saving kept as it is, packed as a detached alias of ``tensor`` (same storage and version counter: a saved
    *output* packed as itself would form a reference cycle through its own autograd node) that notes the version
    it was saved at. PyTorch skips its own in-place check on savings that go through saved-tensor hooks;
    :func:`unpack` makes it instead."""
    alias = tensor.detach()
    alias._saved_version = tensor._version
    return alias


def check_unchanged(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (a :func:`saved_alias`) unless it was changed in place after it was saved: then the
    ``RuntimeError`` PyTorch raises without hooks, as the backward would compute with the changed values."""
    saved = getattr(tensor, "_saved_version", None)
    if saved is not None and tensor._version != saved:
        raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an inplace "
                           f"operation: a {tuple(tensor.shape)} {tensor.dtype} tensor saved for backward is at "
                           f"version {tensor._version}; expected version {saved} instead (change a clone of it, or "
                           "change it only after the backward)")
    return tensor


def unpack(packed):
    """The saved-tensor unpack hook: a kept tensor as it is (unless changed in place since), anything packed
    through its ``unpack``."""
    return check_unchanged(packed) if isinstance(packed, torch.Tensor) else packed.unpack()
