"""Bias-free fused attention with a differentiable log-sum-exp, for the ring's far blocks.

A far block (every offset beyond a far-constant bias's distance) is plain attention plus a constant, so it can
run PyTorch's fused CPU flash kernel (the structured backend's far parts, :mod:`relbias.backends.structured`)
instead of a tiled bias-aware backend. The kernel's backward accepts any (out, lse); a gradient ``g`` of the
lse enters it as ``D_i - g_i`` in place of ``D_i = dO_i . O_i`` (docs/conventions.md, "Log-sum-exp").
Where the kernel is not available (another device, different query/value head dims) the block runs
``relbias.attention(bias=None)``.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..backends._cpu_flash import fused_available
from ..backends.structured import _part_backward, _run_part
from ..functional import attention

__all__ = ["bias_free_attention"]

_NEG_INF = float("-inf")


class _FusedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, scale, keep):
        out, lse = _run_part(query, key, value, "full", scale, keep)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale, ctx.keep = scale, keep
        ctx.set_materialize_grads(False)
        lse = lse.float() if query.dtype == torch.float16 else lse
        return out.to(query.dtype), lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, grad_lse):
        query, key, value, out, lse = ctx.saved_tensors
        empty = lse == _NEG_INF
        compute = lse.dtype
        do = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype)
        lse_grad = None if grad_lse is None else grad_lse.to(compute).masked_fill(empty, 0.0)
        dq = torch.zeros(query.shape, dtype=compute, device=query.device)
        dk = torch.zeros(key.shape, dtype=compute, device=key.device)
        dv = torch.zeros(value.shape, dtype=compute, device=value.device)
        kernel_lse = lse.masked_fill(empty, float("inf"))  # rows with no visible key: p = exp(s - inf) = 0
        _part_backward(do, query, key, value, out, kernel_lse, "full", ctx.scale, dq, dk, dv, ctx.keep, lse_grad)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), None, None


def bias_free_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scale: float,
    query_start: int,
    key_start: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention without bias or causal mask, every (unpadded) key visible to every query.

    Args:
        query: (B, H, Lq, D); key: (B, H, Lk, D); value: (B, H, Lk, Dv); same dtype and device.
        mask: None or a bool key padding mask (B or 1, H or 1, 1, Lk), True = may attend.
        scale: multiplier of ``q . k``.
        query_start, key_start: absolute positions (tokens), for the fallback's validation only.

    Returns:
        out (B, H, Lq, Dv) in the query's dtype (0 for a row with no visible key), lse (B, H, Lq) float32 (float64
        for float64 inputs; ``-inf`` for such a row); both differentiable.
    """
    ok, _ = fused_available(query.device, query.dtype)
    if ok and value.shape[-1] == query.shape[-1] and query.shape[2] and key.shape[2]:
        keep = None if mask is None else mask[:, :, 0]
        if keep is not None and bool(keep.all()):
            keep = None
        return _FusedFunction.apply(query, key, value, scale, keep)
    return attention(
        query, key, value, mask=mask, scale=scale, convention="additive", query_start=query_start,
        key_start=key_start, return_lse=True,
    )
