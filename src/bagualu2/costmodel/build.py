"""Build the op graph of one pipeline-stage chunk from a model, a parallel layout and a hardware profile.

Shapes are per rank. Legend: s sequence, b micro-batch, h hidden, a heads, g query groups, d head dim,
f dense FFN, fe expert FFN, E experts, K top-k, S shared experts, t tensor parallel, c context parallel,
r imbalance. Tokens on a rank ``T = s*b/c``; with sequence parallelism norm/residual/MoE tensors hold ``T/t``
tokens (``Tsp``); routed-expert tensors hold ``Tsp*K*r`` tokens.
"""

from __future__ import annotations

import math

from .validate import require_int, require_number, shown


from .config import Hardware, ModelConfig, ParallelConfig, check_compatible, check_hardware
from .graph import COMM_KINDS, ITEM_BYTES, Op, OpGraph, Resource, Saving, TensorSpec
from .strategy import roofline_ns, seconds_to_ns

# A fused (flash) attention backward re-computes the score matrix: five matrix products for the forward's two,
# 2.5 x its FLOPs (FlashAttention-2, Dao 2023, §4.1); every other compute op's backward does 2 x (input and weight
# gradients).
FLASH_BACKWARD_FACTOR = 2.5


class _Builder:
    def __init__(self, model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, imbalance: float):
        self.m, self.p, self.hw, self.r = model, parallel, hardware, imbalance
        self.dt = model.dtype
        self.ops: list[Op] = []
        self.tensors: dict[str, TensorSpec] = {}
        self.pinned: set[tuple[str, str]] = set()
        self.sp = parallel.sequence_parallel and parallel.tp > 1
        self.tokens = model.seq_length * model.micro_batch_size // parallel.cp
        self.sp_tokens = self.tokens // parallel.tp if self.sp else self.tokens

    # ---- primitives ---------------------------------------------------------------------------------------
    def tensor(self, name: str, numel: int, dtype: str, producer: str | None, routed: bool = False) -> str:
        self.tensors[name] = TensorSpec(name, int(numel), dtype, producer, routed)
        return name

    def op(self, layer: int, label: str, kind: str, inputs: tuple[str, ...], outputs: dict[str, tuple],
           saves: tuple[tuple[str, str], ...] = (), flops: int = 0, moved: int | None = None,
           comm_bytes: int = 0, comm_group: int = 1, backward_factor: float = 2.0) -> tuple[str, ...]:
        """Append op ``L{layer}.{label}``; ``outputs`` maps a role to ``(numel, dtype[, routed])``; a compute op's
        backward does ``backward_factor`` times its forward FLOPs (2: the input and weight gradients) and moves
        twice its bytes."""
        name = f"L{layer}.{label}"
        tensors = self.tensors
        out_names = []
        for role, spec in outputs.items():
            tensor = f"L{layer}.{role}"
            tensors[tensor] = TensorSpec(tensor, int(spec[0]), spec[1], name, len(spec) > 2 and spec[2])
            out_names.append(tensor)
        if moved is None:
            moved = sum(tensors[n].nbytes for n in inputs) + sum(tensors[n].nbytes for n in out_names)
        if kind in COMM_KINDS:
            fwd = bwd = self._comm_ns(comm_bytes, comm_group)
            resource = Resource.COMM
        else:
            attention = kind == "core_attn"  # the attention kernel: all of its FLOPs
            fwd = roofline_ns(self.hw, flops, moved, attention_flops=flops if attention else 0)
            bwd = roofline_ns(self.hw, backward_factor * flops, 2 * moved,
                              attention_flops=backward_factor * flops if attention else 0)
            resource = Resource.COMPUTE
        savings = tuple([Saving(t, d) for t, d in saves])
        self.ops.append(Op(name, kind, layer, resource, inputs, tuple(out_names), savings, int(flops), int(moved),
                           fwd, bwd))
        return tuple(out_names)

    def _comm_ns(self, remote_bytes: float, group: int) -> int:
        """Time of a collective moving ``remote_bytes`` off this rank within a group of ``group`` ranks."""
        hw = self.hw
        if group <= 1 or remote_bytes <= 0:
            return seconds_to_ns(hw.kernel_launch_s)
        local_peers = min(group, hw.devices_per_node) - 1
        intra_fraction = local_peers / (group - 1)
        seconds = max(remote_bytes * intra_fraction / hw.intra_node_bytes_per_s,
                      remote_bytes * (1 - intra_fraction) / hw.inter_node_bytes_per_s) / hw.link_efficiency
        return seconds_to_ns(hw.kernel_launch_s + seconds)

    def nbytes(self, numel: float, dtype: str | None = None) -> int:
        return int(numel) * ITEM_BYTES[dtype or self.dt]

    # ---- blocks -------------------------------------------------------------------------------------------
    def tp_gather(self, layer: int, label: str, src: str) -> str:
        """Sequence-parallel all-gather before a column-parallel GEMM (identity without SP)."""
        if not self.sp:
            return src
        t = self.p.tp
        (out,) = self.op(layer, label, "tp_gather", (src,), {f"{label}_out": (self.tokens * self.m.hidden_size,
                                                                              self.dt)},
                         comm_bytes=self.nbytes(self.tokens * self.m.hidden_size) * (t - 1) // t, comm_group=t)
        return out

    def tp_reduce(self, layer: int, label: str, src: str) -> str:
        """Reduce-scatter (SP) or all-reduce after a row-parallel GEMM (identity without TP)."""
        t = self.p.tp
        if t == 1:
            return src
        full = self.nbytes(self.tokens * self.m.hidden_size)
        volume = full * (t - 1) // t * (1 if self.sp else 2)
        (out,) = self.op(layer, label, "tp_reduce", (src,), {f"{label}_out": (self.sp_tokens * self.m.hidden_size,
                                                                              self.dt)},
                         comm_bytes=volume, comm_group=t)
        return out

    def attention(self, layer: int, x: str) -> str:
        m, t, T = self.m, self.p.tp, self.tokens
        h, d = m.hidden_size, m.head_dim
        heads, groups = m.num_attention_heads // t, m.num_query_groups // t
        (n1,) = self.op(layer, "norm1", "norm", (x,), {"norm1_out": (self.sp_tokens * h, self.dt)},
                        saves=((x, self.dt),), flops=5 * self.sp_tokens * h)
        self.pinned.add((f"L{layer}.norm1", x))
        gathered = self.tp_gather(layer, "tp_gather1", n1)
        qkv_width = (heads + 2 * groups) * d
        q, k, v = self.op(layer, "qkv", "qkv", (gathered,),
                          {"q": (T * heads * d, self.dt), "k": (T * groups * d, self.dt),
                           "v": (T * groups * d, self.dt)},
                          saves=((n1, self.dt),), flops=2 * T * h * qkv_width,
                          moved=self.nbytes(T * h + T * qkv_width + h * qkv_width))
        qr, kr = self.op(layer, "rope", "rope", (q, k), {"q_rope": (T * heads * d, self.dt),
                                                         "k_rope": (T * groups * d, self.dt)},
                         flops=3 * T * (heads + groups) * d)
        attn_flops = 2 * T * m.seq_length * heads * d  # QK^T and PV, causal half of 4*T*s*a*d
        name = f"L{layer}.core_attn"
        if m.flash_attention:
            lse = self.tensor(f"L{layer}.attn_lse", T * heads, "fp32", name)
            saves = ((qr, self.dt), (kr, self.dt), (v, self.dt), (f"L{layer}.attn_out_in", self.dt),
                     (lse, "fp32"))
            moved = None
        else:
            probs_numel = heads * T * m.seq_length
            saves_list = [(qr, self.dt), (kr, self.dt),
                          (self.tensor(f"L{layer}.attn_probs", probs_numel, self.dt, name), self.dt)]
            if m.attention_dropout > 0:
                saves_list.append((self.tensor(f"L{layer}.attn_mask", probs_numel, "bool", name), "bool"))
                saves_list.append((self.tensor(f"L{layer}.attn_dropped", probs_numel, self.dt, name), self.dt))
            saves_list.append((v, self.dt))
            saves = tuple(saves_list)
            moved = self.nbytes(4 * T * heads * d + 3 * probs_numel)
        (o,) = self.op(layer, "core_attn", "core_attn", (qr, kr, v), {"attn_out_in": (T * heads * d, self.dt)},
                       saves=saves, flops=attn_flops, moved=moved,
                       backward_factor=FLASH_BACKWARD_FACTOR if m.flash_attention else 2.0)
        (proj,) = self.op(layer, "attn_out", "attn_out", (o,), {"attn_proj": (T * h, self.dt)},
                          saves=((o, self.dt),), flops=2 * T * heads * d * h,
                          moved=self.nbytes(T * heads * d + T * h + heads * d * h))
        reduced = self.tp_reduce(layer, "tp_reduce1", proj)
        return self.residual(layer, "residual1", (reduced, x), "x_mid")

    def residual(self, layer: int, label: str, inputs: tuple[str, ...], out_role: str) -> str:
        numel = self.sp_tokens * self.m.hidden_size
        name = f"L{layer}.{label}"
        saves: tuple[tuple[str, str], ...] = ()
        if self.m.hidden_dropout > 0:
            mask = self.tensor(f"L{layer}.{label}_mask", numel, "bool", name)
            saves = ((mask, "bool"),)
        (out,) = self.op(layer, label, "residual", inputs, {out_role: (numel, self.dt)}, saves=saves,
                         flops=3 * numel)
        return out

    def mlp(self, layer: int, src: str, saved_input: str, prefix: str, width: int, tokens: int,
            routed: bool = False) -> str:
        """fc1 -> activation -> fc2 with fc1 width ``2*width`` for SwiGLU; ``prefix`` is mlp/expert/shared."""
        h = self.m.hidden_size
        fc1_width = 2 * width if self.m.activation == "swiglu" else width
        (f1,) = self.op(layer, f"{prefix}_fc1", f"{prefix}_fc1", (src,),
                        {f"{prefix}_fc1_out": (tokens * fc1_width, self.dt, routed)},
                        saves=((saved_input, self.dt),), flops=2 * tokens * h * fc1_width,
                        moved=self.nbytes(tokens * (h + fc1_width) + h * fc1_width))
        (act,) = self.op(layer, f"{prefix}_act", f"{prefix}_act", (f1,),
                         {f"{prefix}_act_out": (tokens * width, self.dt, routed)},
                         saves=((f1, self.dt),), flops=8 * tokens * width)
        (out,) = self.op(layer, f"{prefix}_fc2", f"{prefix}_fc2", (act,),
                         {f"{prefix}_fc2_out": (tokens * h, self.dt, routed)},
                         saves=((act, self.dt),), flops=2 * tokens * width * h,
                         moved=self.nbytes(tokens * (h + width) + h * width))
        return out

    def dense_mlp(self, layer: int, x_mid: str) -> str:
        h, t = self.m.hidden_size, self.p.tp
        (n2,) = self.op(layer, "norm2", "norm", (x_mid,), {"norm2_out": (self.sp_tokens * h, self.dt)},
                        saves=((x_mid, self.dt),), flops=5 * self.sp_tokens * h)
        gathered = self.tp_gather(layer, "tp_gather2", n2)
        out = self.mlp(layer, gathered, n2, "mlp", self.m.ffn_hidden_size // t, self.tokens)
        reduced = self.tp_reduce(layer, "tp_reduce2", out)
        return self.residual(layer, "residual2", (reduced, x_mid), "x_out")

    def moe(self, layer: int, x_mid: str) -> str:
        m, p = self.m, self.p
        h, K, tokens = m.hidden_size, m.top_k, self.sp_tokens
        routed_tokens = int(round(tokens * K * self.r))  # = OpGraph.routed_tokens(r)
        (n2,) = self.op(layer, "norm2", "norm", (x_mid,), {"norm2_out": (tokens * h, self.dt)},
                        saves=((x_mid, self.dt),), flops=5 * tokens * h)
        router = f"L{layer}.router"
        scores = self.tensor(f"L{layer}.router_scores", tokens * m.num_experts, "fp32", router)
        probs, routing = self.op(layer, "router", "router", (n2,),
                                 {"router_probs": (tokens * K, "fp32"), "routing_map": (tokens * K, "int32")},
                                 saves=((n2, "fp32"), (scores, "fp32"), (f"L{layer}.routing_map", "int32")),
                                 flops=2 * tokens * h * m.num_experts,
                                 moved=self.nbytes(tokens * h, "fp32") + self.nbytes(h * m.num_experts, "fp32")
                                 + self.nbytes(tokens * m.num_experts, "fp32"))
        (perm,) = self.op(layer, "permute", "permute", (n2, routing), {"permuted": (tokens * K * h, self.dt)},
                          saves=((routing, "int32"),))
        remote = (p.ep - 1) / p.ep
        send = self.nbytes(tokens * K * h)
        recv = self.nbytes(routed_tokens * h)
        (received,) = self.op(layer, "dispatch", "dispatch", (perm,),
                              {"dispatched": (routed_tokens * h, self.dt, True)},
                              comm_bytes=int(max(send, recv) * remote), comm_group=p.ep)
        expert_out = self.mlp(layer, received, received, "expert", m.moe_ffn_hidden_size, routed_tokens,
                              routed=True)
        (combined,) = self.op(layer, "combine", "combine", (expert_out,), {"combined": (tokens * K * h, self.dt)},
                              comm_bytes=int(max(send, recv) * remote), comm_group=p.ep)
        (moe_out,) = self.op(layer, "unpermute", "unpermute", (combined, probs), {"moe_out": (tokens * h, self.dt)},
                             saves=((combined, self.dt), (probs, "fp32"), (routing, "int32")),
                             flops=2 * tokens * K * h)
        branches = [moe_out]
        if m.num_shared_experts:
            gathered = self.tp_gather(layer, "tp_gather2", n2)
            width = m.moe_ffn_hidden_size * m.num_shared_experts // p.tp
            shared = self.mlp(layer, gathered, n2, "shared", width, self.tokens)
            branches.append(self.tp_reduce(layer, "tp_reduce2", shared))
        return self.residual(layer, "residual2", (*branches, x_mid), "x_out")


def chunk_layers(model: ModelConfig, parallel: ParallelConfig, *, stage: int = 0, chunk: int = 0) -> range:
    """Global layer indices of virtual chunk ``chunk`` on pipeline stage ``stage`` (Megatron interleaving)."""
    require_int("stage", stage, 0, parallel.pp)
    require_int("chunk", chunk, 0, parallel.vp)
    per_chunk = model.num_layers // (parallel.pp * parallel.vp)
    first = (chunk * parallel.pp + stage) * per_chunk
    return range(first, first + per_chunk)


def routing_limit(model: ModelConfig) -> float:
    """``num_experts / top_k``: the most of the mean routed load any expert-parallel degree lets one rank receive
    (a token reaches at most ``top_k`` experts); infinite for a dense model."""
    if not model.num_experts or not model.top_k:
        return math.inf
    return model.num_experts / model.top_k


def imbalance_limit(model: ModelConfig, parallel: ParallelConfig) -> float:
    """The highest imbalance (max/mean routed load of an expert-parallel rank) any routing gives: a rank hosts
    ``num_experts / ep`` experts and a token sends it at most ``min(top_k, num_experts / ep)`` of its ``top_k``
    copies, so the busiest of ``ep`` ranks receives at most ``min(ep, num_experts / top_k)`` times the mean (a
    dense model: ``ep``)."""
    if not isinstance(model, ModelConfig):
        raise ValueError(f"model must be a ModelConfig, got {type(model).__name__}")
    if not isinstance(parallel, ParallelConfig):
        raise ValueError(f"parallel must be a ParallelConfig, got {type(parallel).__name__}")
    return min(float(parallel.ep), routing_limit(model))


def limit_text(limit: float) -> str:
    """``limit`` for messages, rounded *down* to 4 decimals (42.6666 for 256 / 6): every value shown is taken."""
    return f"{math.floor(limit * 1e4) / 1e4:g}"


def check_imbalance(imbalance: float, *, ep: int | None = None, model: ModelConfig | None = None) -> float:
    """``imbalance`` (max/mean device load) as a float: a finite number >= 1; with ``ep`` (the expert-parallel
    degree) at most ``ep``: the busiest of ``ep`` devices holds at most all the load, ``ep`` times the mean; with
    ``model`` too, at most :func:`imbalance_limit` (a token reaches at most ``top_k`` experts)."""
    if ep is None:
        return require_number("imbalance", imbalance, 1)
    ep = require_int("ep", ep, 1)
    limit = math.inf if model is None else routing_limit(model)
    if limit >= ep:
        return require_number("imbalance", imbalance, 1, ep)
    try:
        return require_number("imbalance", imbalance, 1, limit)
    except ValueError:
        raise ValueError(f"imbalance must be a finite number in [1, {limit_text(limit)}] (a token reaches at most "
                         f"top_k={model.top_k} of num_experts={model.num_experts} experts: one of ep={ep} ranks "
                         f"receives at most num_experts / top_k times the mean), got {shown(imbalance)}") from None


def build_graph(model: ModelConfig, parallel: ParallelConfig, hardware: Hardware, *, imbalance: float = 1.0,
                stage: int = 0, chunk: int = 0) -> OpGraph:
    """Forward op graph of one micro-batch on virtual chunk ``chunk`` of pipeline stage ``stage``.

    Routed-expert tensors (tokens received by this rank's experts) scale with ``imbalance`` = max/mean device
    load (physically at most :func:`imbalance_limit`: ``min(ep, num_experts / top_k)``); dense parts do not depend
    on it.
    """
    check_compatible(model, parallel)
    check_hardware(hardware)
    imbalance = check_imbalance(imbalance, ep=parallel.ep, model=model)
    builder = _Builder(model, parallel, hardware, imbalance)
    layers = chunk_layers(model, parallel, stage=stage, chunk=chunk)
    x = builder.tensor(f"L{layers[0]}.x", builder.sp_tokens * model.hidden_size, model.dtype, None)
    for layer in layers:
        x_mid = builder.attention(layer, x)
        x_out = builder.moe(layer, x_mid) if model.is_moe_layer(layer) else builder.dense_mlp(layer, x_mid)
        if layer != layers[-1]:  # the next layer's block input is this layer's output
            spec = builder.tensors.pop(x_out)
            x = f"L{layer + 1}.x"
            builder.tensors[x] = TensorSpec(x, spec.numel, spec.dtype, spec.producer, spec.routed)
            last = builder.ops[-1]
            builder.ops[-1] = Op(last.name, last.kind, last.layer, last.resource, last.inputs,
                                 tuple(x if o == x_out else o for o in last.outputs), last.saves, last.flops,
                                 last.moved_bytes, last.forward_ns, last.backward_ns)
    return OpGraph(ops=tuple(builder.ops), tensors=builder.tensors, hardware=hardware,
                   pinned=frozenset(builder.pinned), imbalance=imbalance,
                   label=f"stage {stage} chunk {chunk} layers {layers[0]}-{layers[-1]}",
                   activation_dtype=model.dtype,
                   mean_routed_tokens=builder.sp_tokens * model.top_k if model.num_experts else 0)
