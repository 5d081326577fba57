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


def _attention_formula(causal_index: int):
    """A counter formula for a kernel whose ``is_causal`` is extra argument ``causal_index`` after q, k, v."""

    def flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        """``QK^T`` + ``PV`` of ``(b, h, s_q, d)`` queries over ``s_k`` keys; half when causal."""
        is_causal = kwargs.get("is_causal", args[causal_index] if len(args) > causal_index else False)
        b, h, s_q, d = query_shape
        s_k, d_v = key_shape[-2], value_shape[-1]
        total = 2 * b * h * s_q * s_k * d + 2 * b * h * s_q * s_k * d_v
        return total // 2 if is_causal is True else total

    return flops


# is_causal's position among the arguments after (q, k, v), per kernel (aten schemas)
_ATTENTION_KERNELS = {"_scaled_dot_product_flash_attention_for_cpu": 1,  # dropout_p, is_causal
                      "_scaled_dot_product_flash_attention": 1,          # dropout_p, is_causal
                      "_scaled_dot_product_efficient_attention": 3,      # attn_bias, compute_lse, dropout_p, ...
                      "_scaled_dot_product_cudnn_attention": 3}          # attn_bias, compute_lse, dropout_p, ...


def attention_formulas() -> dict:
    """``{aten attention op: formula on shapes}`` in the cost model's convention (``custom_mapping`` of
    ``FlopCounterMode``; wrap with ``torch.utils.flop_counter.shape_wrapper`` to call it on tensors)."""
    aten = torch.ops.aten
    return {getattr(aten, name): _attention_formula(index) for name, index in _ATTENTION_KERNELS.items()
            if hasattr(aten, name)}


def flop_counter() -> FlopCounterMode:
    """A silent ``FlopCounterMode`` with the cost model's attention convention (see the module docstring)."""
    return FlopCounterMode(display=False, custom_mapping=attention_formulas())
