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

from ...backends import toeplitz
from ...backends.toeplitz import _native as _toeplitz_native
from ...backends._shared.autograd import first_order
from ...backends._shared.cpu_flash import fused_available, fused_backward
from ...backends._shared.masks import additive_mask
from ...backends.structured._parts import empty_rows, part_backward, run_part
from ...functional import attention
from ..merge import DOUBLE_BACKWARD_HINT

__all__ = ["bias_free_attention", "far_block_backward", "fused_runs"]

_NEG_INF = float("-inf")


def fused_runs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the fused CPU kernel runs a block of these (non-empty) tensors: CPU, a dtype it takes, Dv == D."""
    ok, _ = fused_available(query.device, query.dtype)
    return ok and value.shape[-1] == query.shape[-1] and query.shape[2] > 0 and key.shape[2] > 0


def _keep(mask: torch.Tensor | None) -> torch.Tensor | None:
    """(Bm, Hm, Lk) bool of a (Bm, Hm, 1, Lk) key padding mask; None when there is none or nothing is padded."""
    keep = None if mask is None else mask[:, :, 0]
    return None if keep is None or bool(keep.all()) else keep


class _FusedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, scale, keep):
        out, lse = run_part(query, key, value, "full", scale, keep)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scale, ctx.keep = scale, keep
        ctx.set_materialize_grads(False)
        lse = lse.float() if query.dtype == torch.float16 else lse
        return out.to(query.dtype), lse

    @staticmethod
    @first_order("fused", subject="context-parallel attention's bias-free block", instead=DOUBLE_BACKWARD_HINT)
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
        part_backward(do, query, key, value, out, kernel_lse, "full", ctx.scale, dq, dk, dv, ctx.keep, lse_grad)
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
    if fused_runs(query, key, value):
        return _FusedFunction.apply(query, key, value, scale, _keep(mask))
    return attention(
        query, key, value, mask=mask, scale=scale, convention="additive", query_start=query_start,
        key_start=key_start, return_lse=True,
    )


def far_block_backward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    const: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A far block's share of the gradients, from the merged result, without recomputing its forward.

    The block's scores are ``scale · q . k + c_h``; the kernel forms ``p = exp(scale · q . k - (lse - c_h))``, the
    global probabilities, and ``D_i = dO_i . O_i`` from the merged output, so it returns exactly this block's
    share of dq, dk, dv (FlashAttention's backward, Dao et al. 2022, Alg. 2). The gradient of the constant is
    ``sum_ij dS_ij``: a zero column appended to q and a column of ones to k leave the scores unchanged and make
    the last column of dq ``scale · sum_j dS_ij``. Call only where :func:`fused_runs` holds.

    Args:
        query: (B, H, lq, D); key, value: (B, H, lk, D); mask: None or a bool key padding mask (B|1, H|1, 1, lk).
        scale: multiplier of ``q . k``.
        grad_out: (B, H, lq, D) gradient of the merged output; out: (B, H, lq, D) the merged output;
            lse: (B, H, lq) the merged log-sum-exp (float32/float64, ``-inf`` for a row with no visible key).
        const: (Hb, 1) the block's constant (Hb 1 or H), in the dtype of ``lse``.

    Returns:
        dq, dk, dv in the dtype of ``lse``, and d const (Hb, 1).
    """
    compute = lse.dtype
    q, k, v = query, key, value
    if q.dtype == torch.float16:  # as the structured backend: float16 blocks run in float64
        q, k, v = q.double(), k.double(), v.double()
    keep = _keep(mask)
    if keep is None and _toeplitz_native.loaded_native(q) is not None:
        return _native_far_backward(q, k, v, scale, grad_out, out, lse, const)
    d = q.shape[-1]
    pad = torch.nn.functional.pad
    q1, v1 = pad(q, (0, 1)), pad(v, (0, 1))
    k1 = torch.cat([k, torch.ones_like(k[..., :1])], dim=-1)
    kernel_lse = (lse - const).to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    empty = lse == _NEG_INF
    if keep is not None:
        empty = empty | empty_rows(keep, "full", q.shape[2])
    kernel_lse = kernel_lse.masked_fill(empty, float("inf"))  # rows seeing no key here: p = 0
    do1 = pad(grad_out.to(q.dtype), (0, 1))
    out1 = pad(out.to(q.dtype), (0, 1))
    gq, gk, gv = fused_backward(do1, q1, k1, v1, out1, kernel_lse, is_causal=False, scale=scale,
                                attn_mask=additive_mask(keep, q.dtype))
    dconst = gq[..., d].to(compute).sum(dim=(0, 2)) / scale  # (H,)
    dconst = dconst.sum(0, keepdim=True) if const.shape[0] == 1 else dconst
    return gq[..., :d].to(compute), gk[..., :d].to(compute), gv[..., :d].to(compute), dconst[:, None]


def _native_far_backward(q, k, v, scale, grad_out, out, lse, const):
    """:func:`far_block_backward` without a padding mask, by relbias' native toeplitz backward with the constant as
    its bias (every offset: ``const``): it reads the block's slices of q, k, v, dO and out in place, where the CPU
    flash kernel's backward needs copies of them padded by one column, and returns the bias gradient, whose sum over
    offsets is d const."""
    lq, lk = q.shape[2], k.shape[2]
    w = const.to(q.dtype).expand(const.shape[0], lq + lk - 1).contiguous()
    plan = {"scale": scale, "delta": 0, "is_causal": False, "tile": toeplitz.TILE}
    dq, dk, dv, grad_w = _toeplitz_native.native_backward(grad_out, q, k, v, out, lse, None, w, plan)
    compute = lse.dtype
    return dq.to(compute), dk.to(compute), dv.to(compute), grad_w.to(compute).sum(-1, keepdim=True)
