"""What the executor records per micro-batch: bytes by storage, the storages it named, replays, host copies."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from bagualu2.costmodel.plan import Plan
from bagualu2.costmodel.strategy import Strategy

from .packing import SCALE_BYTES
from .recompute import Replay, Stored
from .tracker import MicroBatchBytes

TORCH_TO_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "int32",
                 torch.int64: "int64", torch.bool: "bool", torch.complex64: "complex64"}


@dataclass
class MicroBatchRecord:
    """What one micro-batch stored. Bytes are deduplicated per storage (host: per storage and dtype)."""

    name: str
    plan: Plan
    strategies: dict[tuple[str, str], Strategy]                 # resolved plan in force (changes on a downgrade)
    rerun: frozenset[str]                                       # ops that become replays
    device: MicroBatchBytes = field(default_factory=MicroBatchBytes)  # shared with the tracker
    host: dict[int, int] = field(default_factory=dict)          # storage id -> host bytes
    scales: set[int] = field(default_factory=set)               # storage ids with an FP8 copy
    unknown: dict[int, int] = field(default_factory=dict)       # storage id -> bytes kept without a name
    unknown_count: int = 0                                      # pack calls that could not be named
    pack_count: int = 0                                         # pack calls (savings autograd made)
    unknown_ops: dict[str | None, int] = field(default_factory=dict)  # op -> bytes of its unnamed storages
    storages: dict[tuple[str, int], Stored] = field(default_factory=dict)
    applied: dict[tuple[str, str], Strategy] = field(default_factory=dict)  # what the hook applied
    replays: list[Replay] = field(default_factory=list)
    host_copies: list = field(default_factory=list)
    downgraded: list[int] = field(default_factory=list)         # MoE layers downgraded after their gate
    active: Replay | None = None                                # the replayable op running now
    forward_gate: Callable[[str], None] | None = None           # called before each op (dual-batch executor)
    backward_gate: Callable[[str], None] | None = None          # called before each op's backward
    pending_offloads: dict[str, list[Stored]] = field(default_factory=dict)  # tensor -> deferred host copies
    named: dict[str, list[Stored]] = field(default_factory=dict)    # tensor -> the storages named so
    producers: dict[str, tuple[Replay, int]] = field(default_factory=dict)  # tensor -> (replay, output) making it
    held_names: dict[str, set[torch.dtype]] = field(default_factory=dict)  # name -> dtypes of its readers
    provisional: list = field(default_factory=list)  # savings held until their layer's gate settles them
    standby: list[Replay] = field(default_factory=list)  # replays the gate may still activate
    gated: set[int] = field(default_factory=set)     # MoE layers whose gate has fired
    budget_bytes: int | None = None                  # what its gates decide against (None: the planner's)
    received_tokens: dict[int, int] = field(default_factory=dict)  # MoE layer -> routed copies received here
    group_max_tokens: dict[int, int] = field(default_factory=dict)  # MoE layer -> the most any EP rank received
    calls: dict[str, int] = field(default_factory=dict)  # instrumented module path -> calls so far (slot naming)
    state_checked: bool = False  # its forward's autocast state and modules' modes were compared with the trace's
    forwarding: bool = False        # its micro_batch block is open
    backward_inside: bool = False   # a saving was read back while the block was open
    slot_hits: int = 0              # savings named by their traced slot
    slot_dtype_misses: int = 0      # savings whose traced slot has another dtype (left unnamed)
    slot_fixed: int = 0             # named savings of ops every token passes (sizes: the input's shape)
    slot_size_misses: list[tuple[str, int, int]] = field(default_factory=list)  # (tensor, bytes, traced bytes)
    # (tensor, module path): a saving in the slot where the traced call saved that input, which is not the input now
    slot_input_misses: list[tuple[str, str]] = field(default_factory=list)

    def hold_name(self, name: str | None, dtype: torch.dtype) -> None:
        """Backward will look ``name`` up for a reader of ``dtype``: hold its copies in *other* precisions (the
        router's FP32 copy of a BF16 input) until release."""
        if name is None or dtype in self.held_names.get(name, ()):
            return
        self.held_names.setdefault(name, set()).add(dtype)
        for entry in self.named.get(name, ()):
            if entry.dtype != dtype:
                entry.hold()

    def named_as(self, entry: Stored, name: str) -> None:
        self.named.setdefault(name, []).append(entry)
        if self.held_names.get(name, set()) - {entry.dtype}:  # a reader in another precision will look it up
            entry.hold()

    def clear(self) -> None:
        """Drop every reference to the micro-batch's tensors (after its backward)."""
        for entries in self.named.values():
            for entry in entries:
                entry.drop()
        for replay in self.replays:
            replay.drop()
        for copy in self.host_copies:
            copy.cached = copy.prefetched = None
            if copy.users <= 0:  # a deferred offload a handle still reads keeps its device storage
                copy.pending = None
        self.named.clear()
        self.producers.clear()
        self.provisional.clear()
        self.standby.clear()
        self.pending_offloads.clear()
        self.replays.clear()
        self.host_copies.clear()
        self.held_names.clear()

    def stored_as(self, name: str, engine) -> torch.Tensor | None:
        """A stored storage named ``name`` (any precision), flat, or None."""
        for entry in self.named.get(name, ()):
            flat = entry.flat(entry.device, entry.dtype, engine)
            if flat is not None:
                return flat
        return None

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
