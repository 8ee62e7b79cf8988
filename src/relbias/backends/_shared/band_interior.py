"""Interior query blocks of a diagonal band, batched: many tiles per PyTorch call.

In a band of offsets ``[lo, hi]`` every interior query block (one whose key window lies inside the
keys) sees the same offset pattern, so its bias tile is the same, and its key window is a strided view
of the keys (``as_strided``, no copy). Doing a chunk of such blocks in one batched matmul replaces
dozens of small calls, whose per-call threading overhead dominates on a loaded CPU, by a few large
ones. Edge blocks go through the generic tile loop. Gradients of overlapping key windows are added
back per window segment, each segment a non-overlapping strided view: deterministic. A bool key padding
mask (query dimension 1) is applied per window, from a strided view of it as well.
"""

from __future__ import annotations

import torch

__all__ = ["interior_blocks", "interior_forward", "interior_backward"]

#: Scores per chunk (B·H·blocks·block_q·window); 2M float32 scores = 8 MiB per score-sized temporary.
CHUNK_SCORES = 1 << 21


def interior_blocks(problem) -> tuple[int, int, int]:
    """(first, stop, window): query-block indices whose whole key window ``[t0 + delta - hi, +window)``
    is inside the keys, for a band problem (finite limits; no mask or a bool key padding mask); (0, 0, 0)
    when batching does not apply."""
    mask = problem.mask
    if mask is not None and (mask.dtype != torch.bool or mask.shape[-2] != 1):
        return 0, 0, 0
    if getattr(problem, "dropout", None) is not None:  # the generic tile loop applies dropout
        return 0, 0, 0
    if problem.band_min_offset is None or problem.band_max_offset is None:
        return 0, 0, 0
    if problem.source is not None and not getattr(problem.source, "translation_invariant", False):
        return 0, 0, 0
    lo, hi = problem.offset_limits()
    lq, lk, bq = problem.query.shape[2], problem.key.shape[2], problem.block_q
    window = bq + int(hi - lo)
    shift = problem.delta - int(hi)  # window start of block j is j * bq + shift
    first = (-shift + bq - 1) // bq if shift < 0 else 0  # smallest j with j*bq + shift >= 0
    stop = min(lq // bq, (lk - window - shift) // bq + 1) if lk - window - shift >= 0 else 0
    if stop - first < 2:
        return 0, 0, 0
    return first, stop, window


def _windows(x: torch.Tensor, start: int, blocks: int, step: int, window: int) -> torch.Tensor:
    """(B, H, blocks, window, D) overlapping view: block j covers rows ``start + j*step`` .. ``+ window``."""
    b, h, _, d = x.shape
    sb, sh, sl, sd = x.stride()
    return x.as_strided((b, h, blocks, window, d), (sb, sh, step * sl, sl, sd), x.storage_offset() + start * sl)


def _chunks(problem, first: int, stop: int, window: int, scores: int = CHUNK_SCORES):
    b, h = problem.query.shape[:2]
    per_block = b * h * problem.block_q * window
    size = max(1, scores // per_block)
    for j0 in range(first, stop, size):
        yield j0, min(stop, j0 + size)


def _scores(problem, j0: int, j1: int, window: int, tile: torch.Tensor | None):
    """Query blocks j0:j1 (B, H, n, bq, D) in ``compute`` and their scores (B, H, n, bq, W)."""
    bq, c = problem.block_q, problem.compute
    shift = problem.delta - int(problem.offset_limits()[1])
    b, h, _, d = problem.query.shape
    q = problem.query[:, :, j0 * bq : j1 * bq].to(c).reshape(b, h, j1 - j0, bq, d)
    k = _windows(problem.key, j0 * bq + shift, j1 - j0, bq, window).to(c)
    s = torch.matmul(q * problem.scale if problem.scale != 1.0 else q, k.transpose(-2, -1))  # (B, H, n, bq, W)
    if tile is not None:
        s.add_(tile.unsqueeze(-3))  # (Hb, bq, W) -> (Hb, 1, bq, W)
    if problem.mask is not None:  # (Bm, Hm, 1, Lk) key padding mask -> (Bm, Hm, n, 1, W) windows
        keep = problem.mask[:, :, 0]
        if keep.shape[-1] == 1:
            keep = keep.expand(*keep.shape[:2], problem.key.shape[2])
        sb, sh, sl = keep.stride()
        windows = keep.as_strided(
            (keep.shape[0], keep.shape[1], j1 - j0, window), (sb, sh, bq * sl, sl),
            keep.storage_offset() + (j0 * bq + shift) * sl,
        )
        s.masked_fill_(~windows[:, :, :, None, :], float("-inf"))
    return q, s


def interior_forward(problem, out: torch.Tensor, lse: torch.Tensor, first: int, stop: int, window: int) -> None:
    """Fill ``out`` (B, H, Lq, Dv) and ``lse`` (B, H, Lq) for the rows of blocks ``first:stop``.

    ``lse = max - log(max softmax probability)``: the largest probability of a row is
    ``exp(max - lse)``, so one fused softmax gives both the probabilities and the log-sum-exp.
    """
    bq, c = problem.block_q, problem.compute
    shift = problem.delta - int(problem.offset_limits()[1])
    tile = problem._additive_tile(first * bq, first * bq + bq, first * bq + shift, first * bq + shift + window)
    b, h = problem.query.shape[:2]
    for j0, j1 in _chunks(problem, first, stop, window):
        _, s = _scores(problem, j0, j1, window, tile)
        m = s.amax(dim=-1)  # finite unless a key padding mask hides the row's whole window
        p = torch.softmax(s, dim=-1)
        del s
        empty = None
        if problem.mask is not None:  # rows with every key hidden: softmax gives NaN; want out 0, lse -inf
            empty = m == float("-inf")
            p = p.masked_fill_(empty[..., None], 0.0)
        v = _windows(problem.value, j0 * bq + shift, j1 - j0, bq, window).to(c)
        o = torch.matmul(p, v)  # (B, H, n, bq, Dv), normalised
        out[:, :, j0 * bq : j1 * bq] = o.reshape(b, h, -1, o.shape[-1])
        row_lse = m - torch.log(p.amax(dim=-1))
        if empty is not None:
            row_lse = row_lse.masked_fill_(empty, float("-inf"))
        lse[:, :, j0 * bq : j1 * bq] = row_lse.reshape(b, h, -1)


def interior_backward(problem, grad_out, lse, row_dot, dq, dk, dv, first: int, stop: int, window: int) -> None:
    """Add the gradients of blocks ``first:stop`` into dq, dk, dv and the bias source (as tiled_backward)."""
    bq, c = problem.block_q, problem.compute
    shift = problem.delta - int(problem.offset_limits()[1])
    t_first = first * bq
    tile = problem._additive_tile(t_first, t_first + bq, t_first + shift, t_first + shift + window)
    b, h, _, d = problem.query.shape
    dvv = grad_out.shape[-1]
    bias_acc = None
    for j0, j1 in _chunks(problem, first, stop, window, CHUNK_SCORES // 2):  # ~6 score-sized temporaries
        n = j1 - j0
        q, s = _scores(problem, j0, j1, window, tile)
        rows = slice(j0 * bq, j1 * bq)
        p = torch.exp(s.sub_(lse[:, :, rows].reshape(b, h, n, bq, 1)))
        do = grad_out[:, :, rows].reshape(b, h, n, bq, dvv)
        v = _windows(problem.value, j0 * bq + shift, n, bq, window).to(c)
        k = _windows(problem.key, j0 * bq + shift, n, bq, window).to(c)
        dv_w = torch.matmul(p.transpose(-2, -1), do)  # (B, H, n, W, Dv)
        ds = p.mul_(torch.matmul(do, v.transpose(-2, -1)).sub_(row_dot[:, :, rows].reshape(b, h, n, bq, 1)))
        if problem.source is not None:
            g = ds.sum(dim=(0, 2))  # (H, bq, W): every interior block has the same offsets
            bias_acc = g if bias_acc is None else bias_acc.add_(g)
        dq[:, :, rows] += torch.matmul(ds, k).mul_(problem.scale).reshape(b, h, n * bq, d)
        dk_w = torch.matmul(ds.transpose(-2, -1), q).mul_(problem.scale)  # (B, H, n, W, D)
        # Windows overlap; add them back one bq-wide segment at a time (segments of one index do not).
        for u in range(0, window, bq):
            width = min(bq, window - u)
            start = j0 * bq + shift + u
            _windows(dk, start, n, bq, width).add_(dk_w[..., u : u + width, :])
            _windows(dv, start, n, bq, width).add_(dv_w[..., u : u + width, :])
    if bias_acc is not None:
        problem.source.add_grad(bias_acc[None], t_first, t_first + shift)
