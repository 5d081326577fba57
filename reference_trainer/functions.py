"""The custom autograd functions of the reference model (:mod:`reference_trainer.model`): each keeps for backward
exactly the tensors the cost model lists for its op (RMSNorm, SwiGLU, the FP32 router, permute and unpermute, the
row permutation of dispatch and combine), and the autograd all-to-all with uneven splits."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _wide(t: torch.Tensor) -> torch.Tensor:
    """FP32 view of a half-precision tensor; fp32/fp64 tensors unchanged (fp64 keeps gradcheck exact)."""
    return t.float() if t.dtype in (torch.bfloat16, torch.float16) else t


# ---- custom autograd functions ---------------------------------------------------------------------------------
class RMSNormFunction(torch.autograd.Function):
    """``y = x * rsqrt(mean(x^2) + eps) * w``; saves only ``x`` (the weight is a parameter)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        xf = _wide(x)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        xf, gf = _wide(x), _wide(grad)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)
        xhat = xf * rstd
        gw = gf * _wide(weight)
        grad_x = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
        grad_w = (gf * xhat).reshape(-1, x.shape[-1]).sum(0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up`` on ``fc1_out = [gate, up]``; saves only ``fc1_out``."""

    @staticmethod
    def forward(ctx, fc1_out: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(fc1_out)
        gate, up = fc1_out.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    @torch.autograd.function.once_differentiable  # the out= writes below have no double backward
    def backward(ctx, grad: torch.Tensor):
        (fc1_out,) = ctx.saved_tensors
        gate, up = fc1_out.chunk(2, dim=-1)
        grad_fc1 = torch.empty_like(fc1_out)  # both halves written in place: four passes over memory, no concat
        grad_gate, grad_up = grad_fc1.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        torch.mul(grad, F.silu(gate), out=grad_up)
        return grad_fc1


class RouterFunction(torch.autograd.Function):
    """Sigmoid router with an aux-loss-free expert bias (selection only) and normalised top-k weights.

    Inputs: ``x`` ``(T, h)``, router weight ``(E, h)``, expert bias ``(E,)`` (a buffer), ``top_k``.
    Outputs: FP32 routing weights ``(T, K)`` and the int32 routing map ``(T, K)`` (expert ids, not differentiable).
    Saves the FP32 copy of ``x``, the FP32 scores ``(T, E)`` and the routing map (an output: the same tensor
    ``permute`` keeps).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, top_k: int):
        x32 = _wide(x)  # the FP32 copy (the same tensor for an fp32 model)
        w32 = _wide(weight)
        scores = torch.sigmoid(x32 @ w32.t())
        chosen = torch.topk(scores + _wide(bias), top_k, dim=-1, sorted=False).indices
        selected = scores.gather(-1, chosen)
        probs = selected / selected.sum(-1, keepdim=True)
        routing = chosen.to(torch.int32)
        ctx.mark_non_differentiable(routing)
        ctx.save_for_backward(x32, weight, scores, routing)
        ctx.x_dtype = x.dtype
        return probs, routing

    @staticmethod
    def backward(ctx, grad_probs: torch.Tensor, grad_routing):
        x32, weight, scores, routing = ctx.saved_tensors
        index = routing.long()
        selected = scores.gather(-1, index)
        total = selected.sum(-1, keepdim=True)
        grad_probs = _wide(grad_probs)
        # probs = s / sum(s): d/ds_j = (g_j - sum_i g_i p_i) / sum(s)
        grad_selected = (grad_probs - (grad_probs * selected).sum(-1, keepdim=True) / total) / total
        grad_scores = torch.zeros_like(scores).scatter_(-1, index, grad_selected)
        grad_logits = grad_scores * scores * (1 - scores)
        grad_x = (grad_logits @ _wide(weight)).to(ctx.x_dtype)
        grad_w = (grad_logits.t() @ x32).to(weight.dtype)
        return grad_x, grad_w, None, None


def _token_order(routing: torch.Tensor) -> torch.Tensor:
    """Flat ``(t*K + k)`` indices of the routed copies sorted by expert (stable: token order within an expert)."""
    return torch.sort(routing.reshape(-1), stable=True).indices


class PermuteFunction(torch.autograd.Function):
    """Gather the ``T*K`` routed copies of ``x`` ``(T, h)`` grouped by expert; saves only the routing map."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(routing)
        ctx.num_tokens = x.shape[0]
        order = _token_order(routing)
        return x.index_select(0, order // routing.shape[1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (routing,) = ctx.saved_tensors
        order = _token_order(routing)
        grad_x = grad.new_zeros(ctx.num_tokens, grad.shape[1]).index_add_(0, order // routing.shape[1], grad)
        return grad_x, None


class UnpermuteFunction(torch.autograd.Function):
    """``out[t] = sum_k probs[t, k] * combined[row of (t, k)]``; saves combined, probs and the routing map."""

    @staticmethod
    def forward(ctx, combined: torch.Tensor, probs: torch.Tensor, routing: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(combined, probs, routing)
        order = _token_order(routing)
        top_k = routing.shape[1]
        weights = probs.reshape(-1).index_select(0, order).unsqueeze(-1)
        out = torch.zeros(probs.shape[0], combined.shape[1], dtype=_wide(combined).dtype, device=combined.device)
        out.index_add_(0, order // top_k, _wide(combined) * weights)
        return out.to(combined.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        combined, probs, routing = ctx.saved_tensors
        order = _token_order(routing)
        top_k = routing.shape[1]
        weights = probs.reshape(-1).index_select(0, order).unsqueeze(-1)
        grad_rows = _wide(grad).index_select(0, order // top_k)
        grad_combined = (grad_rows * weights).to(combined.dtype)
        grad_weights = (grad_rows * _wide(combined)).sum(-1)
        # order is a permutation of every (t, k): each entry is written, no zero fill needed
        grad_probs = torch.empty_like(probs).reshape(-1).index_copy_(0, order, grad_weights).reshape(probs.shape)
        return grad_combined, grad_probs, None


class RowPermuteFunction(torch.autograd.Function):
    """``x[order]`` (rows); the permutation stays on ``ctx`` (no saved-tensor hook sees it), backward scatters back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        ctx.order = order
        return x.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return torch.empty_like(grad).index_copy_(0, ctx.order, grad), None  # a permutation writes every row


class AllToAllFunction(torch.autograd.Function):
    """All-to-all with uneven splits; its backward is the opposite all-to-all; it saves no tensor. Both directions
    are issued asynchronously (``async_op=True``): after issuing, ``overlap()`` (when given; the instrumentation
    passes ``bagualu2.exec.overlap_point``) lets a fused scheduling point run the other micro-batch's next stage
    while the exchange is in flight, then it is waited for (on CUDA the wait orders the current stream after
    NCCL's). Without it, or outside a fused point, it is a plain all-to-all.
    :data:`TIMELINE`, when a list, receives ``(direction, issued_s, wait_s, done_s)`` per exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
                overlap: Callable[[], None] | None) -> torch.Tensor:
        ctx.splits, ctx.group, ctx.overlap = (output_splits, input_splits), group, overlap
        return _exchange("forward", x, output_splits, input_splits, group, overlap)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        output_splits, input_splits = ctx.splits
        return _exchange("backward", grad, input_splits, output_splits, ctx.group, ctx.overlap), None, None, None, None


TIMELINE: list | None = None


def _exchange(direction: str, x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
              overlap: Callable[[], None] | None) -> torch.Tensor:
    out = x.new_empty(sum(output_splits), *x.shape[1:])
    issued = time.perf_counter()
    work = dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group, async_op=True)
    if overlap is not None:
        overlap()
    waiting = time.perf_counter()
    work.wait()
    if TIMELINE is not None:
        TIMELINE.append((direction, issued, waiting, time.perf_counter()))
    return out


def all_to_all_single(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group: dist.ProcessGroup,
                      overlap: Callable[[], None] | None = None) -> torch.Tensor:
    """Autograd all-to-all with uneven splits (:class:`AllToAllFunction`; ``overlap`` runs between issue and
    wait); the rows received come back in a new tensor."""
    return AllToAllFunction.apply(x, list(output_splits), list(input_splits), group, overlap)
