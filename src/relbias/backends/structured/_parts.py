"""The structured backend's fused far parts: the regions of a block beyond a far-constant bias's distance as
bias-free CPU flash-kernel slices (full rectangles, and top-left causal squares, mirrored for the future side), their
forward and backward, and the log-sum-exp merge of a part into the running result. See
:mod:`relbias.backends.structured` for the method."""

from __future__ import annotations

import torch

from ...positions import Alignment
from .._shared.cpu_flash import fused_backward, fused_forward
from .._shared.masks import additive_mask

__all__ = ["HEAD_GROUP", "empty_rows", "far_parts", "merge_part", "part_backward", "run_part"]

_NEG_INF = float("-inf")


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


def empty_rows(keep: torch.Tensor, mode: str, rows: int) -> torch.Tensor:
    """(Bm, Hm, rows or 1) bool: the part's rows that see no unpadded key, from its (Bm, Hm, keys) key mask."""
    if mode == "full":
        return ~keep.any(dim=-1, keepdim=True)
    seen = keep.flip(-1).cumsum(-1).flip(-1) if mode == "upper" else keep.cumsum(-1)  # square parts: rows == keys
    return seen[..., :rows] == 0


def _heads(mask: torch.Tensor | None, heads: slice) -> torch.Tensor | None:
    """Mirror (along keys) the heads ``heads`` of a (Bm, Hm, 1, keys) mask; Hm = 1 broadcasts."""
    if mask is None:
        return None
    return (mask[:, heads] if mask.shape[1] > 1 else mask).flip(-1)


def run_part(q, k, v, mode, scale, keep=None):
    """(out (B, H, rows, Dv) input dtype, or float32 for float16 inputs; lse (B, H, rows) float) of one far part.

    float16 parts run on float64 copies (see :func:`structured_attention`). ``keep``: the part's
    (Bm, Hm, keys) key padding mask or None; rows that see no kept key get out 0 and lse -inf.
    """
    if q.dtype == torch.float16:
        q, k, v = q.double(), k.double(), v.double()
    mask = additive_mask(keep, q.dtype)
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
        empty = empty_rows(keep, mode, q.shape[2])
        lse = lse.masked_fill(empty, _NEG_INF)
        out = out.masked_fill(empty[..., None], 0.0)
    return out, lse


def part_backward(do, q, k, v, out, lse, mode, scale, dq, dk, dv, keep=None, lse_grad=None):
    """Add this part's share of the gradients into the (B, H, rows / keys, D) slices dq, dk, dv.

    ``lse``: the global log-sum-exp minus the part's constant, +inf on rows that must get no gradient
    (then the kernel's ``p = exp(s - lse)`` is 0). ``keep``: as :func:`_run_part`. ``lse_grad``: the
    gradient (B, H, rows) of the global lse, or None (see :func:`fused_backward`).
    """
    if q.dtype == torch.float16:  # as in _run_part
        q, k, v = q.double(), k.double(), v.double()
    mask = additive_mask(keep, q.dtype)
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


def merge_part(out, lse, rows, part_out, part_lse):
    """Fold a part (out (B, H, r, Dv), lse (B, H, r)) into the running (out, lse) at ``rows``, in place."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, part_lse)
    safe = new.masked_fill(new == _NEG_INF, 0.0)  # rows with no key yet in either: weights exp(-inf) = 0
    target = out[:, :, rows]
    target.mul_(torch.exp(old - safe)[..., None]).add_(part_out * torch.exp(part_lse - safe)[..., None])
    lse[:, :, rows] = new
