"""GLM-style MoE decoder whose op boundaries match the cost model's op kinds one to one (architecture only).

Layout: hidden states are ``(b, s, h)`` (batch first); the MoE part works on the ``T = b*s`` flattened tokens.
Per layer, in program order (cost-model op kind in brackets, see ``bagualu2.costmodel.build``):

    norm1 [norm] -> qkv [qkv] -> rope [rope] -> core_attn [core_attn] -> attn_out [attn_out] -> residual1
    -> norm2 [norm] -> dense: mlp_fc1 -> mlp_act -> mlp_fc2                                   -> residual2
                       MoE:   router -> permute -> dispatch -> expert_fc1/act/fc2 per expert
                              -> combine -> unpermute, plus shared_fc1 -> shared_act -> shared_fc2 -> residual2

Every op is its own small module (see :data:`OP_MAP`, module path pattern -> cost-model op label), so the exec
layer applies plans from outside (:func:`bagualu2.exec.instrument` with that op map; the trainer does it, see
:mod:`reference_trainer.instrumented`); this file imports nothing of ``bagualu2.exec``.

Small ``torch.autograd.Function`` classes exist only where they change what autograd saves, so that it keeps
exactly what the cost model says each op saves (stock autograd would save more, or other tensors):

* :class:`RMSNormFunction` keeps only its input (the rstd is recomputed in backward; stock: the rstd too);
* :class:`SwiGLUFunction` keeps only its input, the fc1 output (stock autograd: the halves and ``silu(gate)``);
* :class:`RouterFunction` keeps the FP32 copy of its input, the FP32 sigmoid scores and the int32 routing map
  (its own output, the tensor ``permute`` keeps: counted once);
* :class:`PermuteFunction` keeps the int32 routing map only (the token order is recomputed with a stable sort;
  stock ``index_select`` would keep the int64 order);
* :class:`UnpermuteFunction` keeps the combined expert outputs, the FP32 routing weights and the routing map;
* :class:`RowPermuteFunction` (EP regrouping) keeps its permutation on ``ctx``, out of the saved-tensor hooks.

RoPE needs none: stock autograd of the rotation keeps only the cos/sin buffers (not activations).

Core attention is ``scaled_dot_product_attention`` (causal, ``enable_gqa``): its flash path keeps q, k, v (at
``g`` heads), the output and the FP32 log-sum-exp. The output is laid out ``(b, s, a, d)`` in memory, so the
out-projection's input is a view of it (one copy, as the cost model counts). ``v`` is copied out of the fused QKV
output so that attention does not keep the whole QKV buffer alive.

Ops: the module at ``layers.{i}.<path>`` is the cost-model op ``L{i}.<label>`` of :data:`OP_MAP` (the layer is
the first integer of the path, as :func:`bagualu2.exec.instrument` names ops), so the instrument's hooks know
which op saves, and an op the plan re-runs is replayed from its inputs in backward (RECOMPUTE re-runs the
module's forward). Every op module is a function of its arguments and parameters (deterministic; the router's
expert bias is an argument, so a replay reads the bias the forward used). After each router the instrument's
gate callback reads :meth:`MoE.routing_counts` (the routed copies this rank's experts receive, the EP group, the
group's largest count) for the deferred planner; the model's forward reuses that one exchange.

Expert parallelism: without an ``ep_group`` (EP=1) ``dispatch``/``combine`` are identities (every expert local).
With ``ep_group`` (a ``torch.distributed`` process group of ``ep`` ranks; gloo on CPU, NCCL on GPU) rank ``i``
of the group holds the ``E/ep`` experts with global ids ``[i*E/ep, (i+1)*E/ep)``. ``permute`` sorts the routed
copies by global expert id, which groups them by destination rank, then expert, so the send splits are contiguous.
Right after the router every rank's per-expert counts are all-gathered (a plain collective on an int tensor), so
the gate hook knows what this rank receives and what the busiest rank of the group receives; ``dispatch`` then
sends the copies with :class:`~reference_trainer.functions.AllToAllFunction` (uneven splits; issued with
``async_op=True``; between issue and wait the layout's ``overlap_point``, which the instrumentation sets to
``bagualu2.exec.overlap_point``, lets a fused scheduling point run the other micro-batch's next stage) and
regroups what arrived (source rank, then expert) by local expert (:class:`RowPermuteFunction`, which keeps its
permutation on ``ctx``, not through saved-tensor hooks: it saves nothing the cost model counts). ``combine`` is
the inverse: regroup back to (source rank, expert) order and ``all_to_all_single`` the expert outputs home.
Neither saves a tensor for backward (their backward is the opposite all-to-all), as in the cost model.

Forced imbalance (spikes) and routing statistics are instrumentation, applied from outside
(:mod:`reference_trainer.routing`).
"""

from __future__ import annotations

import math
import weakref
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bagualu2.costmodel import ModelConfig

from .functions import (PermuteFunction, RMSNormFunction, RouterFunction, RowPermuteFunction, SwiGLUFunction,
                        UnpermuteFunction, all_to_all_single, rotate)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


# ---- modules: one per cost-model op (OP_MAP) ------------------------------------------------------------------
class RMSNorm(nn.Module):
    """[norm] saves its input only (:class:`RMSNormFunction`)."""

    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


class QKVProjection(nn.Linear):
    """[qkv] the fused projection of ``(b, s, h)``, split into q ``(b, s, a, d)``, k and v ``(b, s, g, d)``; saves
    its input. ``v`` gets its own storage: attention must not keep the whole QKV buffer alive."""

    def __init__(self, hidden: int, heads: int, groups: int, head_dim: int):
        super().__init__(hidden, (heads + 2 * groups) * head_dim, bias=False)
        self.heads, self.groups, self.head_dim = heads, groups, head_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = x.shape
        a, g, d = self.heads, self.groups, self.head_dim
        q, k, v = super().forward(x).split((a * d, g * d, g * d), dim=-1)
        return q.reshape(b, s, a, d), k.reshape(b, s, g, d), v.reshape(b, s, g, d).contiguous()


class RoPE(nn.Module):
    """[rope] rotary embedding (rotate-half form) of q ``(b, s, a, d)`` and k ``(b, s, g, d)``; ``cos``/``sin``
    ``(s, 1, d/2)`` are model buffers, the only tensors autograd keeps (not activations: nothing counted)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return rotate(q, cos, sin), rotate(k, cos, sin)


class CoreAttention(nn.Module):
    """[core_attn] causal ``scaled_dot_product_attention`` (GQA): the flash path keeps q, k, v (at ``g`` heads),
    the output and the FP32 log-sum-exp. Returns ``(b, s, a*d)``, a view of the ``(b, s, a, d)`` output."""

    def __init__(self, gqa: bool):
        super().__init__()
        self.gqa = gqa

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, s, a, d = q.shape
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=self.gqa)
        return o.transpose(1, 2).reshape(b, s, a * d)  # a view: the flash output is (b, s, a, d) in memory


class Residual(nn.Module):
    """[residual] ``x + h``; saves nothing."""

    def forward(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return torch.add(x, h)


class SwiGLU(nn.Module):
    """[*_act] ``silu(gate) * up`` of the fc1 output; saves its input only (:class:`SwiGLUFunction`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SwiGLUFunction.apply(x)


class Attention(nn.Module):
    """qkv -> rope -> core_attn -> attn_out (``out``: an ``nn.Linear``, saves its input)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        m = config
        self.heads, self.groups, self.head_dim = m.num_attention_heads, m.num_query_groups, m.head_dim
        self.qkv = QKVProjection(m.hidden_size, self.heads, self.groups, self.head_dim)
        self.rope = RoPE()
        self.core = CoreAttention(self.groups != self.heads)
        self.out = nn.Linear(self.heads * self.head_dim, m.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x)                 # [qkv] saves x (norm1 out)
        q, k = self.rope(q, k, cos, sin)      # [rope] saves nothing
        o = self.core(q, k, v)                # [core_attn] q, k, v, o, lse
        return self.out(o)                    # [attn_out] saves o


class MLP(nn.Module):
    """fc1 (to 2*width for SwiGLU) -> act -> fc2: the dense MLP (``mlp_*``), each expert (``expert_*``) and the
    shared one (``shared_*``)."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 2 * width, bias=False)
        self.act = SwiGLU()
        self.fc2 = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Router(nn.Module):
    """[router] :class:`RouterFunction` of tokens ``(T, h)``; the router weight and the expert bias are arguments
    (the :class:`MoE`'s parameter and buffer: a replay reads the bias its forward used)."""

    def __init__(self, top_k: int):
        super().__init__()
        self.top_k = top_k

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor):
        return RouterFunction.apply(x, weight, bias, self.top_k)


class Permute(nn.Module):
    """[permute] the routed copies grouped by expert (:class:`PermuteFunction`: keeps the routing map)."""

    def forward(self, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        return PermuteFunction.apply(x, routing)


class Unpermute(nn.Module):
    """[unpermute] the weighted sum of each token's expert outputs (:class:`UnpermuteFunction`)."""

    def forward(self, combined: torch.Tensor, probs: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        return UnpermuteFunction.apply(combined, probs, routing)


class ExpertLayout:
    """Where the experts of one MoE layer live: the EP group (None: all local) and the experts per rank."""

    def __init__(self, ep_group: dist.ProcessGroup | None, num_local_experts: int):
        self.ep_group = ep_group
        # called between issuing an exchange and waiting for it (None: nothing); the instrumentation sets it
        self.overlap_point: Callable[[], None] | None = None
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.num_local_experts = num_local_experts


class Dispatch(nn.Module):
    """[dispatch] send the routed copies (sorted by global expert) to their experts' ranks; saves nothing."""

    def __init__(self, layout: ExpertLayout):
        super().__init__()
        self.layout = layout

    def forward(self, x: torch.Tensor, counts: tuple[torch.Tensor, torch.Tensor]):
        """``counts`` is ``(send, recv)`` from :meth:`MoE.exchange_counts` (metadata, passed in a tuple: a replay
        holds it as it is, while tensor arguments are activations read back from where they are stored).

        Returns the copies this rank's experts receive, grouped by local expert, their counts per local expert,
        and the state :class:`Combine` needs (splits and the inverse regrouping)."""
        send, recv = counts
        group = self.layout.ep_group
        if group is None:
            return x, recv.sum(0), None  # EP=1: every expert is local
        ep, local = self.layout.ep, self.layout.num_local_experts
        input_splits, output_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        received = all_to_all_single(x, output_splits, input_splits, group, overlap=self.layout.overlap_point)
        # arrived grouped (source rank, expert): regroup by (expert, source rank)
        block = torch.repeat_interleave(torch.arange(ep * local, device=x.device), recv.reshape(-1).to(x.device))
        order = torch.sort((block % local) * ep + block // local, stable=True).indices
        state = (input_splits, output_splits, torch.argsort(order))
        return RowPermuteFunction.apply(received, order), recv.sum(0), state


class Combine(nn.Module):
    """[combine] the local experts' outputs back to their tokens' ranks (inverse of :class:`Dispatch`)."""

    def __init__(self, layout: ExpertLayout):
        super().__init__()
        self.layout = layout

    def forward(self, state, *outputs: torch.Tensor) -> torch.Tensor:
        x = torch.cat(outputs)
        if state is None:
            return x
        input_splits, output_splits, inverse = state
        x = RowPermuteFunction.apply(x, inverse)  # back to (source rank, expert) order
        return all_to_all_single(x, input_splits, output_splits, self.layout.ep_group,
                                 overlap=self.layout.overlap_point)


class MoE(nn.Module):
    """router (``gate``) -> permute -> dispatch -> experts -> combine -> unpermute, plus the shared expert."""

    def __init__(self, config: ModelConfig, layer: int = 0, ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        m = config
        self.top_k, self.num_experts = m.top_k, m.num_experts
        self.ep_group = ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if m.num_experts % self.ep:
            raise ValueError(f"num_experts={m.num_experts} must be divisible by the EP group size {self.ep}")
        self.num_local_experts = m.num_experts // self.ep
        self.first_expert = self.ep_rank * self.num_local_experts  # global id of local expert 0
        self.router = nn.Parameter(torch.empty(m.num_experts, m.hidden_size, dtype=torch.float32))
        nn.init.normal_(self.router, std=1.0 / math.sqrt(m.hidden_size))
        # aux-loss-free load balancing: added to the scores for expert selection only, updated outside autograd
        self.register_buffer("expert_bias", torch.zeros(m.num_experts, dtype=torch.float32))
        self.gate = Router(m.top_k)
        self.permute = Permute()
        layout = ExpertLayout(ep_group, self.num_local_experts)
        self.dispatch = Dispatch(layout)
        # every expert is initialised (the same random stream and weights on every EP rank as with EP=1); this
        # rank keeps its E/ep
        experts = [MLP(m.hidden_size, m.moe_ffn_hidden_size) for _ in range(m.num_experts)]
        self.experts = nn.ModuleList(experts[self.first_expert:self.first_expert + self.num_local_experts])
        self.combine = Combine(layout)
        self.unpermute = Unpermute()
        self.shared = (MLP(m.hidden_size, m.moe_ffn_hidden_size * m.num_shared_experts)
                       if m.num_shared_experts else None)
        self.layer = layer
        self._routed = None  # (weakref to a routing map, its routing_counts): one exchange per forward

    def exchange_counts(self, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """``(send, recv, most)``: this rank's copies per (destination rank, its local expert), the copies it
        receives per (source rank, local expert), and the most copies any rank of the group receives — one
        all-gather of every rank's counts (identity at EP=1), so every rank sees the whole routing."""
        send = counts.reshape(self.ep, self.num_local_experts).contiguous()
        if self.ep_group is None:
            return send, send, int(send.sum())
        gathered = [torch.empty_like(counts) for _ in range(self.ep)]
        dist.all_gather(gathered, counts.contiguous(), group=self.ep_group)
        table = torch.stack(gathered).reshape(self.ep, self.ep, self.num_local_experts)  # [source, dest, expert]
        recv = table[:, self.ep_rank].contiguous()
        return send, recv, int(table.sum(dim=(0, 2)).max())

    def routing_counts(self, routing: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(counts, send, recv, most)`` of a routing map of this layer's router: this rank's copies per global
        expert and :meth:`exchange_counts` of them. Computed once per routing map: a gate callback that reads it
        right after the router (the deferred planner's) and the forward share one all-gather."""
        found = self._routed
        if found is not None and found[0]() is routing:
            return found[1]
        counts = torch.bincount(routing.reshape(-1).long(), minlength=self.num_experts)
        result = (counts, *self.exchange_counts(counts))
        self._routed = (weakref.ref(routing), result)
        return result

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        probs, routing = self.gate(tokens, self.router, self.expert_bias)                 # [router]
        _, send, recv, _ = self.routing_counts(routing)
        self._routed = None
        permuted = self.permute(tokens, routing)                                          # [permute]
        received, counts, state = self.dispatch(permuted, (send, recv))                    # [dispatch]
        outputs = [expert(chunk) for expert, chunk in zip(self.experts, received.split(counts.tolist()))]
        combined = self.combine(state, *outputs)                                          # [combine]
        out = self.unpermute(combined, probs, routing)                                    # [unpermute]
        if self.shared is not None:
            out = out + self.shared(tokens)                                               # [shared_*]
        return out.reshape(shape)


class Layer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        self.index = index
        self.norm1 = RMSNorm(config.hidden_size)
        self.attention = Attention(config)
        self.residual1 = Residual()
        self.norm2 = RMSNorm(config.hidden_size)
        self.is_moe = config.is_moe_layer(index)
        self.mlp = MoE(config, index, ep_group) if self.is_moe else MLP(config.hidden_size, config.ffn_hidden_size)
        self.residual2 = Residual()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.attention(self.norm1(x), cos, sin)
        x_mid = self.residual1(x, h)      # [residual] saves nothing
        h = self.mlp(self.norm2(x_mid))
        return self.residual2(x_mid, h)


#: Module-path pattern (``fnmatch`` on the ``named_modules()`` paths of the model, or of a module holding its
#: layers as ``layers.<global index>``) -> cost-model op label: the op of ``layers.{i}.<path>`` is
#: ``L{i}.<label>``, exactly as ``bagualu2.costmodel.build_graph`` names it (the op map of
#: ``bagualu2.exec.instrument``; patterns for module kinds a model part lacks match nothing there).
OP_MAP: dict[str, str] = {
    "layers.*.norm1": "norm1",
    "layers.*.attention.qkv": "qkv",
    "layers.*.attention.rope": "rope",
    "layers.*.attention.core": "core_attn",
    "layers.*.attention.out": "attn_out",
    "layers.*.residual1": "residual1",
    "layers.*.norm2": "norm2",
    "layers.*.mlp.fc1": "mlp_fc1",
    "layers.*.mlp.act": "mlp_act",
    "layers.*.mlp.fc2": "mlp_fc2",
    "layers.*.mlp.gate": "router",
    "layers.*.mlp.permute": "permute",
    "layers.*.mlp.dispatch": "dispatch",
    "layers.*.mlp.experts.*.fc1": "expert_fc1",
    "layers.*.mlp.experts.*.act": "expert_act",
    "layers.*.mlp.experts.*.fc2": "expert_fc2",
    "layers.*.mlp.combine": "combine",
    "layers.*.mlp.unpermute": "unpermute",
    "layers.*.mlp.shared.fc1": "shared_fc1",
    "layers.*.mlp.shared.act": "shared_act",
    "layers.*.mlp.shared.fc2": "shared_fc2",
    "layers.*.residual2": "residual2",
}


class GLMMoEModel(nn.Module):
    """Embedding -> ``num_layers`` decoder layers -> final RMSNorm -> output layer. Activations ``(b, s, h)``.

    ``ep_group``: the expert-parallel process group of the MoE layers (None: EP=1, every expert local).
    """

    def __init__(self, config: ModelConfig, *, rope_base: float = 10000.0,
                 ep_group: dist.ProcessGroup | None = None):
        super().__init__()
        if config.activation != "swiglu" or config.normalization != "rmsnorm":
            raise ValueError("the reference model implements activation=swiglu and normalization=rmsnorm only")
        if config.hidden_dropout or config.attention_dropout or not config.flash_attention:
            raise ValueError("the reference model implements flash attention without dropout only")
        if config.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {config.head_dim}")
        self.config = config
        dtype = TORCH_DTYPES[config.dtype]
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Layer(config, i, ep_group) for i in range(config.num_layers))
        self.final_norm = RMSNorm(config.hidden_size)
        self.output = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                     bias=False)
        self.to(dtype)
        for layer in self.layers:  # the router stays FP32 whatever the model dtype
            if layer.is_moe:
                layer.mlp.router.data = layer.mlp.router.data.float()
        half = config.head_dim // 2
        inv_freq = rope_base ** (-torch.arange(half, dtype=torch.float64) / half)
        angles = torch.arange(config.seq_length, dtype=torch.float64)[:, None] * inv_freq[None, :]
        self.register_buffer("rope_cos", angles.cos()[:, None, :].to(dtype), persistent=False)
        self.register_buffer("rope_sin", angles.sin()[:, None, :].to(dtype), persistent=False)

    @property
    def ep_size(self) -> int:
        """Ranks of the expert-parallel group (1 without one)."""
        moe = self.moe_layers()
        return moe[0].ep if moe else 1

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.layers if layer.is_moe]

    def forward_layers(self, x: torch.Tensor, layers: range | None = None) -> torch.Tensor:
        """Run transformer layers (all, or the global indices in ``layers``) on hidden states ``(b, s, h)``."""
        s = x.shape[1]
        if s > self.rope_cos.shape[0]:
            raise ValueError(f"sequence length {s} exceeds the model's seq_length {self.rope_cos.shape[0]}")
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        for index in (range(len(self.layers)) if layers is None else layers):
            x = self.layers[index](x, cos, sin)
        return x

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits ``(b, s, V)`` of token ids ``(b, s)``."""
        x = self.forward_layers(self.embedding(tokens))
        x = self.final_norm(x)
        return x @ self.embedding.weight.t() if self.output is None else self.output(x)
