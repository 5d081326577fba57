"""Configuration dataclasses of the cost model: model shape, parallel layout, hardware.

All three are keyword-only, frozen and validated in ``__post_init__``; every invalid value raises
``ValueError`` naming the field and what is allowed. Bytes are integers, times are seconds.
"""

from __future__ import annotations

from .validate import load_json, require_fields, require_int, require_number

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
ACTIVATIONS = ("swiglu", "gelu")
NORMALIZATIONS = ("rmsnorm", "layernorm")
# Physical ranges of the Hardware fields: wide enough for any real device, narrow enough that one op's duration
# (integer nanoseconds for the solvers) and byte counts stay far from int64 / float overflow; a whole graph's
# durations are bounded where it is built (``graph.MAX_GRAPH_NS``: the slowest devices with the largest models).
HARDWARE_RANGES = {
    "peak_flops": (1e9, 1e18), "hbm_bytes": (1 << 20, 1 << 50), "hbm_bytes_per_s": (1e6, 1e15),
    "h2d_bytes_per_s": (1e6, 1e15), "d2h_bytes_per_s": (1e6, 1e15), "intra_node_bytes_per_s": (1e6, 1e15),
    "inter_node_bytes_per_s": (1e6, 1e15), "devices_per_node": (1, 1 << 16), "kernel_launch_s": (0.0, 1.0),
    "matmul_efficiency": (0.01, 1.0), "link_efficiency": (0.01, 1.0), "reserved_bytes": (0, 1 << 50),
}
HARDWARE_UNITS = {"peak_flops": "FLOP/s", "hbm_bytes": "bytes", "devices_per_node": "devices",
                  "kernel_launch_s": "seconds", "matmul_efficiency": "fraction of peak_flops",
                  "link_efficiency": "fraction of the link rates", "reserved_bytes": "bytes",
                  **{name: "bytes/s" for name in HARDWARE_RANGES if name.endswith("_bytes_per_s")}}


# Upper bounds of the model and layout fields: far above any model or cluster trained today, low enough that the
# per-chunk graphs, schedules and byte counts stay small and exact (a value past them is a typo, not a model).
MODEL_MAX = {
    "num_layers": 1 << 10, "hidden_size": 1 << 18, "num_attention_heads": 1 << 12, "num_query_groups": 1 << 12,
    "head_dim": 1 << 12, "ffn_hidden_size": 1 << 20, "vocab_size": 1 << 24, "seq_length": 1 << 24,
    "micro_batch_size": 1 << 16, "moe_ffn_hidden_size": 1 << 20, "num_experts": 1 << 16, "top_k": 1 << 16,
    "num_shared_experts": 1 << 10, "num_dense_layers": 1 << 10,
}
MAX_CHUNK_LAYERS = 256  # a chunk's op graph is planned whole: the greedy takes about 20 s on 256 layers
PARALLEL_MAX = {"dp": 1 << 20, "tp": 1 << 10, "ep": 1 << 16, "pp": 1 << 10, "vp": 1 << 8, "cp": 1 << 10,
                "num_microbatches": 1 << 14}


def _short(value: Any, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters (error messages stay one short line)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # a very deep list, an int too long to print
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_int(obj: Any, name: str, *, minimum: int = 1, maximum: int | None = None) -> None:
    value = getattr(obj, name)
    object.__setattr__(obj, name, require_int(name, value, minimum, maximum, high_open=False))  # numpy ints too


def _check_choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a GLM/Llama-style decoder. A dense model has ``num_experts=0`` and the MoE fields 0.

    Fields (legend letter in brackets, see docs/costmodel.md):
      num_layers [L]            transformer layers of the whole model.
      hidden_size [h]           residual-stream width.
      num_attention_heads [a]   query heads.
      num_query_groups [g]      key/value heads (GQA); equal to ``a`` for multi-head attention.
      head_dim [d]              width of one head (``a*d`` need not equal ``h``).
      ffn_hidden_size [f]       dense-MLP width (dense layers and dense models).
      moe_ffn_hidden_size [fe]  width of one routed (and shared) expert.
      num_experts [E]           routed experts per MoE layer (0 = dense model).
      top_k [K]                 experts each token is routed to.
      num_shared_experts [S]    always-active shared experts per MoE layer.
      num_dense_layers          leading layers that use the dense MLP instead of MoE.
      vocab_size [V]            vocabulary size (embedding and output layer).
      seq_length [s]            tokens per sequence.
      micro_batch_size [b]      sequences per micro-batch.
      dtype                     activation / weight precision: bf16, fp16 or fp32.
      flash_attention           fused attention keeps q, k, v, output and the log-sum-exp only.
      activation                MLP activation: swiglu (gate and up projections) or gelu.
      normalization             rmsnorm or layernorm.
      hidden_dropout            dropout after attention / MLP (a 1-byte mask per element if > 0).
      attention_dropout         dropout on attention probabilities (non-flash path keeps a mask).
      tie_embeddings            output layer shares the input embedding's weights.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    moe_ffn_hidden_size: int = 0
    num_experts: int = 0
    top_k: int = 0
    num_shared_experts: int = 0
    num_dense_layers: int = 0
    vocab_size: int
    seq_length: int
    micro_batch_size: int = 1
    dtype: str = "bf16"
    flash_attention: bool = True
    activation: str = "swiglu"
    normalization: str = "rmsnorm"
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "head_dim", "ffn_hidden_size", "vocab_size", "seq_length", "micro_batch_size"):
            _check_int(self, name, maximum=MODEL_MAX[name])
        for name in ("moe_ffn_hidden_size", "num_experts", "top_k", "num_shared_experts",
                     "num_dense_layers"):
            _check_int(self, name, minimum=0, maximum=MODEL_MAX[name])
        _check_choice(self, "dtype", ("bf16", "fp16", "fp32"))
        _check_choice(self, "activation", ACTIVATIONS)
        _check_choice(self, "normalization", NORMALIZATIONS)
        for name in ("hidden_dropout", "attention_dropout"):
            _plain(self, name, require_number(name, getattr(self, name), 0, 1, high_open=True))
        for name in ("flash_attention", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_query_groups={self.num_query_groups}")
        if self.num_experts == 0:
            if self.top_k or self.moe_ffn_hidden_size or self.num_shared_experts or self.num_dense_layers:
                raise ValueError("a dense model (num_experts=0) must have top_k, moe_ffn_hidden_size, "
                                 "num_shared_experts and num_dense_layers equal to 0")
            return
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={self.num_experts}], got {self.top_k}")
        if self.moe_ffn_hidden_size < 1:
            raise ValueError(f"moe_ffn_hidden_size must be >= 1 for an MoE model, got {self.moe_ffn_hidden_size}")
        if self.num_dense_layers > self.num_layers:
            raise ValueError(f"num_dense_layers must be in [0, num_layers={self.num_layers}], "
                             f"got {self.num_dense_layers}")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    def is_moe_layer(self, layer: int) -> bool:
        return self.is_moe and layer >= self.num_dense_layers

    def replace(self, **changes: Any) -> "ModelConfig":
        return _replace(self, changes)


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Parallel layout of one training job (Megatron conventions).

      dp, tp, pp, cp          data, tensor, pipeline and context parallel degrees (world = dp*tp*pp*cp).
      ep                      expert parallel degree; experts are folded over the dp*tp*cp ranks of a stage
                              (expert tensor parallelism 1), so ``dp*tp*cp`` must be a multiple of ``ep``.
      vp                      virtual pipeline chunks per stage (interleaved 1F1B when > 1).
      sequence_parallel       shard norm/dropout activations over tp (requires tp > 1 to matter).
      num_microbatches        micro-batches per iteration per data-parallel replica.
      distributed_optimizer   shard fp32 master weights and Adam states over data parallel ranks.
      paired                  Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``): one more
                              warmup forward than 1F1B, so that every steady F_x B_y pairs two independent
                              micro-batches and one's expert-parallel all-to-alls can overlap the other's compute
                              (without it the last stage runs each F_i right before its own B_i). At pp = 1: one
                              warmup forward, then each F_(i+1) beside B_i (two micro-batches in flight).
    """

    dp: int = 1
    tp: int = 1
    ep: int = 1
    pp: int = 1
    vp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    num_microbatches: int = 1
    distributed_optimizer: bool = True
    paired: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "ep", "pp", "vp", "cp", "num_microbatches"):
            _check_int(self, name, maximum=PARALLEL_MAX[name])
        for name in ("sequence_parallel", "distributed_optimizer", "paired"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if (self.dp * self.tp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp*tp*cp={self.dp * self.tp * self.cp} "
                             "(experts are folded over the data/tensor/context ranks of a stage)")
        if self.vp > 1 and self.pp < 2:
            raise ValueError(f"vp must be 1 when pp=1 (interleaving needs pp >= 2), got vp={self.vp}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def expert_data_parallel(self) -> int:
        """Replicas of one expert: ranks of a stage divided by the expert parallel degree."""
        return self.dp * self.tp * self.cp // self.ep

    def replace(self, **changes: Any) -> "ParallelConfig":
        return _replace(self, changes)


def check_hardware(hardware: Any) -> None:
    """``ValueError`` unless ``hardware`` is a :class:`Hardware` profile."""
    if not isinstance(hardware, Hardware):
        raise ValueError(f"hardware must be a Hardware profile, got {type(hardware).__name__}")


def check_compatible(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Raise ``ValueError`` when ``model`` cannot be laid out with ``parallel`` (or they are not the configs)."""
    for name, value, kind in (("model", model, ModelConfig), ("parallel", parallel, ParallelConfig)):
        if not isinstance(value, kind):
            raise ValueError(f"{name} must be a {kind.__name__}, got {type(value).__name__}")
    chunks = parallel.pp * parallel.vp
    if model.num_layers % chunks:
        raise ValueError(f"num_layers={model.num_layers} must be divisible by pp*vp={chunks}")
    if model.num_layers // chunks > MAX_CHUNK_LAYERS:
        raise ValueError(f"num_layers / (pp*vp) = {model.num_layers // chunks} layers per pipeline chunk; at most "
                         f"{MAX_CHUNK_LAYERS} are planned: raise pp or vp")
    for name in ("num_attention_heads", "num_query_groups"):
        if getattr(model, name) % parallel.tp:
            raise ValueError(f"{name}={getattr(model, name)} must be divisible by tp={parallel.tp}")
    if model.ffn_hidden_size % parallel.tp:
        raise ValueError(f"ffn_hidden_size={model.ffn_hidden_size} must be divisible by tp={parallel.tp}")
    if (model.moe_ffn_hidden_size * model.num_shared_experts) % parallel.tp:
        raise ValueError(f"moe_ffn_hidden_size*num_shared_experts="
                         f"{model.moe_ffn_hidden_size * model.num_shared_experts} must be divisible by tp={parallel.tp}")
    if model.is_moe and model.num_experts % parallel.ep:
        raise ValueError(f"num_experts={model.num_experts} must be divisible by ep={parallel.ep}")
    if not model.is_moe and parallel.ep != 1:
        raise ValueError(f"ep must be 1 for a dense model (num_experts=0), got ep={parallel.ep}")
    if model.seq_length % (parallel.cp * (parallel.tp if parallel.sequence_parallel else 1)):
        raise ValueError(f"seq_length={model.seq_length} must be divisible by cp*tp (sequence parallel)")
    if parallel.vp > 1 and parallel.num_microbatches % parallel.pp:
        raise ValueError(f"num_microbatches={parallel.num_microbatches} must be a multiple of "
                         f"pp={parallel.pp} for interleaved 1F1B (vp > 1)")


def _plain(obj: Any, name: str, number: float) -> None:
    """Store a validated number as a plain Python number (a numpy scalar would not print as JSON)."""
    if type(getattr(obj, name)) not in (int, float):
        object.__setattr__(obj, name, number)


def _replace(config: Any, changes: dict[str, Any]) -> Any:
    """``config`` with ``changes``; an unknown field is one ``ValueError`` naming it and the fields there are."""
    require_fields(type(config).__name__, changes, [f.name for f in dataclasses.fields(config) if f.init])
    return dataclasses.replace(config, **changes)


def _check_optional(name: str, value: Any, like: str) -> None:
    """A Hardware field that may be null, else a number in the range of the field ``like``."""
    if value is None:
        return
    low, high = HARDWARE_RANGES[like]
    try:
        require_number(name, value, low, high)
    except (ValueError, OverflowError):
        raise ValueError(f"{name} must be null or a finite number in [{low:g}, {high:g}] ({HARDWARE_UNITS[like]}), "
                         f"got {_short(value)}") from None


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """One accelerator and its links. Calibrate your own and load it with ``Hardware.from_json``.

      name                      label used in reports.
      peak_flops                dense bf16 FLOP/s of one device.
      hbm_bytes                 device memory capacity.
      hbm_bytes_per_s           device memory bandwidth.
      h2d_bytes_per_s           host -> device copy bandwidth (pinned memory).
      d2h_bytes_per_s           device -> host copy bandwidth (pinned memory).
      intra_node_bytes_per_s    per-device bandwidth to peers in the same node.
      inter_node_bytes_per_s    per-device bandwidth to other nodes.
      devices_per_node          devices sharing the intra-node fabric.
      kernel_launch_s           fixed cost of one kernel or copy launch.
      copy_launch_s             fixed cost of one host<->device copy instead, when copies cost differently from
                                kernels (a calibrated CPU profile); None: ``kernel_launch_s``.
      matmul_efficiency         achievable fraction of ``peak_flops`` for GEMMs (roofline ceiling).
      attention_efficiency      the same for the core-attention kernel (forward and backward), which reaches less
                                of the peak than a GEMM; None: ``matmul_efficiency``.
      link_efficiency           achieved fraction of the intra- and inter-node link rates for collectives
                                (all-to-all dispatch and combine, tensor-parallel gathers and reductions).
      reserved_bytes            device memory the model cannot use: the CUDA context and library workspaces,
                                communication buffers, allocator fragmentation (``stage_memory`` leaves it out
                                of ``M_max``).

    Every number must lie in its physical range, ``HARDWARE_RANGES`` (e.g. ``peak_flops`` in [1e9, 1e18],
    bandwidths in [1e6, 1e15] bytes/s, ``kernel_launch_s`` in [0, 1], ``matmul_efficiency`` in [0.01, 1]).
    """

    name: str = "custom"
    peak_flops: float
    hbm_bytes: int
    hbm_bytes_per_s: float
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    intra_node_bytes_per_s: float
    inter_node_bytes_per_s: float
    devices_per_node: int = 8
    kernel_launch_s: float = 5e-6
    matmul_efficiency: float = 1.0
    attention_efficiency: float | None = None
    copy_launch_s: float | None = None
    link_efficiency: float = 1.0
    reserved_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 200 or not self.name.isprintable():
            raise ValueError("name must be a non-empty string of at most 200 printable characters, got "
                             f"{_short(self.name)}")
        for name, (low, high) in HARDWARE_RANGES.items():
            value = getattr(self, name)
            try:
                if name in ("hbm_bytes", "devices_per_node", "reserved_bytes"):
                    object.__setattr__(self, name, require_int(name, value, low, high, high_open=False))
                else:
                    _plain(self, name, require_number(name, value, low, high))
            except (ValueError, OverflowError):  # OverflowError: an int too large for a float
                integral = name in ("hbm_bytes", "devices_per_node", "reserved_bytes")
                bounds = f"[{int(low)}, {int(high)}]" if integral else f"[{low:g}, {high:g}]"
                raise ValueError(f"{name} must be {'an integer' if integral else 'a finite number'} in {bounds} "
                                 f"({HARDWARE_UNITS[name]}), got {_short(value)}") from None
        if self.reserved_bytes >= self.hbm_bytes:
            raise ValueError(f"reserved_bytes must be below hbm_bytes ({self.hbm_bytes}), got {self.reserved_bytes}")
        for name, like in (("attention_efficiency", "matmul_efficiency"), ("copy_launch_s", "kernel_launch_s")):
            _check_optional(name, getattr(self, name), like)
            if getattr(self, name) is not None:
                _plain(self, name, float(getattr(self, name)))

    @property
    def attention_share(self) -> float:
        """The fraction of ``peak_flops`` the core-attention kernel reaches: ``attention_efficiency``, else
        ``matmul_efficiency``."""
        return self.matmul_efficiency if self.attention_efficiency is None else self.attention_efficiency

    @property
    def copy_setup_s(self) -> float:
        """The fixed cost of one host<->device copy: ``copy_launch_s``, else ``kernel_launch_s``."""
        return self.kernel_launch_s if self.copy_launch_s is None else self.copy_launch_s

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Hardware":
        data = load_json(text, "hardware JSON", "expected one object of Hardware fields")
        if not isinstance(data, dict):
            raise ValueError("hardware JSON must be an object of Hardware fields")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - fields)
        if unknown:
            raise ValueError(f"unknown hardware field(s) {_short(', '.join(unknown))}; "
                             f"allowed: {', '.join(sorted(fields))}")
        missing = sorted(f.name for f in dataclasses.fields(cls)
                         if f.name not in data and f.default is dataclasses.MISSING)
        if missing:
            raise ValueError(f"missing hardware field(s): {', '.join(missing)}")
        for name in ("hbm_bytes", "devices_per_node", "reserved_bytes"):  # JSON writes 64e9 as a float
            value = data.get(name)
            if isinstance(value, float) and value.is_integer():
                data[name] = int(value)
        return cls(**data)

    def replace(self, **changes: Any) -> "Hardware":
        return _replace(self, changes)
