"""The toeplitz backend: every offset-only bias at the speed of bias-free fused attention (CPU).

An offset-only bias ``PE(i, j) = f_h(i - j)`` is, per head, a Toeplitz matrix: constant along each
diagonal. Its native form (:meth:`relbias.RelativeBias.native`) holds the Lq + Lk - 1 distinct values.
Reversed, ``w[m] = values[M - 1 - m]``, and with a block of query rows taken in reverse order (row
``a`` is query ``i1 - 1 - a``), the block's bias is ``w[c + a + s]`` for key ``s``: a view of ``w`` with
strides (1, 1), so no (H, Lq, Lk) tensor is ever formed. PyTorch's CPU flash-attention kernel takes that
view as its additive ``attn_mask``, one call per block of :data:`BLOCK_Q` query rows against the keys the
block can see (causal: a prefix; the future keys of its diagonal read ``-inf`` from ``w``).

Backward: the kernel's backward, given the same view, returns dq, dk, dv. The bias gradient
``dPE(t) = sum_{i - j = t} dS_ij`` with ``dS = P * (dP - D)`` (FlashAttention, Dao et al. 2022, Alg. 2)
is one more pass, run only when the bias values require grad: per (query block, key tile) two matrix
products recompute the scores and ``dP`` (``-lse`` and ``-D`` folded in as one more column), and the
tile's diagonals are summed through a skewed strided copy, in a fixed order (deterministic). Saved for
backward: O(B·H·L·D). Both run with denormals flushed to zero (:func:`flush_denormals`): ALiBi's far keys
otherwise land in float32 denormals, which made the forward 1.4x and the backward 4x slower.

Requirements (the dispatcher says which fails): an offset-only bias module, no mask, no dropout, CPU, equal
query and value head_dim. float16 and bfloat16 inputs run in float32 (a half-precision mask would round the
bias).
"""

from __future__ import annotations

import torch

from ..biases.base import RelativeBias
from ..call import AttentionCall
from ._autograd import first_order
from ._cpu_flash import cpu_flash_reasons, fused_backward, fused_forward
from ._denormals import flush_denormals
from ._reasons import dropout_reasons, non_finite_reasons, small_block_reasons, tensor_bias_reasons
from .base import Backend

__all__ = ["BLOCK_Q", "TILE", "ToeplitzBackend", "toeplitz_attention"]

#: Query rows per fused kernel call (tokens); causal calls waste about BLOCK_Q / 2 keys per row on the diagonal.
BLOCK_Q = 512
#: Rows and keys per tile of the bias-gradient pass (tokens).
TILE = 256

_NEG_INF = float("-inf")


def _block_mask(w: torch.Tensor, query_len: int, i0: int, i1: int, k0: int, k1: int) -> torch.Tensor:
    """(1, Hb, i1 - i0, k1 - k0) view of the reversed bias ``w`` (Hb, Lq + Lk - 1) for query rows i1-1 down to
    i0 (row a is query i1 - 1 - a) and keys k0:k1: entry (a, s) is ``w[Lq - i1 + a + k0 + s]``."""
    return w.as_strided(
        (1, w.shape[0], i1 - i0, k1 - k0), (0, w.stride(0), 1, 1), w.storage_offset() + query_len - i1 + k0
    )


def _key_end(i1: int, delta: int, key_len: int, is_causal: bool) -> int:
    """Keys 0:end that query rows below ``i1`` may see (causal: key s visible to query t when s <= t + delta)."""
    return min(key_len, max(0, i1 + delta)) if is_causal else key_len


class _ToeplitzFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, values, plan):
        with flush_denormals():
            return _ToeplitzFunction._forward(ctx, query, key, value, values, plan)

    @staticmethod
    def _forward(ctx, query, key, value, values, plan):
        scale, delta, is_causal, block_q = plan["scale"], plan["delta"], plan["is_causal"], plan["block_q"]
        w = values.detach().to(query.dtype) * plan["bias_scale"]
        if is_causal:  # offsets i - j < 0 (column n has offset min_offset + n) are future keys
            future = torch.arange(w.shape[1], device=w.device) < -plan["min_offset"]
            w = w.masked_fill(future, _NEG_INF)
        w = w.flip(-1).contiguous()
        b, h, lq, _ = query.shape
        lk = key.shape[2]
        out = query.new_zeros(b, h, lq, value.shape[-1])
        lse = torch.full((b, h, lq), _NEG_INF, dtype=torch.float64 if query.dtype == torch.float64 else torch.float32,
                         device=query.device)
        for i0 in range(0, lq, block_q):
            i1 = min(lq, i0 + block_q)
            end = _key_end(i1, delta, lk, is_causal)
            if end == 0:
                continue
            o, l = fused_forward(
                query[:, :, i0:i1].flip(2), key[:, :, :end], value[:, :, :end], is_causal=False, scale=scale,
                attn_mask=_block_mask(w, lq, i0, i1, 0, end),
            )
            out[:, :, i0:i1] = o.flip(2)
            lse[:, :, i0:i1] = l.flip(2)
        blind = min(lq, max(0, -delta)) if is_causal else 0  # queries before every key: the kernel gives lse 0
        if blind:
            out[:, :, :blind] = 0.0
            lse[:, :, :blind] = _NEG_INF
        ctx.save_for_backward(query, key, value, values, out, lse, w)
        ctx.plan = plan
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @first_order("toeplitz")
    def backward(ctx, grad_out, grad_lse):
        with flush_denormals():
            return _ToeplitzFunction._backward(ctx, grad_out, grad_lse)

    @staticmethod
    def _backward(ctx, grad_out, grad_lse):
        query, key, value, values, out, lse, w = ctx.saved_tensors
        plan = ctx.plan
        scale, delta, is_causal, block_q = plan["scale"], plan["delta"], plan["is_causal"], plan["block_q"]
        b, h, lq, _ = query.shape
        lk = key.shape[2]
        do = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype)
        empty = lse == _NEG_INF
        kernel_lse = lse.masked_fill(empty, float("inf"))  # rows with no key: p = exp(s - inf) = 0
        if grad_lse is not None:
            grad_lse = grad_lse.to(lse.dtype).masked_fill(empty, 0.0)
        dq, dk, dv = torch.zeros_like(query), torch.zeros_like(key), torch.zeros_like(value)
        for i0 in range(0, lq, block_q):
            i1 = min(lq, i0 + block_q)
            end = _key_end(i1, delta, lk, is_causal)
            if end == 0:
                continue
            rows = slice(i0, i1)
            gq, gk, gv = fused_backward(
                do[:, :, rows].flip(2), query[:, :, rows].flip(2), key[:, :, :end], value[:, :, :end],
                out[:, :, rows].flip(2), kernel_lse[:, :, rows].flip(2), is_causal=False, scale=scale,
                attn_mask=_block_mask(w, lq, i0, i1, 0, end),
                lse_grad=None if grad_lse is None else grad_lse[:, :, rows].flip(2),
            )
            dq[:, :, rows] = gq.flip(2)
            dk[:, :, :end] += gk
            dv[:, :, :end] += gv
        grad_values = None
        if ctx.needs_input_grad[3]:
            row_dot = (do * out).sum(dim=-1).to(lse.dtype)  # D_i = dO_i . O_i; an lse gradient enters as D_i - g_i
            if grad_lse is not None:
                row_dot = row_dot - grad_lse
            grad_w = _bias_gradient(query, key, value, do, kernel_lse, row_dot, w, plan)
            grad_values = (grad_w.flip(-1) * plan["bias_scale"]).to(values.dtype)
        return dq, dk, dv, grad_values, None


def _bias_gradient(query, key, value, do, kernel_lse, row_dot, w, plan) -> torch.Tensor:
    """Gradient (Hb, M) of the loss with respect to the reversed, scaled bias ``w``: per tile, ``dS`` summed along
    its diagonals (entry (a, s) of a tile is ``w[c + a + s]``), tiles in a fixed order."""
    scale, delta, is_causal, tile = plan["scale"], plan["delta"], plan["is_causal"], plan["tile"]
    b, h, lq, _ = query.shape
    lk = key.shape[2]
    hb = w.shape[0]
    dtype = query.dtype
    grad_w = torch.zeros(w.shape, dtype=dtype, device=w.device)
    skews: dict[tuple[int, int], torch.Tensor] = {}  # zeroed once: each tile writes the same entries
    # scores - lse = [scale q, -lse] . [k, 1];  dP - D = [dO, -D] . [v, 1]  (query rows reversed per tile)
    ones = torch.ones(b, h, lk, 1, dtype=dtype, device=w.device)
    key_aug, value_aug = torch.cat([key, ones], -1), torch.cat([value, ones], -1)
    del ones
    for i0 in range(0, lq, tile):
        i1 = min(lq, i0 + tile)
        end = _key_end(i1, delta, lk, is_causal)
        rows = slice(i0, i1)
        q_aug = torch.cat([query[:, :, rows].flip(2) * scale, -kernel_lse[:, :, rows].flip(2).to(dtype)[..., None]], -1)
        do_aug = torch.cat([do[:, :, rows].flip(2), -row_dot[:, :, rows].flip(2).to(dtype)[..., None]], -1)
        for k0 in range(0, end, tile):
            k1 = min(end, k0 + tile)
            scores = torch.matmul(q_aug, key_aug[:, :, k0:k1].transpose(-1, -2))
            scores += _block_mask(w, lq, i0, i1, k0, k1)
            ds = scores.exp_().mul_(torch.matmul(do_aug, value_aug[:, :, k0:k1].transpose(-1, -2)))
            bq, bk = i1 - i0, k1 - k0
            width = bq + bk - 1
            skew = skews.get((bq, bk))
            if skew is None:
                skew = skews[(bq, bk)] = torch.zeros(b, h, bq, width, dtype=dtype, device=w.device)
            # entry (a, s) goes to column a + s of row a: row stride width + 1 in a (b, h, bq, width) buffer
            skew.as_strided((b, h, bq, bk), (h * bq * width, bq * width, width + 1, 1)).copy_(ds)
            start = lq - i1 + k0
            sums = skew.sum(dim=(0, 2))  # (H, width)
            grad_w[:, start:start + width] += sums if hb == h else sums.sum(0, keepdim=True)
    return grad_w


class ToeplitzBackend(Backend):
    """Offset-only biases: the bias as a strided Toeplitz view, the additive mask of fused CPU flash attention."""

    name = "toeplitz"
    summary = (
        "offset-only bias: a strided view of its per-offset values as the additive mask of PyTorch's fused CPU "
        "flash kernel, per query block; bias gradient by one extra tiled pass; memory O(N·D)"
    )

    def unsupported_reasons(self, call: AttentionCall) -> list[str]:
        reasons = tensor_bias_reasons(call) + dropout_reasons(call, "the fused kernel")
        bias = call.bias
        if not isinstance(bias, RelativeBias):
            if bias is None:
                reasons.append("there is no bias; bias-free attention needs no bias view (use blockwise or SDPA)")
        elif not bias.offset_only:
            reasons.append(f"{type(bias).__name__} reads absolute positions, so its bias is not a Toeplitz matrix")
        if torch.compiler.is_compiling():
            reasons.append("torch.compile is tracing; toeplitz runs eagerly only (reference, blockwise and decode compile)")
        if call.mask is not None:
            reasons.append("a mask is given; the fused kernel's one additive mask is the bias view (masks go to "
                           "structured or blockwise)")
        reasons += cpu_flash_reasons(call)
        return reasons or non_finite_reasons(call, "the fused kernel")

    def auto_reasons(self, call: AttentionCall) -> list[str]:
        reasons = small_block_reasons(call)
        bias = call.bias
        if call.needs_grad and isinstance(bias, RelativeBias) and bias.offset_only and bias.far_constant_distance():
            reasons.append(
                f"gradients are needed and {type(bias).__name__} is constant far from the diagonal: structured's "
                f"backward needs no extra pass for the bias gradient (measured 1.3x against 1.8x bias-free SDPA at "
                f"4096 tokens)"
            )
        return reasons

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        return toeplitz_attention(call)


def toeplitz_attention(
    call: AttentionCall, *, block_q: int | None = None, tile: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with an offset-only bias on a validated call that :class:`ToeplitzBackend` accepts; the
    formula is :func:`relbias.attention`'s.

    Shapes: query (B, H, Lq, D), key and value (B, H, Lk, D) on CPU -> out (B, H, Lq, D) in the dtype of
    ``query``, lse (B, H, Lq) in float32 (float64 for float64 inputs), -inf (and out 0) for a query that sees
    no key. float16 and bfloat16 inputs run on float32 copies.

    Precision: the backward recomputes ``p = exp(s - lse)`` from the stored log-sum-exp, which float32 holds to
    ``|lse| x 2^-24``; with scores of order 1e3 the gradients err about 5e-4 relative (the kernel's own backward),
    and with scores beyond ~1e7 (a bias of 1e30, a scale of 1e20) they are wrong while the output is right. The
    reference backend, one softmax, has no such limit. A query holding +-inf whose every score is -inf gets out 0
    (the reference: NaN); it still reaches no other query. ``block_q``: query rows per kernel call (tokens), default :data:`BLOCK_Q`; ``tile``: rows
    and keys per tile of the bias-gradient pass, default :data:`TILE`.
    """
    a = call.alignment
    native = call.bias.native(
        a.query_len, a.key_len, query_start=a.query_start, key_start=a.key_start, device=call.query.device
    )
    query, key, value = call.query, call.key, call.value
    if query.dtype in (torch.float16, torch.bfloat16):  # a half-precision additive mask would round the bias
        query, key, value = query.float(), key.float(), value.float()
    plan = {
        "scale": call.scale, "bias_scale": call.bias_scale, "delta": call.delta, "is_causal": call.is_causal,
        "min_offset": a.min_offset, "block_q": block_q or BLOCK_Q, "tile": tile or TILE,
    }
    out, lse = _ToeplitzFunction.apply(query, key, value, native.values, plan)
    return out.to(call.query.dtype), lse
