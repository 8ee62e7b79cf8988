"""The toeplitz backend's kernels, forward and backward, as ``torch.library`` custom ops.

As custom ops with fake (meta) implementations, a compiled model (``torch.compile(fullgraph=True)``) calls each as one
node, forward and backward, and their Python loops, kernel calls and denormal flushing run eagerly inside it. Eager
calls run the same functions through a plain ``autograd.Function``. See :mod:`relbias.backends.toeplitz` for the
method.
"""

from __future__ import annotations

import torch

from ._autograd import first_order
from ._cpu_flash import fused_backward, fused_forward
from ._denormals import flush_denormals
from .blockwise import compute_dtype

__all__ = ["toeplitz_apply"]

_NEG_INF = float("-inf")
#: Scores are clamped to this before exp in the bias-gradient pass: e^-87 = 1.6e-38, float32's smallest normals.
_EXP_FLOOR = -87.0


def _block_mask(w: torch.Tensor, query_len: int, i0: int, i1: int, k0: int, k1: int) -> torch.Tensor:
    """(1, Hb, i1 - i0, k1 - k0) view of the reversed bias ``w`` (Hb, Lq + Lk - 1) for query rows i1-1 down to
    i0 (row a is query i1 - 1 - a) and keys k0:k1: entry (a, s) is ``w[Lq - i1 + a + k0 + s]``."""
    return w.as_strided(
        (1, w.shape[0], i1 - i0, k1 - k0), (0, w.stride(0), 1, 1), w.storage_offset() + query_len - i1 + k0
    )


def _key_end(i1: int, delta: int, key_len: int, is_causal: bool) -> int:
    """Keys 0:end that query rows below ``i1`` may see (causal: key s visible to query t when s <= t + delta)."""
    return min(key_len, max(0, i1 + delta)) if is_causal else key_len


def _future_offsets(values: torch.Tensor, delta: int, key_len: int) -> torch.Tensor:
    """(M,) bool: the columns of the per-offset ``values`` (Hb, M) whose offset ``i - j`` is negative (future keys).
    Column n has offset ``min_offset + n``, with ``min_offset = delta - (key_len - 1)`` (first query, last key)."""
    return torch.arange(values.shape[1], device=values.device) < key_len - 1 - delta


def _reversed_bias(values: torch.Tensor, dtype: torch.dtype, bias_scale: float, is_causal: bool, delta: int,
                   key_len: int) -> torch.Tensor:
    """``w`` (Hb, M) in ``dtype``: the scaled per-offset values reversed; causal: future offsets (< 0) -inf."""
    w = values.to(dtype) * bias_scale
    if is_causal:
        w = w.masked_fill(_future_offsets(w, delta, key_len), _NEG_INF)
    return w.flip(-1).contiguous()


def _forward_impl(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, values: torch.Tensor, scale: float,
    bias_scale: float, delta: int, is_causal: bool, block_q: int, tile: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, Dv) in the dtype of ``query``, lse (B, H, Lq) float32 / float64); see the module.
    ``tile`` is the backward's (kept with the forward's settings)."""
    with flush_denormals():
        w = _reversed_bias(values, query.dtype, bias_scale, is_causal, delta, key.shape[2])
        b, h, lq, _ = query.shape
        lk = key.shape[2]
        out = query.new_zeros(b, h, lq, value.shape[-1])
        lse = torch.full((b, h, lq), _NEG_INF, dtype=compute_dtype(query.dtype), device=query.device)
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
        return out, lse


toeplitz_forward = torch.library.custom_op("relbias::toeplitz_forward", _forward_impl, mutates_args=())


@toeplitz_forward.register_fake
def _(query, key, value, values, scale, bias_scale, delta, is_causal, block_q, tile):
    b, h, lq, _ = query.shape
    return query.new_empty(b, h, lq, value.shape[-1]), query.new_empty(b, h, lq, dtype=compute_dtype(query.dtype))


def _backward_impl(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, values: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, scale: float,
    bias_scale: float, delta: int, is_causal: bool, block_q: int, tile: int, values_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dvalues): dvalues (Hb, M) in the dtype of ``values``, or empty when not ``values_grad``."""
    with flush_denormals():
        w = _reversed_bias(values, query.dtype, bias_scale, is_causal, delta, key.shape[2])
        lq, lk = query.shape[2], key.shape[2]
        do = grad_out.to(out.dtype)
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
        if not values_grad:
            return dq, dk, dv, values.new_empty(0)
        row_dot = (do * out).sum(dim=-1).to(lse.dtype)  # D_i = dO_i . O_i; an lse gradient enters as D_i - g_i
        if grad_lse is not None:
            row_dot = row_dot - grad_lse
        # rows with no key: dO and D zero, so their dS is exactly 0; a finite lse keeps their scores finite
        if bool(empty.any()):  # (B, H, Lq) bools: cheap; the copy of dO is made only when some row is empty
            do, row_dot = do.masked_fill(empty[..., None], 0.0), row_dot.masked_fill(empty, 0.0)
        plan = {"scale": scale, "delta": delta, "is_causal": is_causal, "tile": tile}
        grad_w = _bias_gradient(query, key, value, do, lse.masked_fill(empty, 0.0), row_dot, w, plan)
        grad_values = grad_w.flip(-1) * bias_scale
        if is_causal:  # future offsets: no query sees them (exactly 0, whatever the clamped exp gave there)
            grad_values.masked_fill_(_future_offsets(grad_values, delta, lk), 0.0)
        return dq, dk, dv, grad_values.to(values.dtype).contiguous()


toeplitz_backward = torch.library.custom_op("relbias::toeplitz_backward", _backward_impl, mutates_args=())


@toeplitz_backward.register_fake
def _(grad_out, grad_lse, query, key, value, values, out, lse, scale, bias_scale, delta, is_causal, block_q, tile,
      values_grad):
    dvalues = values.new_empty(values.shape) if values_grad else values.new_empty(0)  # contiguous, as the op's
    return torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), dvalues


def _setup_context(ctx, inputs, output):
    query, key, value, values, *settings = inputs
    ctx.settings = settings  # scale, bias_scale, delta, is_causal, block_q, tile
    ctx.values_grad = values.requires_grad
    ctx.save_for_backward(query, key, value, values, *output)
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient, not zeros (which would cost a padded pass)


def _backward_with(backward_op):
    @first_order("toeplitz")
    def backward(ctx, grad_out, grad_lse):
        query, key, value, values, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, dvalues = backward_op(
            grad_out, grad_lse, query, key, value, values, out, lse, *ctx.settings, ctx.values_grad
        )
        return dq, dk, dv, dvalues if ctx.values_grad else None, *([None] * len(ctx.settings))

    return backward


toeplitz_forward.register_autograd(_backward_with(toeplitz_backward), setup_context=_setup_context)


class _Eager(torch.autograd.Function):
    """The same forward and backward outside torch.compile: calling a custom op eagerly makes PyTorch import its
    compiler stack on first use (822 modules, 76 MiB of resident memory, measured), which an eager user of this
    backend should not pay."""

    @staticmethod
    def forward(ctx, *inputs):
        output = _forward_impl(*inputs)
        _setup_context(ctx, inputs, output)
        return output

    backward = staticmethod(_backward_with(_backward_impl))


def toeplitz_apply(query, key, value, values, plan: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward (differentiable through the backward) with ``plan``'s settings: scale, bias_scale, delta,
    is_causal, block_q, tile; as the custom ops while torch.compile traces, else as plain functions."""
    settings = (
        float(plan["scale"]), float(plan["bias_scale"]), plan["delta"], plan["is_causal"], plan["block_q"],
        plan["tile"],
    )
    apply = toeplitz_forward if torch.compiler.is_compiling() else _Eager.apply
    return apply(query, key, value, values, *settings)


def _bias_gradient(query, key, value, do, lse, row_dot, w, plan) -> torch.Tensor:
    """Gradient (Hb, M) of the loss with respect to the reversed, scaled bias ``w``: per tile, ``dS`` summed along
    its diagonals (entry (a, s) of a tile is ``w[c + a + s]``), tiles in a fixed order. ``lse`` finite (rows with
    no key: any value, their ``do`` and ``row_dot`` zero)."""
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
        q_aug = torch.cat([query[:, :, rows].flip(2) * scale, -lse[:, :, rows].flip(2).to(dtype)[..., None]], -1)
        do_aug = torch.cat([do[:, :, rows].flip(2), -row_dot[:, :, rows].flip(2).to(dtype)[..., None]], -1)
        for k0 in range(0, end, tile):
            k1 = min(end, k0 + tile)
            scores = torch.matmul(q_aug, key_aug[:, :, k0:k1].transpose(-1, -2))
            scores += _block_mask(w, lq, i0, i1, k0, k1)
            # exp of a score below -87.3 is a float32 denormal (or 0, for -inf), on which torch's vectorised exp
            # takes a scalar slow path (15-160x per tile, measured); e^-87 is below 2^-125 of the row's largest
            # term, so clamping there changes dS by less than 1e-38 |dP|
            ds = scores.clamp_(min=_EXP_FLOOR).exp_().mul_(torch.matmul(do_aug, value_aug[:, :, k0:k1].transpose(-1, -2)))
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
