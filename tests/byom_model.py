"""A MoE decoder written the ordinary way, with stock modules only (the bring-your-own-model tests and docs/byom.md).

Nothing in it knows bagualu2: ``nn.Linear`` projections, ``nn.RMSNorm``, rotary embedding as plain tensor code,
``F.scaled_dot_product_attention`` (causal, grouped-query), a softmax or sigmoid top-k router and a Python loop
over an ``nn.ModuleList`` of SwiGLU experts (skipping experts that receive no token), plus an optional shared
expert. Layer 0 is a dense SwiGLU MLP, the others MoE. ``forward`` maps hidden states ``(b, s, h)`` to hidden
states (the decoder stack and its final norm); :class:`StockLM` adds an embedding and an output layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class StockConfig:
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 96
    expert_ffn: int = 48
    num_experts: int = 4
    top_k: int = 2
    num_layers: int = 2
    shared_expert: bool = True
    router: str = "softmax"  # or "sigmoid"
    seq: int = 16
    vocab: int = 128


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: StockConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.heads, c.kv_heads, c.hidden // c.heads
        self.wq = nn.Linear(c.hidden, c.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(c.hidden, c.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(c.hidden, c.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(c.heads * self.head_dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class MoE(nn.Module):
    def __init__(self, c: StockConfig):
        super().__init__()
        self.top_k, self.kind = c.top_k, c.router
        self.gate = nn.Linear(c.hidden, c.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(c.hidden, c.expert_ffn) for _ in range(c.num_experts))
        self.shared = SwiGLU(c.hidden, c.expert_ffn) if c.shared_expert else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        logits = self.gate(tokens)
        if self.kind == "softmax":
            weights, chosen = torch.topk(logits.softmax(-1, dtype=torch.float32), self.top_k, dim=-1)
        else:
            weights, chosen = torch.topk(torch.sigmoid(logits.float()), self.top_k, dim=-1)
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == index)
            if rows.numel() == 0:
                continue
            y = expert(tokens[rows]) * weights[rows, slot, None].to(tokens.dtype)
            out = out.index_add(0, rows, y)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, c: StockConfig, index: int):
        super().__init__()
        self.attn_norm = nn.RMSNorm(c.hidden, eps=1e-6)
        self.attn = Attention(c)
        self.ffn_norm = nn.RMSNorm(c.hidden, eps=1e-6)
        if index == 0:
            self.mlp = SwiGLU(c.hidden, c.ffn)
        else:
            self.moe = MoE(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), cos, sin)
        ffn = self.mlp if hasattr(self, "mlp") else self.moe
        return h + ffn(self.ffn_norm(h))


class StockMoEDecoder(nn.Module):
    def __init__(self, c: StockConfig):
        super().__init__()
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_layers))
        self.norm = nn.RMSNorm(c.hidden, eps=1e-6)
        half = c.hidden // c.heads // 2
        angles = torch.arange(c.seq, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(half) / half)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[: x.shape[1]].to(x.dtype), self.sin[: x.shape[1]].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)


class StockLM(nn.Module):
    """Embedding -> :class:`StockMoEDecoder` -> output layer (logits)."""

    def __init__(self, c: StockConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab, c.hidden)
        self.decoder = StockMoEDecoder(c)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.decoder(self.embed(tokens)))


#: The op map of :class:`StockMoEDecoder`: module-path patterns (fnmatch) -> op labels (cost-model kinds).
OP_MAP = {
    "layers.*.attn_norm": "norm1",
    "layers.*.attn": "core_attn",            # rotary embedding + scaled_dot_product_attention (its own savings)
    "layers.*.attn.w[qkv]": "qkv",
    "layers.*.attn.wo": "attn_out",
    "layers.*.ffn_norm": "norm2",
    "layers.*.mlp": "mlp_act",               # silu(gate) * up of the dense MLP
    "layers.*.mlp.gate_proj": "mlp_fc1",
    "layers.*.mlp.up_proj": "mlp_fc1",
    "layers.*.mlp.down_proj": "mlp_fc2",
    "layers.*.moe": "moe",                   # any name: top-k, gathers, weighting, index_add
    "layers.*.moe.gate": "router",
    "layers.*.moe.experts.*[0-9]": "expert_act",
    "layers.*.moe.experts.*.gate_proj": "expert_fc1",
    "layers.*.moe.experts.*.up_proj": "expert_fc1",
    "layers.*.moe.experts.*.down_proj": "expert_fc2",
    "layers.*.moe.shared": "shared_act",
    "layers.*.moe.shared.gate_proj": "shared_fc1",
    "layers.*.moe.shared.up_proj": "shared_fc1",
    "layers.*.moe.shared.down_proj": "shared_fc2",
    "norm": "final_norm:norm",
}


def op_map(config: StockConfig) -> dict[str, str]:
    """:data:`OP_MAP` without the patterns of parts ``config`` does not have (a pattern must match a module)."""
    return {k: v for k, v in OP_MAP.items() if config.shared_expert or ".shared" not in k}


def make(config: StockConfig | None = None, *, dtype: torch.dtype = torch.float32, seed: int = 0,
         batch: int = 2) -> tuple[StockMoEDecoder, torch.Tensor]:
    """A seeded decoder in ``dtype`` and a sample input ``(batch, seq, hidden)`` that requires grad."""
    config = config or StockConfig()
    torch.manual_seed(seed)
    model = StockMoEDecoder(config).to(dtype)
    x = torch.randn(batch, config.seq, config.hidden, dtype=dtype, requires_grad=True)
    return model, x
