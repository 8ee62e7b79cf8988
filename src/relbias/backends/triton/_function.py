"""Forward and backward of the Triton kernels as one ``autograd.Function``."""

from __future__ import annotations

import torch

from .._shared.autograd import first_order
from ._backward import backward_dkdv, backward_dq
from ._bias_grad import bias_grad
from ._forward import forward
from ._plan import Plan

__all__ = ["triton_apply"]


class _TritonAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, values, padding, plan):
        query, key, value = _dense(query), _dense(key), _dense(value)
        w = values.detach().float().contiguous()
        out, lse = forward(query, key, value, w, padding, plan)
        ctx.plan = plan
        ctx.values_dtype = values.dtype
        ctx.save_for_backward(query, key, value, w, padding, out, lse)
        ctx.set_materialize_grads(False)  # an unused lse gets no gradient
        return out, lse

    @staticmethod
    @first_order("triton")
    def backward(ctx, grad_out, grad_lse):
        query, key, value, w, padding, out, lse = ctx.saved_tensors
        plan = ctx.plan
        empty = lse == float("-inf")
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype).contiguous()
        di = (grad_out.float() * out.float()).sum(-1)
        if grad_lse is not None:
            di = di - grad_lse.float().masked_fill(empty, 0.0)
        lse = lse.masked_fill(empty, float("inf"))  # P = exp(s - inf) = 0 for a query that saw no key
        args = (query, key, value, grad_out, lse, di, w, padding, plan)
        dq = backward_dq(*args) if ctx.needs_input_grad[0] else None
        dk, dv = backward_dkdv(*args) if ctx.needs_input_grad[1] or ctx.needs_input_grad[2] else (None, None)
        dvalues = bias_grad(*args).to(ctx.values_dtype) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, dvalues, None, None


def triton_apply(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, values: torch.Tensor,
                 padding: torch.Tensor | None, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of the Triton kernels, differentiable in query, key, value and the per-offset ``values``
    (Hb, M); ``padding`` None or uint8 (Bm, Hm, Lk), nonzero where a key is kept. The forward alone (no autograd
    bookkeeping) where nothing needs a gradient."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, values)):
        return _TritonAttention.apply(query, key, value, values, padding, plan)
    return forward(_dense(query), _dense(key), _dense(value), values.float().contiguous(), padding, plan)


def _dense(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` where the kernels can read it and its gradient can share its strides (unit stride along the last
    dimension, dense: e.g. a (B, L, H, D) projection viewed as (B, H, L, D)); else a contiguous copy."""
    if tensor.stride(-1) == 1:
        expected = 1  # a dense layout: each stride, smallest first, is the product of the sizes below it
        for size, stride in sorted(zip(tensor.shape, tensor.stride()), key=lambda pair: pair[1]):
            if size != 1 and stride != expected:
                return tensor.contiguous()
            expected *= size
        return tensor
    return tensor.contiguous()
