"""Bias-free fused attention kernels that expose their log-sum-exp, forward and backward.

The structured backend merges several bias-free parts exactly; for that it needs each part's
log-sum-exp in forward, and a backward that accepts the *merged* output and the *global* log-sum-exp.
PyTorch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``)
offers both. Its causal mask is aligned top-left (key s visible to query t when s <= t), which the
callers only use on square slices.
"""

from __future__ import annotations

import functools

import torch

from .reasons import empty_axis_reasons

__all__ = ["cpu_flash_reasons", "fused_available", "fused_backward", "fused_forward"]


def fused_available(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether a fused kernel with log-sum-exp in and out exists here; (ok, reason)."""
    if torch.compiler.is_compiling():  # dynamo traces through a cache (and warns): the plain function
        return _fused_available.__wrapped__(device, dtype)
    return _fused_available(device, dtype)


@functools.lru_cache(maxsize=None)
def _fused_available(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    # the answer depends on the kind of device only; cached per device (hashing one is cheaper than reading its type)
    if device.type != "cpu":
        return False, (
            f"no fused kernel on {device.type} that both returns its log-sum-exp and accepts a given one in "
            f"backward is wired in (the CPU flash kernel is)"
        )
    if not hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return False, f"this PyTorch ({torch.__version__}) has no CPU flash-attention backward op"
    if dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        return False, f"the CPU flash kernel does not take {dtype}"
    return True, "CPU flash-attention kernel with log-sum-exp"


def cpu_flash_reasons(call) -> list[str]:
    """Why the CPU flash kernel cannot run ``call`` (an AttentionCall): value head_dim, empty axes, device, dtype."""
    reasons = []
    d, dv = call.query.shape[-1], call.value.shape[-1]
    if dv != d:
        reasons.append(f"value head_dim {dv} differs from query head_dim {d}; the fused kernel needs them equal")
    reasons += empty_axis_reasons(call, "the CPU flash kernel")
    ok, why = fused_available(call.query.device, call.query.dtype)
    if not ok:
        reasons.append(why)
    return reasons


def _unit_last_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a contiguous copy when its last dimension is strided: the raw kernel reads each row of
    head_dim as contiguous whatever the stride (a transposed or sliced K gave errors of 1.9)."""
    return tensor if tensor.stride(-1) == 1 or tensor.shape[-1] <= 1 else tensor.contiguous()


def fused_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    attn_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bias-free attention on non-empty (B, H, L, D) slices; causal is top-left aligned.

    ``attn_mask``: None or an additive float mask in the dtype of ``query`` (0 / -inf), broadcastable to
    (B, H, Lq, Lk). A row whose every key is masked gets out 0 and lse 0 (not -inf): callers fix that.

    Returns:
        out (B, H, Lq, Dv) in the input dtype; lse (B, H, Lq) float32 (float64 for float64 inputs), the
        natural log-sum-exp of ``scale * q . k`` over the visible keys.
    """
    query, key, value = _unit_last_stride(query), _unit_last_stride(key), _unit_last_stride(value)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale
    )
    return out, lse


def fused_backward(
    grad_out: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    attn_mask: torch.Tensor | None = None,
    lse_grad: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of :func:`fused_forward` given any (out, lse): with the merged output and the global lse
    (minus the part's constant bias) it returns exactly this part's share of dq, dk, dv, because the
    kernel forms ``p = exp(scale * q . k - lse)`` and ``D = dO . out`` from what it is given. ``attn_mask``:
    the one given to :func:`fused_forward`.

    ``lse_grad``: None or the gradient (B, H, Lq) of the log-sum-exp. The kernel forms ``D_i = dO_i . out_i``
    itself; a gradient ``g`` of the lse must turn that into ``D_i - g_i``, so q, k, v get one zero column,
    out a column of ones and dO the column ``-g`` (scores and ``dO . v`` are unchanged); the extra column
    is cut from the results.
    """
    dtype = query.dtype
    d, dv = query.shape[-1], value.shape[-1]
    query, key, value = _unit_last_stride(query), _unit_last_stride(key), _unit_last_stride(value)
    grad_out, out = _unit_last_stride(grad_out.to(dtype)), _unit_last_stride(out.to(dtype))
    if lse_grad is not None:
        pad = torch.nn.functional.pad
        query, key, value = pad(query, (0, 1)), pad(key, (0, 1)), pad(value, (0, 1))
        out = torch.cat([out, torch.ones_like(out[..., :1])], dim=-1)
        grad_out = torch.cat([grad_out, -lse_grad.to(dtype)[..., None]], dim=-1)
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, lse, 0.0, is_causal, attn_mask=attn_mask, scale=scale,
    )
    if lse_grad is not None:
        gq, gk, gv = gq[..., :d], gk[..., :d], gv[..., :dv]
    return gq, gk, gv
