"""The structured backend: exact attention for biases that are constant far from the diagonal.

Some biases take one value per head and direction beyond a distance T (the T5 bias beyond its last
bucket's start, 91 bidirectional / 113 causal for 32 buckets and max_distance 128; a per-offset bias
with ``out_of_range="clip"`` beyond L - 1). A constant added to every score of a set of keys is
absorbed by softmax into that set's log-sum-exp, so attention splits into three exact parts:

* far past keys, offset ``i - j >= T``, bias ``c_past``: bias-free fused attention on shifted slices
  (e.g. ``q[T:]`` against ``k[:N-T]`` with a causal mask);
* far future keys, offset ``<= -T`` (bidirectional only), bias ``c_future``: the same, mirrored;
* the band ``|i - j| < T``: the tiled kernel with the bias looked up per tile.

The parts are merged by log-sum-exp: ``lse = logsumexp_p(lse_p + c_p)``,
``out = sum_p exp(lse_p + c_p - lse) out_p``. Backward calls each fused part's backward with the merged
output and the global ``lse - c_p``, which yields exactly that part's share of dq, dk, dv; the band
recomputes its tiles; the gradient of a constant is ``sum_i w_i (dO_i . out_p,i - D_i)`` with
``w_i = exp(lse_p,i + c_p - lse_i)`` and ``D_i = dO_i . O_i`` (sums over batch and rows, in a fixed
order: deterministic). Saved for backward: O(B·H·L·D).

Sources: the bucket saturation of T5 (Raffel et al. 2020, JMLR 21(140), §2.1) and Shaw et al.'s clipping
(2018, NAACL, §3); merging partial softmaxes by their log-sum-exp as in FlashAttention's split-KV /
Flash-Decoding (Dao et al. 2022, 2023); the backward formulas of FlashAttention (Dao et al. 2022, Alg. 2).

Requirements (the dispatcher checks them and says why when one fails): an offset-only bias with a
``far_constant_distance()``, no ``mask`` or a bool key padding mask (query dimension 1: padded keys are
hidden in every part, through the fused kernel's additive ``attn_mask`` and in the band tiles), and a device
with a fused kernel that exposes its log-sum-exp (CPU here).
"""

from __future__ import annotations

import torch

from ..biases.base import RelativeBias
from ..call import AttentionCall
from ..positions import Alignment
from ._autograd import first_order
from ._bias_tiles import NativeSource
from ._cpu_flash import cpu_flash_reasons, fused_backward, fused_forward
from ._reasons import (
    dropout_reasons, non_finite_reasons, small_block_reasons, tensor_bias_reasons, tensor_position_reasons,
)
from ._tiled_kernel import TileProblem, tiled_backward, tiled_forward
from .base import Backend
from .blockwise import compute_dtype

__all__ = ["BLOCK_Q", "StructuredBackend", "far_distance", "far_parts", "structured_attention"]

#: Default query rows per band tile (tokens); a band tile spans BLOCK_Q + 2T - 2 keys.
BLOCK_Q = 64

_NEG_INF = float("-inf")


def far_distance(bias: object) -> int | None:
    """The distance T (tokens, >= 1) beyond which ``bias`` is one constant per direction, or None."""
    if not isinstance(bias, RelativeBias) or not bias.offset_only:
        return None
    distance = bias.far_constant_distance()
    return None if distance is None else max(1, int(distance))


def _lower_parts(lq: int, lk: int, m: int) -> list[tuple[int, int, int, int, bool]]:
    """Cover ``{(t, s): s <= t - m}`` of an (lq, lk) grid by slices (t0, t1, s0, s1, causal).

    ``causal`` slices are square with a top-left causal mask (so any kernel alignment agrees); the
    others are full rectangles.
    """
    parts = []
    if lq <= 0 or lk <= 0:
        return parts
    if m >= 0:
        rows = lq - m  # rows t = m + u see keys s <= u
        if rows <= 0:
            return parts
        side = min(rows, lk)
        parts.append((m, m + side, 0, side, True))
        if rows > lk:
            parts.append((m + lk, lq, 0, lk, False))
    else:
        r = -m  # keys s < r are visible to every row; keys s >= r to rows t >= s - r
        parts.append((0, lq, 0, min(r, lk), False))
        if lk > r:
            side = min(lq, lk - r)
            parts.append((0, side, r, r + side, True))
            if lq > lk - r:
                parts.append((lk - r, lq, r, lk, False))
    return parts


def far_parts(alignment: Alignment, distance: int, is_causal: bool) -> list[tuple[int, int, int, int, str, int]]:
    """The far regions of a block as fused-kernel slices.

    Returns:
        list of (t0, t1, s0, s1, mode, direction): rows t0:t1 and keys s0:s1 (indices into the block);
        mode "full", "lower" (key s visible when s - s0 <= t - t0) or "upper" (s - s0 >= t - t0);
        direction 0 for the past constant (offset >= T), 1 for the future one (offset <= -T).
    """
    lq, lk = alignment.query_len, alignment.key_len
    delta = alignment.query_start - alignment.key_start
    parts = [(t0, t1, s0, s1, "lower" if c else "full", 0) for t0, t1, s0, s1, c in _lower_parts(lq, lk, distance - delta)]
    if not is_causal:
        # s - t >= delta + T; mirrored (t' = lq-1-t, s' = lk-1-s) it is s' <= t' - (delta + T - lk + lq)
        for t0, t1, s0, s1, c in _lower_parts(lq, lk, delta + distance - lk + lq):
            parts.append((lq - t1, lq - t0, lk - s1, lk - s0, "upper" if c else "full", 1))
    return parts


#: Mirrored ("upper") parts copy their slices of q, k, v; they run this many heads at a time to keep
#: the copies small (memory: 3 x B x HEAD_GROUP x L x D elements at once).
HEAD_GROUP = 2


def _empty_rows(keep: torch.Tensor, mode: str, rows: int) -> torch.Tensor:
    """(Bm, Hm, rows or 1) bool: the part's rows that see no unpadded key, from its (Bm, Hm, keys) key mask."""
    if mode == "full":
        return ~keep.any(dim=-1, keepdim=True)
    seen = keep.flip(-1).cumsum(-1).flip(-1) if mode == "upper" else keep.cumsum(-1)  # square parts: rows == keys
    return seen[..., :rows] == 0


def _additive(keep: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """The fused kernel's attn_mask for a (Bm, Hm, keys) key mask: (Bm, Hm, 1, keys), 0 / -inf, in ``dtype``."""
    if keep is None:
        return None
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, _NEG_INF)[:, :, None]


def _heads(mask: torch.Tensor | None, heads: slice) -> torch.Tensor | None:
    """Mirror (along keys) the heads ``heads`` of a (Bm, Hm, 1, keys) mask; Hm = 1 broadcasts."""
    if mask is None:
        return None
    return (mask[:, heads] if mask.shape[1] > 1 else mask).flip(-1)


def _run_part(q, k, v, mode, scale, keep=None):
    """(out (B, H, rows, Dv) input dtype, or float32 for float16 inputs; lse (B, H, rows) float) of one far part.

    float16 parts run on float64 copies (see :func:`structured_attention`). ``keep``: the part's
    (Bm, Hm, keys) key padding mask or None; rows that see no kept key get out 0 and lse -inf.
    """
    if q.dtype == torch.float16:
        q, k, v = q.double(), k.double(), v.double()
    mask = _additive(keep, q.dtype)
    if mode != "upper":
        out, lse = fused_forward(q, k, v, is_causal=mode == "lower", scale=scale, attn_mask=mask)
    else:
        outs, lses = [], []
        for h0 in range(0, q.shape[1], HEAD_GROUP):  # mirror, run top-left causal, mirror back
            heads = slice(h0, h0 + HEAD_GROUP)
            o, l = fused_forward(
                q[:, heads].flip(2), k[:, heads].flip(2), v[:, heads].flip(2), is_causal=True, scale=scale,
                attn_mask=_heads(mask, heads),
            )
            outs.append(o.flip(2))
            lses.append(l.flip(2))
        out, lse = torch.cat(outs, dim=1), torch.cat(lses, dim=1)
    if keep is not None:  # the kernel returns lse 0 (not -inf) for rows whose every key is masked
        empty = _empty_rows(keep, mode, q.shape[2])
        lse = lse.masked_fill(empty, _NEG_INF)
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def _part_backward(do, q, k, v, out, lse, mode, scale, dq, dk, dv, keep=None, lse_grad=None):
    """Add this part's share of the gradients into the (B, H, rows / keys, D) slices dq, dk, dv.

    ``lse``: the global log-sum-exp minus the part's constant, +inf on rows that must get no gradient
    (then the kernel's ``p = exp(s - lse)`` is 0). ``keep``: as :func:`_run_part`. ``lse_grad``: the
    gradient (B, H, rows) of the global lse, or None (see :func:`fused_backward`).
    """
    if q.dtype == torch.float16:  # as in _run_part
        q, k, v = q.double(), k.double(), v.double()
    mask = _additive(keep, q.dtype)
    if mode != "upper":
        gq, gk, gv = fused_backward(
            do, q, k, v, out, lse, is_causal=mode == "lower", scale=scale, attn_mask=mask, lse_grad=lse_grad
        )
        dq += gq
        dk += gk
        dv += gv
        return
    for h0 in range(0, q.shape[1], HEAD_GROUP):
        hs = slice(h0, h0 + HEAD_GROUP)
        gq, gk, gv = fused_backward(
            do[:, hs].flip(2), q[:, hs].flip(2), k[:, hs].flip(2), v[:, hs].flip(2), out[:, hs].flip(2),
            lse[:, hs].flip(2), is_causal=True, scale=scale, attn_mask=_heads(mask, hs),
            lse_grad=None if lse_grad is None else lse_grad[:, hs].flip(2),
        )
        dq[:, hs] += gq.flip(2)
        dk[:, hs] += gk.flip(2)
        dv[:, hs] += gv.flip(2)


def _merge(out, lse, rows, part_out, part_lse):
    """Fold a part (out (B, H, r, Dv), lse (B, H, r)) into the running (out, lse) at ``rows``, in place."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, part_lse)
    safe = new.masked_fill(new == _NEG_INF, 0.0)  # rows with no key yet in either: weights exp(-inf) = 0
    target = out[:, :, rows]
    target.mul_(torch.exp(old - safe)[..., None]).add_(part_out * torch.exp(part_lse - safe)[..., None])
    lse[:, :, rows] = new


class _StructuredFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, values, problem: TileProblem, parts, const_index, bias_scale, keep):
        compute = problem.compute
        consts = values.detach().to(compute)[:, const_index] * bias_scale  # (Hb, 2): past, future
        b, h, lq, _ = query.shape
        out = torch.zeros(b, h, lq, value.shape[-1], dtype=compute, device=query.device)
        lse = torch.full((b, h, lq), _NEG_INF, dtype=compute, device=query.device)
        kept, part_lse = [], []
        for t0, t1, s0, s1, mode, direction in parts:  # far parts first: nothing else is alive yet
            part_keep = None if keep is None else keep[:, :, s0:s1]
            o_p, l_p = _run_part(query[:, :, t0:t1], key[:, :, s0:s1], value[:, :, s0:s1], mode, problem.scale, part_keep)
            l_p = l_p.to(compute) + consts[:, direction, None]  # (B, H, rows) + (Hb, 1)
            _merge(out, lse, slice(t0, t1), o_p.to(compute), l_p)
            part_lse.append(l_p)
            if values.requires_grad:
                kept.append(o_p)
            del o_p
        out_band, lse_band = tiled_forward(problem)  # the band
        _merge(out, lse, slice(None), out_band, lse_band)
        del out_band, lse_band
        ctx.save_for_backward(query, key, value, values, out, lse, *kept, *part_lse)
        ctx.problem, ctx.parts, ctx.const_index, ctx.bias_scale = problem, parts, const_index, bias_scale
        ctx.kept, ctx.consts, ctx.keep = bool(kept), consts, keep
        ctx.set_materialize_grads(False)
        return out.to(query.dtype), (lse.float() if query.dtype == torch.float16 else lse)

    @staticmethod
    @first_order("structured")
    def backward(ctx, grad_out, grad_lse):
        query, key, value, values, out, lse, *stats = ctx.saved_tensors
        problem: TileProblem = ctx.problem
        problem.query, problem.key, problem.value = query, key, value
        parts, n = ctx.parts, len(ctx.parts)
        part_out = stats[:n] if ctx.kept else [None] * n
        part_lse = stats[n:] if ctx.kept else stats
        compute = problem.compute
        source: NativeSource = problem.source
        source.grad.zero_()
        do = torch.zeros_like(out) if grad_out is None else grad_out.to(compute)
        row_dot = (do * out).sum(dim=-1)  # D_i = dO_i . O_i
        if grad_lse is not None:  # d lse_i / d s_ij = p_ij: the lse gradient enters as D_i - g_i
            grad_lse = grad_lse.to(compute).masked_fill(lse == _NEG_INF, 0.0)
            row_dot = row_dot - grad_lse
        dq, dk, dv = tiled_backward(problem, do, lse, row_dot)
        dconst = torch.zeros(values.shape[0], 2, dtype=compute, device=values.device)
        for (t0, t1, s0, s1, mode, direction), o_p, l_p in zip(parts, part_out, part_lse):
            rows_lse = lse[:, :, t0:t1]
            # The kernel forms p = exp(scale q.k - lse): given lse - c_p, p is the global probability.
            kernel_lse = rows_lse - ctx.consts[:, direction, None]
            part_keep = None if ctx.keep is None else ctx.keep[:, :, s0:s1]
            if part_keep is not None:  # rows seeing no key here, or none anywhere (lse -inf): p = 0
                kernel_lse = kernel_lse.masked_fill(_empty_rows(part_keep, mode, t1 - t0) | (rows_lse == _NEG_INF), float("inf"))
            _part_backward(
                do[:, :, t0:t1], query[:, :, t0:t1], key[:, :, s0:s1], value[:, :, s0:s1], out[:, :, t0:t1],
                kernel_lse, mode, problem.scale, dq[:, :, t0:t1], dk[:, :, s0:s1], dv[:, :, s0:s1], part_keep,
                None if grad_lse is None else grad_lse[:, :, t0:t1],
            )
            if o_p is not None:
                weight = torch.exp(l_p - rows_lse).masked_fill(l_p == _NEG_INF, 0.0)  # a part a row does not see: 0
                per_row = weight * ((do[:, :, t0:t1] * o_p.to(compute)).sum(-1) - row_dot[:, :, t0:t1])
                per_head = per_row.sum(dim=(0, 2))  # (H,)
                dconst[:, direction] += per_head.sum(0, keepdim=True) if values.shape[0] == 1 else per_head
        grad_values = None
        if values.requires_grad:
            grad_values = source.native_grad().to(values.dtype)
            for direction in (0, 1):
                grad_values[:, ctx.const_index[direction]] += (dconst[:, direction] * ctx.bias_scale).to(values.dtype)
        return dq.to(query.dtype), dk.to(key.dtype), dv.to(value.dtype), grad_values, None, None, None, None, None


class StructuredBackend(Backend):
    """Far-constant biases: bias-free fused attention far from the diagonal plus a tiled band."""

    name = "structured"
    summary = "far-constant bias: fused bias-free far parts (CPU flash kernel) plus a tiled band, merged by log-sum-exp; memory O(N·D)"

    def unsupported_reasons(self, call: AttentionCall) -> list[str]:
        if torch.compiler.is_compiling():  # before far_distance(), whose T5 bucket ranges read values
            return ["torch.compile is tracing; structured runs eagerly only (its T5 bucket ranges read values)"]
        reasons = tensor_bias_reasons(call) + dropout_reasons(call, "the fused far parts")
        reasons += tensor_position_reasons(call, "structured")
        bias = call.bias
        if bias is None:
            reasons.append("there is no bias; bias-free attention needs no band (use blockwise or SDPA)")
        elif isinstance(bias, RelativeBias):
            if not bias.offset_only:
                reasons.append(f"{type(bias).__name__} reads absolute positions, so it is not constant far from the diagonal")
            elif far_distance(bias) is None:
                reasons.append(
                    f"{type(bias).__name__} is not constant beyond a distance (T5Bias and PerOffsetBias with "
                    f"out_of_range='clip' are)"
                )
        if call.mask is not None and call.key_padding is None:
            reasons.append(
                "the mask is not a bool key padding mask (B or 1, H or 1, 1, Lk); the fused far parts take only "
                "that (float masks and masks with a query dimension go to blockwise)"
            )
        reasons += cpu_flash_reasons(call)
        return reasons or non_finite_reasons(call, "the fused far parts")

    def auto_reasons(self, call: AttentionCall) -> list[str]:
        return small_block_reasons(call)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
        return structured_attention(call)


def structured_attention(call: AttentionCall, *, block_q: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention with a far-constant bias: fused bias-free far parts + a tiled near band, merged by
    log-sum-exp, on a validated call that :class:`StructuredBackend` accepts. See :func:`relbias.attention`
    for the formula.

    Shapes: query (B, H, Lq, D), key (B, H, Lk, D), value (B, H, Lk, D) -> out (B, H, Lq, D) in the dtype of
    ``query`` and lse (B, H, Lq) float32 (float64 for float64 inputs). ``block_q``: query rows
    per band tile (tokens), default :data:`BLOCK_Q`.

    Precision: parts are merged through their log-sum-exp, which float32 holds to ``|lse| x 2^-24``; with
    scores of order 1e4 (T5's unscaled scores on large activations) that is a relative error of ~1e-3 in
    the merge weights, where the reference (one softmax) stays near 1e-7. float16 inputs therefore run
    in float64; float32 inputs with such scores are better served by the blockwise backend.

    Mask: None or a key padding mask (:attr:`relbias.call.AttentionCall.key_padding`), bool (B or 1,
    H or 1, 1, Lk), True = may attend. Padded keys are hidden from the fused far parts (as their additive
    attn_mask) and from the band tiles; a row that sees no key gets output 0, lse -inf and zero gradients.
    """
    query, key, value, bias, alignment = call.query, call.key, call.value, call.bias, call.alignment
    keep = call.key_padding
    distance = far_distance(bias)
    if keep is not None and bool(keep.all()):
        keep = None  # nothing padded
    # float16 runs in float64: T5's unscaled scores exceed float16's range (design.md, Numerics), and
    # merging parts by their log-sum-exp loses |score| x 2^-24 in float32 (0.004 at scores of 6e4).
    compute = torch.float64 if query.dtype == torch.float16 else compute_dtype(query.dtype)
    block_q = block_q or BLOCK_Q
    native = bias.native(
        alignment.query_len, alignment.key_len, query_start=alignment.query_start, key_start=alignment.key_start,
        device=query.device,
    )
    values, lo, hi = native.values, alignment.min_offset, alignment.max_offset
    bias_scale = call.bias_scale
    source = NativeSource(values, lo, call.delta, bias_scale, compute)
    # Column of each far constant: offset T (past) and -T (future), moved inside the block's offsets.
    const_index = [min(max(distance, lo), hi) - lo, min(max(-distance, lo), hi) - lo]
    band = TileProblem(
        query, key, value, call.scale, source, None if keep is None else keep[:, :, None], call.is_causal, call.delta,
        band_min_offset=-(distance - 1), band_max_offset=distance - 1, block_q=block_q, block_k=block_q + 2 * distance,
        compute=compute,
    )
    parts = far_parts(alignment, distance, call.is_causal)
    return _StructuredFunction.apply(query, key, value, values, band, parts, const_index, bias_scale, keep)
