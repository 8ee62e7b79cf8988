"""The structured backend's forward and backward as ``torch.library`` custom ops (see
:mod:`relbias.backends.structured` for the method).

Their inputs are tensors and plain numbers only, so a compiled model (``torch.compile(fullgraph=True)``) calls each
as one node, forward and backward, with fake (meta) kernels giving the output shapes; the far parts, the band's
tiles and the bias gradient are planned from the numbers and run eagerly inside. Eager calls run the same functions
through a plain ``autograd.Function`` (a first eager custom-op call imports PyTorch's compiler stack).

Settings, in order: scale, bias_scale, query_start, key_start (int positions, tokens), is_causal, distance (the
bias's far-constant distance T, tokens), block_q (band tile rows).
"""

from __future__ import annotations

import torch

from ...positions import Alignment
from .._shared.autograd import eager_function, first_order
from .._shared.bias_tiles import NativeSource
from ._parts import empty_rows, far_parts, merge_part, part_backward, run_part
from .._shared.tiled_kernel import TileProblem, tiled_backward, tiled_forward
from .._shared.dtypes import compute_dtype

__all__ = ["structured_apply"]

_NEG_INF = float("-inf")


def _compute(dtype: torch.dtype) -> torch.dtype:
    """float16 runs in float64 (T5's unscaled scores exceed its range); else float32 / float64."""
    return torch.float64 if dtype == torch.float16 else compute_dtype(dtype)


def _plan(query, key, value, values, keep, settings):
    """(band TileProblem, parts, const_index) of the call: the far parts as fused slices, the two constants'
    columns in ``values`` (offset T, past; -T, future, moved inside the block's offsets) and the band."""
    scale, bias_scale, query_start, key_start, is_causal, distance, block_q = settings
    alignment = Alignment(query.shape[2], key.shape[2], query_start, key_start)
    lo, hi, delta = alignment.min_offset, alignment.max_offset, query_start - key_start
    source = NativeSource(values, lo, delta, bias_scale, _compute(query.dtype))
    const_index = [min(max(distance, lo), hi) - lo, min(max(-distance, lo), hi) - lo]
    band = TileProblem(
        query, key, value, scale, source, None if keep is None else keep[:, :, None], is_causal, delta,
        band_min_offset=-(distance - 1), band_max_offset=distance - 1, block_q=block_q, block_k=block_q + 2 * distance,
        compute=_compute(query.dtype),
    )
    return band, far_parts(alignment, distance, is_causal), const_index


def _part_rows(query, key, settings) -> int:
    """Rows of all far parts together (the packed part outputs kept for the bias gradient)."""
    _, _, query_start, key_start, is_causal, distance, _ = settings
    parts = far_parts(Alignment(query.shape[2], key.shape[2], query_start, key_start), distance, is_causal)
    return sum(t1 - t0 for t0, t1, *_ in parts)


def _forward_impl(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, values: torch.Tensor, keep: torch.Tensor | None,
    scale: float, bias_scale: float, query_start: int, key_start: int, is_causal: bool, distance: int, block_q: int,
    keep_parts: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, Dv), lse (B, H, Lq), parts_out (B, H, R, Dv), parts_lse (B, H, R)), all in the compute
    dtype: the merged result and, when ``keep_parts`` (the bias gradient will be needed), every far part's output
    and lse packed along rows (R rows in all; else R = 0). ``keep``: None or the (Bm, Hm, Lk) bool key padding
    mask (True = may attend)."""
    settings = (scale, bias_scale, query_start, key_start, is_causal, distance, block_q)
    if keep is not None and bool(keep.all()):
        keep = None  # nothing padded
    band, parts, const_index = _plan(query, key, value, values, keep, settings)
    compute = band.compute
    consts = values.detach().to(compute)[:, const_index] * bias_scale  # (Hb, 2): past, future
    b, h, lq, _ = query.shape
    out = torch.zeros(b, h, lq, value.shape[-1], dtype=compute, device=query.device)
    lse = torch.full((b, h, lq), _NEG_INF, dtype=compute, device=query.device)
    kept_out, kept_lse = [], []
    for t0, t1, s0, s1, mode, direction in parts:  # far parts first: nothing else is alive yet
        part_keep = None if keep is None else keep[:, :, s0:s1]
        o_p, l_p = run_part(query[:, :, t0:t1], key[:, :, s0:s1], value[:, :, s0:s1], mode, scale, part_keep)
        o_p, l_p = o_p.to(compute), l_p.to(compute) + consts[:, direction, None]  # (B, H, rows) + (Hb, 1)
        merge_part(out, lse, slice(t0, t1), o_p, l_p)
        if keep_parts:
            kept_out.append(o_p)
            kept_lse.append(l_p)
        del o_p
    out_band, lse_band = tiled_forward(band)  # the band
    merge_part(out, lse, slice(None), out_band, lse_band)
    del out_band, lse_band
    if not kept_out:
        return out, lse, out.new_empty(b, h, 0, value.shape[-1]), lse.new_empty(b, h, 0)
    return out, lse, torch.cat(kept_out, dim=2), torch.cat(kept_lse, dim=2)


structured_forward = torch.library.custom_op("relbias::structured_forward", _forward_impl, mutates_args=())


@structured_forward.register_fake
def _(query, key, value, values, keep, scale, bias_scale, query_start, key_start, is_causal, distance, block_q,
      keep_parts):
    settings = (scale, bias_scale, query_start, key_start, is_causal, distance, block_q)
    b, h, lq, _ = query.shape
    rows = _part_rows(query, key, settings) if keep_parts else 0
    compute = _compute(query.dtype)
    dv = value.shape[-1]
    new = query.new_empty
    return (new(b, h, lq, dv, dtype=compute), new(b, h, lq, dtype=compute), new(b, h, rows, dv, dtype=compute),
            new(b, h, rows, dtype=compute))


def _backward_impl(
    grad_out: torch.Tensor | None, grad_lse: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, values: torch.Tensor, keep: torch.Tensor | None, out: torch.Tensor, lse: torch.Tensor,
    parts_out: torch.Tensor, parts_lse: torch.Tensor, scale: float, bias_scale: float, query_start: int,
    key_start: int, is_causal: bool, distance: int, block_q: int, values_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv in the inputs' dtypes, dvalues (Hb, M) in the dtype of ``values``, or empty when not
    ``values_grad``): each far part's fused backward given the merged output and ``lse - c_p``, the band's tiles
    recomputed, and the constants' gradients from the packed part outputs."""
    settings = (scale, bias_scale, query_start, key_start, is_causal, distance, block_q)
    if keep is not None and bool(keep.all()):
        keep = None
    band, parts, const_index = _plan(query, key, value, values, keep, settings)
    compute = band.compute
    consts = values.detach().to(compute)[:, const_index] * bias_scale
    do = torch.zeros_like(out) if grad_out is None else grad_out.to(compute)
    row_dot = (do * out).sum(dim=-1)  # D_i = dO_i . O_i
    if grad_lse is not None:  # d lse_i / d s_ij = p_ij: the lse gradient enters as D_i - g_i
        grad_lse = grad_lse.to(compute).masked_fill(lse == _NEG_INF, 0.0)
        row_dot = row_dot - grad_lse
    dq, dk, dv = tiled_backward(band, do, lse, row_dot)
    dconst = torch.zeros(values.shape[0], 2, dtype=compute, device=values.device)
    at = 0
    for t0, t1, s0, s1, mode, direction in parts:
        rows_lse = lse[:, :, t0:t1]
        # The kernel forms p = exp(scale q.k - lse): given lse - c_p, p is the global probability.
        kernel_lse = rows_lse - consts[:, direction, None]
        part_keep = None if keep is None else keep[:, :, s0:s1]
        if part_keep is not None:  # rows seeing no key here, or none anywhere (lse -inf): p = 0
            kernel_lse = kernel_lse.masked_fill(empty_rows(part_keep, mode, t1 - t0) | (rows_lse == _NEG_INF), float("inf"))
        part_backward(
            do[:, :, t0:t1], query[:, :, t0:t1], key[:, :, s0:s1], value[:, :, s0:s1], out[:, :, t0:t1],
            kernel_lse, mode, scale, dq[:, :, t0:t1], dk[:, :, s0:s1], dv[:, :, s0:s1], part_keep,
            None if grad_lse is None else grad_lse[:, :, t0:t1],
        )
        if values_grad:
            o_p, l_p = parts_out[:, :, at:at + t1 - t0], parts_lse[:, :, at:at + t1 - t0]
            weight = torch.exp(l_p - rows_lse).masked_fill(l_p == _NEG_INF, 0.0)  # a part a row does not see: 0
            per_row = weight * ((do[:, :, t0:t1] * o_p).sum(-1) - row_dot[:, :, t0:t1])
            per_head = per_row.sum(dim=(0, 2))  # (H,)
            dconst[:, direction] += per_head.sum(0, keepdim=True) if values.shape[0] == 1 else per_head
        at += t1 - t0
    if not values_grad:
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), values.new_empty(0)
    grad_values = band.source.native_grad().to(values.dtype)
    for direction in (0, 1):
        grad_values[:, const_index[direction]] += (dconst[:, direction] * bias_scale).to(values.dtype)
    return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), grad_values.contiguous()


structured_backward = torch.library.custom_op("relbias::structured_backward", _backward_impl, mutates_args=())


@structured_backward.register_fake
def _(grad_out, grad_lse, query, key, value, values, keep, out, lse, parts_out, parts_lse, scale, bias_scale,
      query_start, key_start, is_causal, distance, block_q, values_grad):
    dvalues = values.new_empty(values.shape) if values_grad else values.new_empty(0)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dvalues


def _setup_context(ctx, inputs, output):
    query, key, value, values, keep, *settings = inputs
    ctx.settings = settings[:-1]  # scale, bias_scale, query_start, key_start, is_causal, distance, block_q
    ctx.values_grad = values.requires_grad
    ctx.save_for_backward(query, key, value, values, keep, *output)
    ctx.set_materialize_grads(False)  # unused outputs (lse, the packed parts) get no gradient, not zeros


def _backward_with(backward_op):
    @first_order("structured")
    def backward(ctx, grad_out, grad_lse, *_parts):
        query, key, value, values, keep, out, lse, parts_out, parts_lse = ctx.saved_tensors
        dq, dk, dv, dvalues = backward_op(
            grad_out, grad_lse, query, key, value, values, keep, out, lse, parts_out, parts_lse, *ctx.settings,
            ctx.values_grad,
        )
        return dq, dk, dv, dvalues if ctx.values_grad else None, None, *([None] * (len(ctx.settings) + 1))

    return backward


structured_forward.register_autograd(_backward_with(structured_backward), setup_context=_setup_context)


_Eager = eager_function("StructuredEager", _forward_impl, _setup_context, _backward_with(_backward_impl))


def structured_apply(query, key, value, values, keep, settings: tuple, keep_parts: bool):
    """(out, lse) in the compute dtype, differentiable in query, key, value and ``values``: the custom ops while
    torch.compile traces, else plain functions. ``settings`` as the module docstring lists them."""
    apply = structured_forward if torch.compiler.is_compiling() else _Eager.apply
    out, lse, _, _ = apply(query, key, value, values, keep, *settings, keep_parts)
    return out, lse
