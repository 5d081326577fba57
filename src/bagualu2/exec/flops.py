"""FLOP counting that matches the cost model's convention (``PlanCost.recompute_flops``).

``torch.utils.flop_counter.FlopCounterMode`` counts matrix products and attention only (elementwise ops are
memory-bound; the cost model costs them by their bytes), which is what ``recompute_flops`` sums. Two conventions
are set here: the CPU flash-attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu``), which torch's
counter does not know, gets a formula; and causal attention counts half of the full ``QK^T`` and ``PV`` products,
like the cost model (flash kernels skip the masked blocks), on CPU and for the CUDA kernels.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode


def _attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, is_causal: bool = False,
                     **kwargs) -> int:
    """``QK^T`` + ``PV`` of ``(b, h, s_q, d)`` queries over ``s_k`` keys; half when causal."""
    if len(args) >= 2 and isinstance(args[1], bool):  # (dropout_p, is_causal, ...) given positionally
        is_causal = args[1]
    b, h, s_q, d = query_shape
    s_k, d_v = key_shape[-2], value_shape[-1]
    flops = 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v
    return flops // 2 if is_causal else flops


def _attention_ops() -> list:
    aten = torch.ops.aten
    names = ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention")
    return [getattr(aten, name) for name in names if hasattr(aten, name)]


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` with the cost model's attention convention (see the module docstring)."""
    return FlopCounterMode(display=False, custom_mapping={op: _attention_flops for op in _attention_ops()})
