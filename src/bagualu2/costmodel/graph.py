"""Operator-graph types: tensors, ops and the graph of one pipeline-stage chunk.

An :class:`OpGraph` is the forward op chain of the layers of one chunk. Every op lists the tensors it saves for
backward (``saves``) together with the precision it stores them in: one logical tensor may be saved by several
consumers, possibly in different precisions (the MoE router keeps an FP32 copy of the tensor the shared expert
keeps in BF16). A mitigation decision is made per *saving*, i.e. per ``(op name, tensor name)`` pair.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType
from typing import Mapping, NamedTuple

from .config import Hardware
from .validate import require_int

ITEM_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "bool": 1, "int32": 4, "int64": 8, "complex64": 8}
FLOAT_DTYPES = frozenset({"fp32", "bf16", "fp16"})  # may be quantised to FP8
MAX_GRAPH_NS = 1 << 56  # forward + backward of all ops of a graph (~2.3 years): far from int64 in any solver's sum


class GraphTooSlowError(ValueError):
    """A graph whose ops take more than ``MAX_GRAPH_NS``: the hardware profile is too slow for the model."""


OP_KINDS = (
    "norm", "qkv", "rope", "core_attn", "attn_out", "residual", "router", "permute", "dispatch",
    "expert_fc1", "expert_act", "expert_fc2", "combine", "unpermute", "shared_fc1", "shared_act",
    "shared_fc2", "mlp_fc1", "mlp_act", "mlp_fc2", "tp_gather", "tp_reduce",
)
#: Kinds whose FLOPs are matrix products or attention (what a FLOP counter such as torch's counts); the other
#: kinds are elementwise, memory-bound, and their ``flops`` only enter the roofline time.
MATMUL_KINDS = frozenset({"qkv", "core_attn", "attn_out", "router", "expert_fc1", "expert_fc2", "shared_fc1",
                          "shared_fc2", "mlp_fc1", "mlp_fc2"})
COMM_KINDS = frozenset({"dispatch", "combine", "tp_gather", "tp_reduce"})
MOE_KINDS = frozenset({"router", "permute", "dispatch", "expert_fc1", "expert_act", "expert_fc2",
                       "combine", "unpermute", "shared_fc1", "shared_act", "shared_fc2"})


class Resource(str, enum.Enum):
    """Hardware resource an op occupies: the compute stream, the communication stream, the two copy engines."""

    COMPUTE = "compute"
    COMM = "comm"
    D2H = "d2h"
    H2D = "h2d"


class TensorSpec(NamedTuple):
    """A logical activation tensor: ``numel`` elements of ``dtype`` produced by ``producer`` (None: graph input).

    ``routed`` marks tensors whose size scales with the MoE imbalance rate (tokens received by local experts).
    """

    name: str
    numel: int
    dtype: str
    producer: str | None
    routed: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * ITEM_BYTES[self.dtype]


class Saving(NamedTuple):
    """One op keeps ``tensor`` for its backward, stored in precision ``dtype``."""

    tensor: str
    dtype: str


class Op(NamedTuple):
    """One forward operator (one kernel or one collective) with its roofline times.

    ``forward_ns`` / ``backward_ns`` are integer nanoseconds so that solvers can reproduce the evaluator exactly.
    """

    name: str
    kind: str
    layer: int
    resource: Resource
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    saves: tuple[Saving, ...]
    flops: int
    moved_bytes: int
    forward_ns: int
    backward_ns: int


@dataclass(frozen=True, eq=False)
class OpGraph:
    """The forward ops of one pipeline-stage chunk, in program order, with everything needed to cost a plan.

    ``activation_dtype`` is the model's activation precision: a saving stored wider than it (the router's FP32
    copy, FP32 statistics) is precision-critical and may not be quantised.

    ``pinned`` holds the savings that must stay ``KEEP``: the block input of every layer, the checkpoint that
    full recomputation restarts from. ``floor_bytes`` (M0) is what those keep; ``unmitigated_bytes`` what the
    graph keeps with no mitigation at all. ``quantize=False`` offers no FP8 storage (QUANTIZE) anywhere: the plans
    on it are exact (KEEP, OFFLOAD, RECOMPUTE give the gradients of the plain run bit for bit).
    """

    ops: tuple[Op, ...]
    tensors: Mapping[str, TensorSpec]
    hardware: Hardware
    pinned: frozenset[tuple[str, str]] = frozenset()
    imbalance: float = 1.0
    label: str = ""
    activation_dtype: str = "bf16"
    mean_routed_tokens: int = 0  # routed token copies per MoE layer at imbalance 1 (tokens * top-k); 0: dense
    # routed copies each MoE layer's routed tensors hold, where they differ from ``routed_tokens(imbalance)`` (a
    # traced graph: what each layer's experts received in the trace); empty: every layer as ``imbalance`` says
    layer_routed_tokens: Mapping[int, int] = field(default_factory=dict)
    quantize: bool = True
    _index: Mapping[str, int] = field(init=False, repr=False)
    _consumers: Mapping[str, tuple[tuple[str, str], ...]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.ops:
            raise ValueError("ops must not be empty")
        if not isinstance(self.quantize, bool):
            raise ValueError(f"quantize must be True or False, got {self.quantize!r}")
        if self.activation_dtype not in FLOAT_DTYPES:
            raise ValueError(f"activation_dtype must be one of {', '.join(sorted(FLOAT_DTYPES))}, "
                             f"got {self.activation_dtype!r}")
        index: dict[str, int] = {}
        consumers: dict[str, list[tuple[str, str]]] = {}
        for position, op in enumerate(self.ops):
            if op.name in index:
                raise ValueError(f"duplicate op name {op.name!r}")
            if op.kind not in OP_KINDS:
                raise ValueError(f"op {op.name!r} has unknown kind {op.kind!r}; allowed: {', '.join(OP_KINDS)}")
            for field_name in ("forward_ns", "backward_ns", "flops", "moved_bytes"):
                require_int(f"op {op.name!r}'s {field_name}", getattr(op, field_name), 0)
            if not isinstance(op.resource, Resource) or op.resource not in (Resource.COMPUTE, Resource.COMM):
                raise ValueError(f"op {op.name!r} has resource {op.resource!r}; allowed: compute, comm")
            index[op.name] = position
            for name in op.inputs + op.outputs:
                if name not in self.tensors:
                    raise ValueError(f"op {op.name!r} uses unknown tensor {name!r}")
            for saving in op.saves:
                if saving.tensor not in self.tensors:
                    raise ValueError(f"op {op.name!r} saves unknown tensor {saving.tensor!r}")
                if saving.dtype not in ITEM_BYTES:
                    raise ValueError(f"op {op.name!r} saves {saving.tensor!r} as unknown dtype {saving.dtype!r}")
                consumers.setdefault(saving.tensor, []).append((op.name, saving.dtype))
        total_ns = sum(op.forward_ns + op.backward_ns for op in self.ops)
        if total_ns > MAX_GRAPH_NS:
            raise GraphTooSlowError(f"the ops of {self.label or 'the graph'} take {total_ns * 1e-9:.3g} s of one "
                                    f"micro-batch (forward and backward; at most {MAX_GRAPH_NS * 1e-9:.3g} s, so that "
                                    "every sum of nanoseconds stays an int64): a faster hardware profile or a smaller "
                                    "model")
        for name, spec in self.tensors.items():
            require_int(f"tensor {name!r}'s numel", spec.numel, 0)
            if spec.dtype not in ITEM_BYTES:
                raise ValueError(f"tensor {name!r} has unknown dtype {spec.dtype!r}; allowed: "
                                 f"{', '.join(ITEM_BYTES)}")
            if spec.producer is not None and spec.producer not in index:
                raise ValueError(f"tensor {name!r} has unknown producer {spec.producer!r}")
        for position, op in enumerate(self.ops):  # program order: nothing reads a tensor an op after it makes
            for name in op.inputs:
                producer = self.tensors[name].producer
                if producer is not None and index[producer] >= position:
                    raise ValueError(f"op {op.name!r} reads tensor {name!r}, which op {producer!r} makes at or after "
                                     "it; ops must be in program order")
        if self.pinned:
            savings = {(op.name, s.tensor) for op in self.ops for s in op.saves}
            unknown = sorted(self.pinned - savings)  # sorted: the first reported is the same in every process
            if unknown:
                raise ValueError(f"pinned saving {unknown[0]!r} is not a saving of the graph")
        for layer, tokens in self.layer_routed_tokens.items():
            if isinstance(layer, bool) or not isinstance(layer, int) or isinstance(tokens, bool) \
                    or not isinstance(tokens, int) or tokens < 0:
                raise ValueError(f"layer_routed_tokens must map layers to token counts >= 0, got {layer!r}: "
                                 f"{tokens!r}")
        object.__setattr__(self, "layer_routed_tokens", MappingProxyType(dict(self.layer_routed_tokens)))
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "_index", MappingProxyType(index))
        object.__setattr__(self, "_consumers",
                           MappingProxyType({k: tuple(v) for k, v in consumers.items()}))

    def op(self, name: str) -> Op:
        try:
            return self.ops[self._index[name]]
        except KeyError:
            raise ValueError(f"unknown op {name!r}") from None

    def quantizable(self, saving: Saving) -> bool:
        """May this saving be stored in FP8? The graph allows it (``quantize``), and the saving is floating and not
        wider than the activation precision."""
        return (self.quantize and saving.dtype in FLOAT_DTYPES
                and ITEM_BYTES[saving.dtype] <= ITEM_BYTES[self.activation_dtype])

    def has_op(self, name: str) -> bool:
        return name in self._index

    def consumers(self, tensor: str) -> tuple[tuple[str, str], ...]:
        """The ``(op name, stored dtype)`` pairs that save ``tensor``."""
        return self._consumers.get(tensor, ())

    @cached_property
    def savings(self) -> tuple[tuple[Op, Saving], ...]:
        """Every (op, saving) pair in program order."""
        return tuple((op, s) for op in self.ops for s in op.saves)

    @cached_property
    def decisions(self) -> tuple[tuple[str, str], ...]:
        """The ``(op, tensor)`` pairs a plan may mitigate (every saving except the pinned ones)."""
        return tuple((op.name, s.tensor) for op, s in self.savings if (op.name, s.tensor) not in self.pinned)

    def copies_bytes(self, copies) -> int:
        """Device bytes of distinct stored copies ``{(tensor, dtype)}`` (the evaluator's KEEP rule)."""
        tensors = self.tensors
        return sum(tensors[t].numel * ITEM_BYTES[d] for t, d in copies)

    @cached_property
    def unmitigated_bytes(self) -> int:
        """Activation bytes kept with every saving ``KEEP``: one copy per tensor and stored precision."""
        return self.copies_bytes({(s.tensor, s.dtype) for _, s in self.savings})

    def routed_tokens(self, imbalance: float) -> int:
        """Routed token copies one MoE layer's experts receive at ``imbalance`` (``round(T*K*r)``, as built)."""
        return int(round(self.mean_routed_tokens * imbalance))

    @cached_property
    def tensor_layers(self) -> Mapping[str, int]:
        """The layer of every tensor: its producer's; one without a producer, that of the first op that reads,
        makes or saves it."""
        layers: dict[str, int] = {}
        for op in self.ops:
            for name in (*op.inputs, *op.outputs, *(s.tensor for s in op.saves)):
                layers.setdefault(name, op.layer)
        for name, spec in self.tensors.items():
            if spec.producer is not None:
                layers[name] = self.op(spec.producer).layer
            else:
                layers.setdefault(name, 0)
        return MappingProxyType(layers)

    def built_routed_tokens(self, layer: int) -> int:
        """Routed token copies MoE layer ``layer``'s routed tensors hold in this graph."""
        found = self.layer_routed_tokens.get(layer)
        return self.routed_tokens(self.imbalance) if found is None else found

    @cached_property
    def floor_bytes(self) -> int:
        """M0: bytes kept when everything but the pinned block inputs is mitigated (full recompute); a pinned
        tensor counts once per precision its consumers store it in (they all keep it in a conflict-free plan)."""
        pinned = {tensor for _, tensor in self.pinned}  # every consumer of a pinned tensor keeps it (conflict rules)
        return self.copies_bytes({(s.tensor, s.dtype) for _, s in self.savings if s.tensor in pinned})

    @cached_property
    def routed_bytes(self) -> int:
        """Bytes of routed-expert tensors kept with no mitigation (the part that scales with imbalance)."""
        return self.copies_bytes({(s.tensor, s.dtype) for _, s in self.savings if self.tensors[s.tensor].routed})

    @cached_property
    def forward_ns(self) -> int:
        return sum(op.forward_ns for op in self.ops)

    @cached_property
    def backward_ns(self) -> int:
        return sum(op.backward_ns for op in self.ops)

    @cached_property
    def base_resource_ns(self) -> Mapping[Resource, int]:
        """Forward + backward nanoseconds of the unmitigated ops on each resource."""
        totals = {Resource.COMPUTE: 0, Resource.COMM: 0}
        for op in self.ops:
            totals[op.resource] += op.forward_ns + op.backward_ns
        return MappingProxyType(totals)

    @cached_property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({op.layer for op in self.ops}))

    @cached_property
    def kinds(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(op.kind for op in self.ops))
