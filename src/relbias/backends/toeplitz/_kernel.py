"""The toeplitz backend's kernels, forward and backward, as ``torch.library`` custom ops.

As custom ops with fake (meta) implementations, a compiled model (``torch.compile(fullgraph=True)``) calls each as one
node, forward and backward, and their Python loops, kernel calls and denormal flushing run eagerly inside it. Eager
calls run the same functions through a plain ``autograd.Function``. See :mod:`relbias.backends.toeplitz` for the
method.
"""

from __future__ import annotations

import torch

from .._shared.autograd import eager_function, first_order
from .._shared.cpu_flash import fused_backward, fused_forward
from . import _native as _toeplitz_native
from .._shared.denormals import flush_denormals
from ._view import block_mask, future_offsets, key_end, reversed_bias
from .._shared.dtypes import compute_dtype

__all__ = ["part_backward", "toeplitz_apply"]

_NEG_INF = float("-inf")


def _forward_impl(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, values: torch.Tensor,
    key_padding: torch.Tensor | None, scale: float, bias_scale: float, delta: int, is_causal: bool, block_q: int,
    tile: int, dropout_p: float, seed: torch.Tensor, query_start: int, key_start: int, window_left: int,
    window_right: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, Dv) in the dtype of ``query``, lse (B, H, Lq) float32 / float64); see the module.
    ``key_padding``: None or the key padding mask as an additive (Bm, Hm, Lk) row in the dtype of ``query``, 0 or
    -inf (:func:`relbias.backends._shared.masks.additive_mask` without its query dimension). ``dropout_p`` > 0: attention dropout with the counter-based mask of
    ``seed`` at the absolute positions ``query_start``, ``key_start`` (:class:`relbias._dropout.Dropout`; the native
    kernels only: the caller sees to it); ``seed`` a 0-dim integer tensor as the op's (drawn in a compiled graph),
    or an int in eager calls of the function itself. ``tile`` is the backward's (kept with the forward's settings). The fused C++
    forward (:func:`relbias.backends.toeplitz._native.forward`, tiles capped by ``block_q``) where it is built;
    else PyTorch's CPU flash kernel per block of ``block_q`` query rows. ``window_left``, ``window_right``: a
    local-attention window's sides, -1 for no bound (:func:`relbias.window.kernel_sides`; the native kernels only)."""
    w = reversed_bias(values, compute_dtype(query.dtype), bias_scale, is_causal, delta, key.shape[2])
    tile_q, tile_k = _toeplitz_native.forward_tiles(block_q, _band_width(is_causal, window_left, window_right))
    native = _toeplitz_native.forward(
        query, key, value, w,
        {"scale": scale, "delta": delta, "is_causal": is_causal, "tile_q": tile_q, "tile_k": tile_k,
         "dropout_p": dropout_p, "seed": seed, "query_start": query_start, "key_start": key_start,
         "window_left": window_left, "window_right": window_right},
        key_padding=key_padding,
    )
    if native is not None:
        return native
    if dropout_p > 0 or window_left >= 0 or window_right >= 0:
        raise RuntimeError("attention dropout and windows on the toeplitz backend need its native kernels, which do "
                           "not run here (the dispatcher sends such calls to blockwise)")
    if query.dtype != w.dtype:  # half precision the native forward did not take (switched off since): float32 copies
        out, lse = _flash_forward(query.float(), key.float(), value.float(), w, key_padding, scale, delta, is_causal,
                                  block_q)
        return out.to(query.dtype), lse
    return _flash_forward(query, key, value, w, key_padding, scale, delta, is_causal, block_q)


def _band_width(is_causal: bool, window_left: int, window_right: int) -> int | None:
    """The number of keys a query's window spans (offsets ``-right .. left``), or None when a side is unbounded."""
    right = 0 if is_causal else window_right
    return None if window_left < 0 or right < 0 else window_left + right + 1


def _flash_forward(query, key, value, w, key_padding, scale, delta, is_causal, block_q):
    """(out, lse) by PyTorch's CPU flash kernel, one call per block of ``block_q`` query rows with the reversed bias
    ``w`` as a strided mask (plus the key padding), denormals flushed on every thread (:func:`flush_denormals`; the
    native kernels flush on their own threads)."""
    with flush_denormals():
        b, h, lq, _ = query.shape
        lk = key.shape[2]
        out = query.new_zeros(b, h, lq, value.shape[-1])
        lse = torch.full((b, h, lq), _NEG_INF, dtype=compute_dtype(query.dtype), device=query.device)
        for i0 in range(0, lq, block_q):
            i1 = min(lq, i0 + block_q)
            end = key_end(i1, delta, lk, is_causal)
            if end == 0:
                continue
            o, l = fused_forward(
                query[:, :, i0:i1].flip(2), key[:, :, :end], value[:, :, :end], is_causal=False, scale=scale,
                attn_mask=_padded(block_mask(w, lq, i0, i1, 0, end), key_padding, end),
            )
            out[:, :, i0:i1] = o.flip(2)
            lse[:, :, i0:i1] = l.flip(2)
        blind = min(lq, max(0, -delta)) if is_causal else 0  # queries before every key: the kernel gives lse 0
        if blind:
            out[:, :, :blind] = 0.0
            lse[:, :, :blind] = _NEG_INF
        if key_padding is not None:  # queries whose visible keys are all padded: the kernel gives lse 0 too
            empty = _padded_rows(key_padding, lq, delta, is_causal)
            out.masked_fill_(empty[..., None], 0.0)
            lse.masked_fill_(empty, _NEG_INF)
        return out, lse


def _padded(mask: torch.Tensor, key_padding: torch.Tensor | None, end: int) -> torch.Tensor:
    """A block's additive mask plus the key padding of its keys 0:end ((Bm, Hm, 1, end), broadcast)."""
    return mask if key_padding is None else mask + key_padding[:, :, None, :end]


def _padded_rows(key_padding: torch.Tensor, query_len: int, delta: int, is_causal: bool) -> torch.Tensor:
    """(Bm, Hm, Lq) bool: the queries every visible key of which is padded (causal: keys s <= t + delta)."""
    keep = ~torch.isneginf(key_padding)  # (Bm, Hm, Lk)
    none_kept = ~keep.any(-1, keepdim=True)  # (Bm, Hm, 1): every query of such a row is empty, whatever delta
    if not is_causal:
        return none_kept.expand(*keep.shape[:2], query_len)
    first = keep.int().argmax(-1, keepdim=True)  # the first kept key (0 where none is)
    rows = torch.arange(query_len, device=key_padding.device)
    return (rows + delta < first) | none_kept


toeplitz_forward = torch.library.custom_op("relbias::toeplitz_forward", _forward_impl, mutates_args=())


@toeplitz_forward.register_fake
def _(query, key, value, values, key_padding, scale, bias_scale, delta, is_causal, block_q, tile, dropout_p, seed,
      query_start, key_start, window_left, window_right):
    b, h, lq, _ = query.shape
    return query.new_empty(b, h, lq, value.shape[-1]), query.new_empty(b, h, lq, dtype=compute_dtype(query.dtype))


def _backward_impl(
    grad_out: torch.Tensor, grad_lse: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
    value: torch.Tensor, values: torch.Tensor, key_padding: torch.Tensor | None, out: torch.Tensor,
    lse: torch.Tensor, scale: float, bias_scale: float, delta: int, is_causal: bool, block_q: int, tile: int,
    dropout_p: float, seed: torch.Tensor, query_start: int, key_start: int, window_left: int, window_right: int,
    values_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dvalues): dvalues (Hb, M) in the dtype of ``values``, or empty when not ``values_grad``;
    ``key_padding`` as the forward's.
    The fused C++ kernel (:mod:`relbias.backends.toeplitz._native`, built on first use: a single tiled pass that
    forms ``dS`` once for all four; its bias gradient is dropped when not wanted, about a tenth of its work). Where
    it cannot be built or ``RELBIAS_NATIVE=0`` is set: without a bias gradient, the CPU flash kernel's own backward
    per query block; with one, the native kernel's Python version (:mod:`relbias.backends.toeplitz._backward`).
    Half-precision inputs: the native kernel takes them where :func:`~relbias.backends.toeplitz._native.runs_half`
    (float32 accumulation, P and dS rounded to the dtype for their GEMMs), else they run on float32 copies; dq, dk,
    dv come back in the inputs' dtype either way."""
    half = query.dtype
    if half != compute_dtype(half) and not _toeplitz_native.runs_half(half):  # on float32 copies, rounded back
        query, key, value, out = query.float(), key.float(), value.float(), out.float()
    w = reversed_bias(values, compute_dtype(query.dtype), bias_scale, is_causal, delta, key.shape[2])
    do = grad_out.to(out.dtype)
    empty = lse == _NEG_INF
    if grad_lse is not None:
        grad_lse = grad_lse.to(lse.dtype).masked_fill(empty, 0.0)
    if not values_grad and dropout_p == 0 and _toeplitz_native.load_native() is None:
        dq, dk, dv = _kernel_backward(do, grad_lse, query, key, value, out, lse.masked_fill(empty, float("inf")),
                                      w, key_padding, scale, delta, is_causal, block_q)
        return dq.to(half), dk.to(half), dv.to(half), values.new_empty(0)
    tile = _toeplitz_native.window_tile(tile, _band_width(is_causal, window_left, window_right))
    plan = {"scale": scale, "delta": delta, "is_causal": is_causal, "tile": tile, "dropout_p": dropout_p,
            "seed": seed, "query_start": query_start, "key_start": key_start, "window_left": window_left,
            "window_right": window_right}
    if dropout_p > 0 or window_left >= 0 or window_right >= 0:  # the native kernel alone applies them
        dq, dk, dv, grad_w = _toeplitz_native.native_backward(do, query, key, value, out, lse, grad_lse, w, plan,
                                                              key_padding=key_padding)
    else:
        dq, dk, dv, grad_w = _toeplitz_native.backward(do, query, key, value, out, lse, grad_lse, w, plan,
                                                       key_padding=key_padding)
    dq, dk, dv = dq.to(half), dk.to(half), dv.to(half)
    if not values_grad:
        return dq, dk, dv, values.new_empty(0)
    grad_values = grad_w.flip(-1) * bias_scale
    if is_causal:  # future offsets: no query sees them
        grad_values.masked_fill_(future_offsets(grad_values, delta, key.shape[2]), 0.0)
    return dq, dk, dv, grad_values.to(values.dtype).contiguous()


def part_backward(grad_out, query, key, value, values, out, lse, plan: dict, key_padding=None):
    """(dq, dk, dv, dvalues) of one part of a merged result (a ring block) run by the toeplitz forward with
    ``plan``, given the merged ``out`` and the merged (global) ``lse`` (compute dtype): the backward forms
    ``P = exp(s - lse)`` and ``D = dO . out`` from them, which is exactly this part's share, so nothing is
    recomputed. ``dvalues`` is empty unless ``values`` requires grad. Shapes as the custom ops'."""
    return _backward_impl(grad_out, None, query, key, value, values.detach(), key_padding, out, lse,
                          *_settings(plan), values.requires_grad)


def _settings(plan: dict) -> tuple:
    """The ops' settings from a plan, in their order: scale, bias_scale, delta, is_causal, block_q, tile, the
    dropout's dropout_p, seed, query_start, key_start (0.0, 0, 0, 0 without) and the window's window_left,
    window_right (-1, -1 without)."""
    seed = plan.get("seed", 0)  # a tensor drawn in a compiled graph stays one (read where the kernels run)
    return (float(plan["scale"]), float(plan["bias_scale"]), plan["delta"], plan["is_causal"], plan["block_q"],
            plan["tile"], float(plan.get("dropout_p", 0.0)), seed if isinstance(seed, torch.Tensor) else int(seed),
            int(plan.get("query_start", 0)), int(plan.get("key_start", 0)), int(plan.get("window_left", -1)),
            int(plan.get("window_right", -1)))


def _kernel_backward(do, grad_lse, query, key, value, out, kernel_lse, w, key_padding, scale, delta, is_causal,
                     block_q):
    """dq, dk, dv by the CPU flash kernel's backward, one call per query block with the bias view as its mask;
    ``kernel_lse`` is +inf for rows with no key (p = exp(s - inf) = 0). Denormals flushed on every
    thread (:func:`flush_denormals`; the native kernels flush on their own threads)."""
    with flush_denormals():
        lq, lk = query.shape[2], key.shape[2]
        dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (query, key, value))  # contiguous
        for i0 in range(0, lq, block_q):
            i1 = min(lq, i0 + block_q)
            end = key_end(i1, delta, lk, is_causal)
            if end == 0:
                continue
            rows = slice(i0, i1)
            gq, gk, gv = fused_backward(
                do[:, :, rows].flip(2), query[:, :, rows].flip(2), key[:, :, :end], value[:, :, :end],
                out[:, :, rows].flip(2), kernel_lse[:, :, rows].flip(2), is_causal=False, scale=scale,
                attn_mask=_padded(block_mask(w, lq, i0, i1, 0, end), key_padding, end),
                lse_grad=None if grad_lse is None else grad_lse[:, :, rows].flip(2),
            )
            dq[:, :, rows] = gq.flip(2)
            dk[:, :, :end] += gk
            dv[:, :, :end] += gv
        return dq, dk, dv


toeplitz_backward = torch.library.custom_op("relbias::toeplitz_backward", _backward_impl, mutates_args=())


@toeplitz_backward.register_fake
def _(grad_out, grad_lse, query, key, value, values, key_padding, out, lse, scale, bias_scale, delta, is_causal,
      block_q, tile, dropout_p, seed, query_start, key_start, window_left, window_right, values_grad):
    dvalues = values.new_empty(values.shape) if values_grad else values.new_empty(0)
    return query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape), dvalues  # contiguous


def _setup_context(ctx, inputs, output):
    query, key, value, values, key_padding, *settings = inputs
    ctx.settings = settings  # scale, bias_scale, delta, is_causal, block_q, tile, dropout, window (see _settings)
    ctx.values_grad = values.requires_grad
    ctx.save_for_backward(query, key, value, values, key_padding, *output)
    ctx.set_materialize_grads(False)  # an unused lse gets no gradient, not zeros (which would cost a padded pass)


def _backward_with(backward_op):
    @first_order("toeplitz")
    def backward(ctx, grad_out, grad_lse):
        query, key, value, values, key_padding, out, lse = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(out)
        dq, dk, dv, dvalues = backward_op(
            grad_out, grad_lse, query, key, value, values, key_padding, out, lse, *ctx.settings, ctx.values_grad
        )
        return dq, dk, dv, dvalues if ctx.values_grad else None, None, *([None] * len(ctx.settings))

    return backward


toeplitz_forward.register_autograd(_backward_with(toeplitz_backward), setup_context=_setup_context)


_Eager = eager_function("ToeplitzEager", _forward_impl, _setup_context, _backward_with(_backward_impl))


def toeplitz_apply(query, key, value, values, plan: dict, key_padding=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward (differentiable through the backward) with ``plan``'s settings: scale, bias_scale, delta,
    is_causal, block_q, tile, and the additive ``key_padding`` (None or (Bm, Hm, Lk)); as the custom ops while
    torch.compile traces, else as plain functions (the forward alone where nothing needs a gradient: inference, no
    autograd bookkeeping per call)."""
    settings = _settings(plan)
    if torch.compiler.is_compiling():
        if not isinstance(settings[7], torch.Tensor):  # the op's seed is a tensor (0 without dropout)
            settings = (*settings[:7], torch.tensor(settings[7]), *settings[8:])
        return toeplitz_forward(query, key, value, values, key_padding, *settings)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, values)):
        apply = _Eager.apply
    else:
        apply = _forward_impl
    return apply(query, key, value, values, key_padding, *settings)
