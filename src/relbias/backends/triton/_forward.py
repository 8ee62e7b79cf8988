"""The forward kernel: FlashAttention-2's forward (Dao 2023, Alg. 1) with the bias read per offset.

One program per (query tile, head, sequence) runs the online softmax over the key tiles its queries may see (tiles
wholly outside the band of the causal rule and a window are never visited; key tiles wholly padded are skipped),
reading the bias of entry
(i, j) from the head's per-offset values at ``i - j + value_offset``: no (Lq, Lk) tensor exists. Dropout multiplies
the probabilities by the counter-based mask after the row sums, as :mod:`relbias._dropout` defines it. Returns the
output and the natural log-sum-exp of each query's scores (-inf, with output 0, for a query that sees no key).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._plan import Plan, launch_args
from ._tiles import keep_mask, key_row, key_tiles, sequence, tile_scores

__all__ = ["forward"]


@triton.jit
def _forward_kernel(
    Q, K, V, W, PAD, CU, SEEDS, OUT, LSE,
    sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sob, soh, sol, slb, slh, swh, spb, sph,
    Lq, Lk, D, DV, scale, bias_scale, delta, val_off, lo, hi, query_pos, key_pos, drop_threshold, drop_scale,
    batch_seed, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_VARLEN: tl.constexpr, SEED_IN_MEMORY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    h = tl.program_id(1)
    b, q0, k0, lq, lk, seed = sequence(CU, SEEDS, batch_seed, tl.program_id(2), Lq, Lk, IS_VARLEN, SEED_IN_MEMORY)
    start_m = tl.program_id(0) * BLOCK
    if start_m < lq:
        offs_m = start_m + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        rows = offs_m < lq
        q = tl.load(Q + b * sqb + h * sqh + (q0 + offs_m)[:, None] * sql + offs_d[None, :],
                    mask=rows[:, None] & (offs_d[None, :] < D), other=0.0)
        k_base = K + b * skb + h * skh + k0 * skl
        v_base = V + b * svb + h * svh + k0 * svl
        w_row = W + h * swh
        m_i = tl.full((BLOCK,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK,), tl.float32)
        acc = tl.zeros((BLOCK, BLOCK_DV), tl.float32)
        begin, end = key_tiles(start_m, lk, delta, lo, hi, BLOCK, HAS_LO, HAS_HI)
        for start_n in range(begin, end, BLOCK):
            offs_n = start_n + tl.arange(0, BLOCK)
            kp, any_kept = key_row(PAD, b, h, spb, sph, offs_n, lk, HAS_PAD)
            if any_kept:
                k = tl.load(k_base + offs_n[:, None] * skl + offs_d[None, :],
                            mask=(offs_n[:, None] < lk) & (offs_d[None, :] < D), other=0.0)
                v = tl.load(v_base + offs_n[:, None] * svl + offs_dv[None, :],
                            mask=(offs_n[:, None] < lk) & (offs_dv[None, :] < DV), other=0.0)
                s, visible = tile_scores(q, k, w_row, kp, offs_m, offs_n, lq, lk, delta, val_off, lo, hi, scale,
                                         bias_scale, HAS_LO, HAS_HI, HAS_PAD, PRECISION)
                m_new = tl.maximum(m_i, tl.max(s, 1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, 1)
                if HAS_DROPOUT:
                    keep = keep_mask(seed, b, h, query_pos + offs_m, key_pos + offs_n, drop_threshold)
                    p = tl.where(keep, p * drop_scale, 0.0)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        lse = tl.where(seen, m_i + tl.log(tl.where(seen, l_i, 1.0)), float("-inf"))
        tl.store(OUT + b * sob + h * soh + (q0 + offs_m)[:, None] * sol + offs_dv[None, :],
                 out.to(OUT.dtype.element_ty), mask=rows[:, None] & (offs_dv[None, :] < DV))
        tl.store(LSE + b * slb + h * slh + q0 + offs_m, lse, mask=rows)


def forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, w: torch.Tensor,
            padding: torch.Tensor | None, plan: Plan) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, H, Lq, Dv) in the dtype of ``query``, lse (B, H, Lq) float32).

    ``query`` (B, H, Lq, D), ``key`` (B, H, Lk, D), ``value`` (B, H, Lk, Dv), each with unit stride along its
    last dimension (B = 1 and Lq = Lk = T when packed); ``w`` (Hb, M) float32 contiguous: the per-offset bias
    (Hb 1 or H); ``padding``: None or uint8 (Bm, Hm, Lk) with unit last stride, nonzero where a key is kept."""
    b, h, lq, _ = query.shape
    dv = value.shape[-1]
    out = torch.empty(b, h, lq, dv, dtype=query.dtype, device=query.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=query.device)
    pointers, args, meta = launch_args(plan, query, key, value, out, lse, w, padding)
    _forward_kernel[(plan.tiles(lq), h, plan.sequences(query))](query, key, value, *pointers, out, lse, *args, **meta)
    return out, lse
