"""The tiled attention kernel in plain PyTorch: online softmax over key blocks, recompute in backward.

Used by the blockwise backend (every key) and by the structured backend (only the band of offsets
near the diagonal). Memory: one (B, H, block_q, block_k) score tile at a time plus O(B·H·L·D)
accumulators; nothing of size (Lq, Lk) is built.

Formulas (one query row i, visible keys j, scores ``s_ij`` already including bias and scale):
forward ``lse_i = log sum_j exp(s_ij)``, ``o_i = sum_j exp(s_ij - lse_i) v_j``; backward, given the
row's *global* log-sum-exp ``L_i`` (over every part of a decomposition) and ``D_i = dO_i . O_i``:
``p_ij = exp(s_ij - L_i)``, ``dS_ij = p_ij (dO_i . v_j - D_i)``, ``dq_i = scale sum_j dS_ij k_j``,
``dk_j = scale sum_i dS_ij q_i``, ``dv_j = sum_i p_ij dO_i`` (Dao et al. 2022, FlashAttention, Alg. 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .band_interior import interior_backward, interior_blocks, interior_forward
from .bias_tiles import mask_tile

__all__ = ["TileProblem", "tiled_backward", "tiled_forward"]

_NEG_INF = float("-inf")


@dataclass
class TileProblem:
    """One attention problem for the tiled kernel.

    Attributes:
        query, key, value: (B, H, Lq, D), (B, H, Lk, D), (B, H, Lk, Dv); any float dtype (tiles are cast
            to ``compute``).
        scale: multiplier of q . k.
        source: bias tiles (:class:`NativeSource` / :class:`PairSource`) or None.
        mask: 4-D bool or float mask broadcastable to (B, H, Lq, Lk), or None.
        is_causal: hide offsets < 0.
        delta: query_start - key_start (tokens); the offset of tile entry (t, s) is ``delta + t - s``.
        band_min_offset, band_max_offset: only offsets in this inclusive range are attended (the structured
            backend's band); None = unbounded.
        block_q, block_k: tile sizes.
        compute: float32, or float64 for float64 inputs.
        dropout: None or a :class:`relbias._dropout.Dropout` (the generic tile loop applies it; the batched
            band path does not, so band problems never carry one).
    """

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    scale: float
    source: object | None
    mask: torch.Tensor | None
    is_causal: bool
    delta: int
    band_min_offset: int | None = None
    band_max_offset: int | None = None
    block_q: int = 256
    block_k: int = 1024
    compute: torch.dtype = torch.float32
    careful: bool = False  # keys/values hold NaN/inf: confine them to the queries that see them
    dropout: object | None = None  # relbias._dropout.Dropout: probabilities times its counter-based mask
    _cache: dict = field(default_factory=dict, repr=False)
    _skip: tuple[int, int] = (0, 0)  # query blocks done by the batched interior path

    def offset_limits(self) -> tuple[float, float]:
        lo = float("-inf") if self.band_min_offset is None else self.band_min_offset
        if self.is_causal:
            lo = max(lo, 0)
        hi = float("inf") if self.band_max_offset is None else self.band_max_offset
        return lo, hi

    def query_blocks(self):
        """Yield (t0, t1, s_lo, s_hi): each query block and the key range that can be visible to it."""
        lq, lk = self.query.shape[2], self.key.shape[2]
        lo, hi = self.offset_limits()
        bq = self.block_q
        if self._skip[1] > self._skip[0]:  # the rest of a batched band: one block before, one after
            piece = 4 * bq  # few calls, bounded tile memory
            starts = [(t0, min(self._skip[0] * bq, t0 + piece)) for t0 in range(0, self._skip[0] * bq, piece)]
            starts += [(t0, min(lq, t0 + piece)) for t0 in range(self._skip[1] * bq, lq, piece)]
        else:
            starts = [(t0, min(lq, t0 + bq)) for t0 in range(0, lq, bq)]
        for t0, t1 in starts:
            if t1 <= t0:
                continue
            # offset delta + t - s in [lo, hi]  <=>  s in [t + delta - hi, t + delta - lo]
            s_lo = 0 if hi == float("inf") else max(0, int(t0 + self.delta - hi))
            s_hi = lk if lo == float("-inf") else min(lk, int(t1 - 1 + self.delta - lo) + 1)
            if s_hi > s_lo:
                yield t0, t1, s_lo, s_hi

    def key_blocks(self, s_lo: int, s_hi: int):
        for s0 in range(s_lo, s_hi, self.block_k):
            yield s0, min(s_hi, s0 + self.block_k)

    def _additive_tile(self, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor | None:
        """Bias (scaled) plus -inf at offsets outside the attended range: (Hb or 1, Tq, Tk), or None.

        For a translation-invariant source it depends only on the tile's size and on ``delta + t0 - s0``,
        so equal tiles (e.g. every interior tile of the band) are computed once per pass and cached.
        """
        invariant = self.source is None or getattr(self.source, "translation_invariant", False)
        key = (t1 - t0, s1 - s0, self.delta + t0 - s0)
        if invariant and key in self._cache:
            return self._cache[key]
        tile = None if self.source is None else self.source.tile(t0, t1, s0, s1)
        lo, hi = self.offset_limits()
        tile_lo, tile_hi = self.delta + t0 - (s1 - 1), self.delta + (t1 - 1) - s0
        if tile_lo < lo or tile_hi > hi:
            device = self.query.device
            off = torch.arange(t0, t1, device=device)[:, None] - torch.arange(s0, s1, device=device)[None, :]
            off = off + self.delta
            hidden = (off < lo) | (off > hi)
            if tile is None:
                tile = torch.zeros(1, t1 - t0, s1 - s0, dtype=self.compute, device=device)
            tile = tile.masked_fill(hidden, _NEG_INF)
        if invariant:
            if len(self._cache) >= 8:
                self._cache.clear()
            self._cache[key] = tile
        return tile

    def dropout_tile(self, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor:
        """(B, H, Tq, Tk) dropout factors (0 or 1 / (1 - p)) of the tile, regenerated from the counter-based mask."""
        b, h = self.query.shape[:2]
        return self.dropout.scale_tile(b, h, t0, t1, s0, s1, self.query.device, self.compute)

    def clear_cache(self) -> None:
        """Drop the cached tiles (called at the end of each pass, so nothing of them is kept for backward)."""
        self._cache = {}

    def scores(self, q: torch.Tensor, t0: int, t1: int, s0: int, s1: int) -> torch.Tensor:
        """Scores of a tile, (B, H, Tq, Tk) in ``compute``, with -inf at hidden entries."""
        k = self.key[:, :, s0:s1].to(self.compute)
        s = torch.matmul(q, k.transpose(-2, -1)).mul_(self.scale)
        tile = self._additive_tile(t0, t1, s0, s1)
        hidden = None
        if tile is not None:
            s.add_(tile)
            if self.careful:
                hidden = tile == _NEG_INF
        if self.mask is not None:
            m = mask_tile(self.mask, t0, t1, s0, s1)
            if m.dtype == torch.bool:
                s = s.masked_fill(~m, _NEG_INF)
            else:
                s = s + m.to(self.compute)  # finite values add; -inf entries hide the key
                if self.careful:
                    hidden = (m == _NEG_INF) if hidden is None else hidden | (m == _NEG_INF)
        if hidden is not None:  # a NaN score (inf key) of a hidden entry must not survive
            s = s.masked_fill(hidden, _NEG_INF)
        return s


def visible_matmul(weights: torch.Tensor, scores: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weights @ x`` summing only entries with ``scores != -inf``: (..., Tq, Tk) x (..., Tk, D) -> (..., Tq, D).

    Used when keys or values hold NaN/inf, where ``0 * inf = NaN`` would leak a hidden key into every row.
    Memory (..., Tq, Tk, D): callers use small tiles.
    """
    visible = (scores != _NEG_INF)[..., None]
    return torch.where(visible, weights[..., None] * x[..., None, :, :], 0.0).sum(dim=-2)


def tiled_forward(problem: TileProblem) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the forward pass.

    Returns:
        out: (B, H, Lq, Dv) in ``problem.compute``, normalised over the attended keys; 0 for rows
            with none.
        lse: (B, H, Lq) in ``problem.compute``, log-sum-exp of the attended scores; -inf for rows with
            none.
    """
    q_all, v_all = problem.query, problem.value
    b, h, lq, _ = q_all.shape
    dv = v_all.shape[-1]
    out = torch.zeros(b, h, lq, dv, dtype=problem.compute, device=q_all.device)
    lse = torch.full((b, h, lq), _NEG_INF, dtype=problem.compute, device=q_all.device)
    first, stop, window = interior_blocks(problem)
    problem._skip = (first, stop)
    if stop > first:
        interior_forward(problem, out, lse, first, stop, window)
    for t0, t1, s_lo, s_hi in problem.query_blocks():
        q = q_all[:, :, t0:t1].to(problem.compute)
        m = denom = acc = None
        for s0, s1 in problem.key_blocks(s_lo, s_hi):
            s = problem.scores(q, t0, t1, s0, s1)
            v = v_all[:, :, s0:s1].to(problem.compute)
            m_new = s.amax(dim=-1) if m is None else torch.maximum(m, s.amax(dim=-1))
            m_safe = m_new.masked_fill(m_new == _NEG_INF, 0.0)  # rows with nothing visible yet
            p = torch.exp(s.sub_(m_safe[..., None]))
            kept = p if problem.dropout is None else p * problem.dropout_tile(t0, t1, s0, s1)
            pv = visible_matmul(kept, s, v) if problem.careful else torch.matmul(kept, v)
            if m is None:
                denom, acc = p.sum(dim=-1), pv
            else:
                alpha = torch.exp(m - m_safe)
                denom = denom * alpha + p.sum(dim=-1)
                acc = acc * alpha[..., None] + pv
            m = m_new
        has = denom > 0
        out[:, :, t0:t1] = acc / torch.where(has, denom, torch.ones_like(denom))[..., None]
        m_safe = m.masked_fill(~has, 0.0)
        lse[:, :, t0:t1] = torch.where(has, m_safe + torch.log(torch.where(has, denom, torch.ones_like(denom))), m)
    problem.clear_cache()
    return out, lse


def tiled_backward(
    problem: TileProblem, grad_out: torch.Tensor, lse: torch.Tensor, row_dot: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of this problem's share of the attention, given the global row statistics.

    Args:
        grad_out: (B, H, Lq, Dv) in ``compute``, dL/dO of the (possibly merged) output.
        lse: (B, H, Lq), the global log-sum-exp of each row (-inf: no visible key anywhere).
        row_dot: (B, H, Lq), ``D_i = dO_i . O_i`` with O the merged output.

    Returns:
        dq (B, H, Lq, D), dk (B, H, Lk, D), dv (B, H, Lk, Dv) in ``compute``; bias gradients are
        accumulated into ``problem.source``. Deterministic: fixed loop order, no atomics.
    """
    q_all, k_all, v_all = problem.query, problem.key, problem.value
    c = problem.compute
    dq = torch.zeros(q_all.shape, dtype=c, device=q_all.device)
    dk = torch.zeros(k_all.shape, dtype=c, device=q_all.device)
    dv = torch.zeros(v_all.shape, dtype=c, device=q_all.device)
    lse_safe = lse.masked_fill(lse == _NEG_INF, float("inf"))  # rows with no key: p = exp(-inf) = 0
    first, stop, window = interior_blocks(problem)
    problem._skip = (first, stop)
    if stop > first:
        interior_backward(problem, grad_out, lse_safe, row_dot, dq, dk, dv, first, stop, window)
    for t0, t1, s_lo, s_hi in problem.query_blocks():
        q = q_all[:, :, t0:t1].to(c)
        do = grad_out[:, :, t0:t1]
        row_lse, row_d = lse_safe[:, :, t0:t1, None], row_dot[:, :, t0:t1, None]
        for s0, s1 in problem.key_blocks(s_lo, s_hi):
            k, v = k_all[:, :, s0:s1].to(c), v_all[:, :, s0:s1].to(c)
            s = problem.scores(q, t0, t1, s0, s1)
            p = torch.exp(s - row_lse)  # (B, H, Tq, Tk)
            dp = torch.matmul(do, v.transpose(-2, -1))  # dO_i . v_j
            if problem.dropout is None:
                dv[:, :, s0:s1] += torch.matmul(p.transpose(-2, -1), do)
            else:  # out_i = sum_j p_ij z_ij v_j: dv_j = sum_i p_ij z_ij dO_i, dP_ij = z_ij dO_i . v_j
                z = problem.dropout_tile(t0, t1, s0, s1)
                dv[:, :, s0:s1] += torch.matmul((p * z).transpose(-2, -1), do)
                dp = dp * z
            ds = p * (dp - row_d)
            if problem.careful:
                ds = ds.masked_fill(s == _NEG_INF, 0.0)
            if problem.source is not None:
                problem.source.add_grad(ds, t0, s0)
            dq_tile = visible_matmul(ds, s, k) if problem.careful else torch.matmul(ds, k)
            dq[:, :, t0:t1] += dq_tile.mul_(problem.scale)
            dk[:, :, s0:s1] += torch.matmul(ds.transpose(-2, -1), q).mul_(problem.scale)
    problem.clear_cache()
    return dq, dk, dv
