"""Static memory (weights, gradients, optimizer states) and the peak memory of one pipeline stage.

Per rank of stage ``p`` with ``P_d`` dense parameters (sharded over tp, replicated over dp) and ``P_e`` expert
parameters (``E/ep`` local experts, expert tensor parallelism 1, replicated over ``edp = dp*tp*cp/ep`` ranks):

    static = w*(P_d + P_e) + 4*(P_d + P_e) + o*P_d/shard_d + o*P_e/shard_e

``w`` is the parameter dtype's bytes (2 for bf16), gradients accumulate in fp32 main grads (4 bytes), Adam keeps
fp32 master weights, momentum and variance (``o = 12`` bytes, or 8 when the weights are already fp32) sharded over
``shard_d = dp*cp`` and ``shard_e = edp`` with the distributed optimizer (1 without).
"""

from __future__ import annotations

from dataclasses import dataclass

from .build import build_graph, check_imbalance, chunk_layers
from .config import Hardware, ModelConfig, ParallelConfig, check_compatible
from .evaluate import evaluate
from .pipeline import inflight_chunks, inflight_microbatches, peak_bytes
from .plan import Plan


def layer_parameters(model: ModelConfig, layer: int, *, tp: int = 1) -> tuple[int, int]:
    """``(dense, expert)`` parameters of one layer on one rank of ``tp`` (expert count: all experts)."""
    h, d = model.hidden_size, model.head_dim
    fc1 = 2 if model.activation == "swiglu" else 1
    attention = h * (model.num_attention_heads + 2 * model.num_query_groups) * d + model.num_attention_heads * d * h
    dense = attention // tp + 2 * h  # two norms, replicated
    if not model.is_moe_layer(layer):
        return dense + (fc1 + 1) * h * model.ffn_hidden_size // tp, 0
    expert = (fc1 + 1) * h * model.moe_ffn_hidden_size
    dense += h * model.num_experts + model.num_shared_experts * expert // tp
    return dense, model.num_experts * expert


def num_parameters(model: ModelConfig) -> tuple[int, int]:
    """``(total, active per token)`` parameters of the whole model."""
    if not isinstance(model, ModelConfig):
        raise ValueError(f"model must be a ModelConfig, got {type(model).__name__}")
    total = active = 0
    for layer in range(model.num_layers):
        dense, expert = layer_parameters(model, layer)
        total += dense + expert
        active += dense + (expert // model.num_experts * model.top_k if expert else 0)
    embeddings = model.vocab_size * model.hidden_size * (1 if model.tie_embeddings else 2) + model.hidden_size
    return total + embeddings, active + embeddings


def stage_parameters(model: ModelConfig, parallel: ParallelConfig, *, stage: int = 0) -> tuple[int, int]:
    """``(dense, expert)`` parameters held by one rank of ``stage`` (all its virtual chunks)."""
    check_compatible(model, parallel)
    dense = expert = 0
    for chunk in range(parallel.vp):
        for layer in chunk_layers(model, parallel, stage=stage, chunk=chunk):
            d, e = layer_parameters(model, layer, tp=parallel.tp)
            dense += d
            expert += e // parallel.ep
    vocab = model.vocab_size * model.hidden_size // parallel.tp
    if stage == 0:
        dense += vocab
    if stage == parallel.pp - 1:
        dense += model.hidden_size  # final norm
        if parallel.pp > 1 or not model.tie_embeddings:
            dense += vocab  # output layer (a copy of the embedding when tied and pp > 1)
    return dense, expert


def static_bytes(model: ModelConfig, parallel: ParallelConfig, *, stage: int = 0) -> int:
    """Weights + fp32 gradients + Adam states of one rank of ``stage`` (formula in the module docstring)."""
    dense, expert = stage_parameters(model, parallel, stage=stage)
    weight = model.dtype_bytes
    optimizer = 12 if weight < 4 else 8
    dense_shard = parallel.dp * parallel.cp if parallel.distributed_optimizer else 1
    expert_shard = parallel.expert_data_parallel if parallel.distributed_optimizer else 1
    return ((weight + 4) * (dense + expert) + optimizer * dense // dense_shard
            + optimizer * expert // expert_shard)


def logits_bytes(model: ModelConfig, parallel: ParallelConfig) -> int:
    """FP32 logits the last stage keeps for the cross-entropy backward of the micro-batch in flight."""
    tokens = model.seq_length * model.micro_batch_size // parallel.cp
    return 4 * tokens * model.vocab_size // parallel.tp


@dataclass(frozen=True)
class StageMemory:
    """Memory of one rank of one pipeline stage; ``m_max_bytes`` and ``m0_bytes`` feed Algorithm 1."""

    static_bytes: int
    activation_peak_bytes: int
    peak_bytes: int
    capacity_bytes: int
    m_max_bytes: int
    m0_bytes: int
    chunk_bytes: tuple[int, ...]
    inflight_chunks: int
    inflight_microbatches: float
    logits_bytes: int = 0  # the last stage's fp32 logits of the micro-batch in flight, outside M_max

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.peak_bytes

    @property
    def floor_bytes(self) -> int:
        """What the in-flight chunks keep fully recomputed: below it no plan fits."""
        return self.inflight_chunks * self.m0_bytes

    def check_room(self, hardware: Hardware, stage: int, *, capped: bool = False) -> None:
        """One-line ``ValueError`` when ``m_max_bytes`` (what ``hardware`` leaves for activations on ``stage``; with
        ``capped``, a given cap) is below :attr:`floor_bytes`: nothing fits, not even under full recompute."""
        if self.m_max_bytes >= self.floor_bytes:
            return
        gib = 2 ** 30
        where = (f"the activation cap m_max_bytes={self.m_max_bytes} on stage {stage}" if capped else
                 f"hardware {hardware.name!r} leaves {self.m_max_bytes / gib:.2f} GiB for activations on stage "
                 f"{stage} ({hardware.hbm_bytes / gib:.1f} GiB less {hardware.reserved_bytes / gib:.1f} reserved, "
                 f"{self.static_bytes / gib:.2f} of weights, gradients and optimizer states"
                 + (f" and {self.logits_bytes / gib:.2f} of logits)" if self.logits_bytes else ")"))
        floor = f"{self.floor_bytes / gib:.2f} GiB" if self.floor_bytes >= gib // 100 else f"{self.floor_bytes} bytes"
        raise ValueError(f"{where}, below the {floor} its {self.inflight_chunks} in-flight "
                         "chunks keep fully recomputed: nothing fits; use a larger hardware profile, more pipeline "
                         "or tensor parallelism, a smaller micro-batch, or a larger cap")


def _chunk_plan(plan: Plan | None, graph_ops: set[str]) -> Plan | None:
    if plan is None:
        return None
    return Plan(tuple((k, s) for k, s in plan.entries if "/" not in k or k.split("/", 1)[0] in graph_ops))


def stage_memory(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, *, plan: Plan | None = None,
                 stage: int = 0, imbalance: float = 1.0) -> StageMemory:
    """Static, activation-peak and total peak bytes of ``stage`` when every micro-batch runs ``plan``.

    The activation peak replays the (interleaved) 1F1B schedule with each chunk's ``evaluate`` bytes; the last
    stage adds the logits of one micro-batch. ``m_max_bytes`` is the device capacity left for chunk activations (after the hardware's
    ``reserved_bytes``, static memory and logits) and
    ``m0_bytes`` the largest chunk floor (full recompute keeps only block inputs).
    """
    check_compatible(model, parallel)
    check_imbalance(imbalance)
    plan = Plan.coerce(plan)
    graphs = [build_graph(model, parallel, hardware, imbalance=imbalance, stage=stage, chunk=c)
              for c in range(parallel.vp)]
    if plan is not None:
        all_ops = {op.name for g in graphs for op in g.ops}
        unknown = sorted(k for k, _ in plan.entries if "/" in k and k.split("/", 1)[0] not in all_ops)
        if unknown:
            raise ValueError(f"plan entries name ops that stage {stage} does not have: {', '.join(unknown)}")
    chunk_bytes = tuple(evaluate(g, _chunk_plan(plan, {op.name for op in g.ops})).activation_bytes for g in graphs)
    extra = logits_bytes(model, parallel) if stage == parallel.pp - 1 else 0
    activation_peak = peak_bytes(parallel, [chunk_bytes] * parallel.num_microbatches, stage=stage) + extra
    static = static_bytes(model, parallel, stage=stage)
    return StageMemory(
        static_bytes=static,
        activation_peak_bytes=activation_peak,
        peak_bytes=static + activation_peak,
        capacity_bytes=hardware.hbm_bytes - hardware.reserved_bytes,
        m_max_bytes=max(hardware.hbm_bytes - hardware.reserved_bytes - static - extra, 0),
        m0_bytes=max(g.floor_bytes for g in graphs),
        chunk_bytes=chunk_bytes,
        inflight_chunks=inflight_chunks(parallel, stage),
        inflight_microbatches=inflight_microbatches(parallel, stage),
        logits_bytes=extra,
    )
