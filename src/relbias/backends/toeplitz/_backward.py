"""The toeplitz backend's backward when the bias has parameters: dq, dk, dv and the bias gradient in one tiled pass.

PyTorch's CPU flash kernel never exposes ``dS``, so its backward plus a second pass for the bias gradient recomputed
the scores and ``dP`` twice (7 matrix products per tile). Here each (query tile, key tile) forms them once
(FlashAttention, Dao et al. 2022, Alg. 2; five matrix products):

    P = exp(scale q k^T + PE - lse),   dS = P * (dO v^T - D),   D_i = dO_i . O_i (minus an lse gradient)
    dv += P^T dO,   dq += scale dS k,   dk += scale dS^T q,   dPE(t) += sum_{i - j = t} dS_ij

Query rows are reversed per tile, so the tile's bias is the strided view of the reversed values ``w`` that the
forward uses (entry (a, s) is ``w[c + a + s]``) and its diagonals are anti-diagonals: ``dS`` is written into a
buffer with ``bq`` zero columns after each row, where a view of row stride ``bq + bk - 1`` reads each anti-diagonal
as one row; tiles are summed in a fixed order (deterministic). Memory: the three gradients plus a few tiles.
"""

from __future__ import annotations

import torch

from ._view import block_mask, key_end

__all__ = ["tiled_backward"]

_NEG_INF = float("-inf")
#: Scores are clamped to this before exp: e^-87 = 1.6e-38, float32's smallest normals. torch's vectorised exp takes
#: a scalar slow path on denormal and -inf results (15-160x per tile, measured); e^-87 is below 2^-125 of a row's
#: largest term. Where a score is -inf (a causal call's future keys), P is then set to exactly 0.
EXP_FLOOR = -87.0


def tiled_backward(
    do: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, grad_lse: torch.Tensor | None, w: torch.Tensor, plan: dict, *,
    key_padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, grad_w) for the toeplitz forward; ``grad_w`` (Hb, M) is the gradient of the reversed, scaled bias
    ``w`` (Hb, M) (future offsets: -inf in ``w``, whatever value their gradient gets here).

    Shapes: ``do``, ``query``, ``out`` (B, H, Lq, D) and ``key``, ``value`` (B, H, Lk, D) in one float dtype; ``lse``
    (B, H, Lq) float32 / float64, -inf for a query that sees no key; ``grad_lse`` None or like ``lse``. ``plan``:
    scale, delta, is_causal, tile (rows and keys per tile, tokens). Bias values are finite (the families validate
    them), so the only -inf scores are a causal call's future keys and the keys ``key_padding`` pads (None or an
    additive (Bm, Hm, Lk) row, 0 or -inf; tiles whose keys are all padded are skipped). The gradients are contiguous.
    """
    scale, delta, is_causal, tile = plan["scale"], plan["delta"], plan["is_causal"], plan["tile"]
    b, h, lq, _ = query.shape
    lk = key.shape[2]
    bh, dtype = b * h, query.dtype
    dq, dk, dv = (torch.zeros(t.shape, dtype=dtype, device=t.device) for t in (query, key, value))  # contiguous
    dk3, dv3 = dk.view(bh, lk, -1), dv.view(bh, lk, -1)
    key3, value3 = key.reshape(bh, lk, -1), value.reshape(bh, lk, -1)
    grad_w = torch.zeros(w.shape, dtype=dtype, device=w.device)
    pads: dict[tuple[int, int], torch.Tensor] = {}  # zeroed once: each tile writes the same entries
    for i0 in range(0, lq, tile):
        i1 = min(lq, i0 + tile)
        end = key_end(i1, delta, lk, is_causal)
        if end == 0:
            continue
        q_rows, do_rows, lse_rows, row_dot = _query_tile(do, query, out, lse, grad_lse, i0, i1, scale)
        dq_rows = torch.zeros_like(q_rows)
        bq = i1 - i0
        for k0 in range(0, end, tile):
            k1 = min(end, k0 + tile)
            bk = k1 - k0
            keys, values = key3[:, k0:k1], value3[:, k0:k1]
            bias = block_mask(w, lq, i0, i1, k0, k1)  # (1, Hb, bq, bk) view
            padded = None if key_padding is None else torch.isneginf(key_padding[:, :, None, k0:k1])
            if padded is not None and bool(padded.all()):  # no query sees these keys
                continue
            p = (bias - lse_rows).view(bh, bq, bk).baddbmm_(q_rows, keys.transpose(-1, -2))
            p = p.clamp_(min=EXP_FLOOR).exp_()
            if is_causal and k1 > i0 + delta + 1:  # a diagonal tile: its future keys read -inf
                p.view(b, h, bq, bk).masked_fill_(torch.isneginf(bias), 0.0)
            if padded is not None:
                p.view(b, h, bq, bk).masked_fill_(padded, 0.0)
            pad = pads.get((bq, bk))
            if pad is None:
                pad = pads[(bq, bk)] = torch.zeros(bh, bq, bk + bq, dtype=dtype, device=w.device)
            ds = pad[:, :, :bk]
            dp = torch.baddbmm(row_dot.expand(bh, bq, bk), do_rows, values.transpose(-1, -2), beta=-1)
            torch.mul(dp, p, out=ds)
            del dp
            dv3[:, k0:k1].baddbmm_(p.transpose(-1, -2), do_rows)
            dq_rows.baddbmm_(ds, keys)
            dk3[:, k0:k1].baddbmm_(ds.transpose(-1, -2), q_rows)
            width = bq + bk - 1  # anti-diagonal c of the tile holds the entries a + s = c
            sums = pad.as_strided((bh, width, bq), (bq * (bk + bq), 1, bk + bq - 1)).sum(-1)
            sums = sums.view(b, h, width).sum(0)
            start = lq - i1 + k0
            grad_w[:, start:start + width] += sums if w.shape[0] == h else sums.sum(0, keepdim=True)
        dq[:, :, i0:i1] = dq_rows.view(b, h, bq, -1).flip(2).mul_(scale)
    return dq, dk, dv, grad_w


def _query_tile(do, query, out, lse, grad_lse, i0, i1, scale):
    """Query rows i1-1 down to i0 as (B·H, bq, ·) tensors: scale·q, dO, lse (+inf where a query sees no key, so its
    P is 0) and D (B·H, bq, 1); rows that see no key get dO = D = 0, so their dS is exactly 0."""
    b, h = query.shape[:2]
    bq = i1 - i0
    rows = slice(i0, i1)
    q_rows = (query[:, :, rows].flip(2) * scale).reshape(b * h, bq, -1)  # a copy: kept whole, so contiguous
    do_rows, lse_rows = do[:, :, rows].flip(2), lse[:, :, rows].flip(2)
    row_dot = (do_rows * out[:, :, rows].flip(2)).sum(-1, dtype=lse.dtype)
    if grad_lse is not None:  # an lse gradient g enters as D_i - g_i
        row_dot = row_dot - grad_lse[:, :, rows].flip(2)
    empty = lse_rows == _NEG_INF
    if bool(empty.any()):  # (B, H, bq) bools: cheap
        do_rows, row_dot = do_rows.masked_fill(empty[..., None], 0.0), row_dot.masked_fill(empty, 0.0)
    lse_rows = lse_rows.masked_fill(empty, float("inf")).to(query.dtype)[..., None]
    do_rows = do_rows.reshape(b * h, bq, -1)
    return q_rows, do_rows, lse_rows, row_dot.to(query.dtype).view(b * h, bq, 1)
