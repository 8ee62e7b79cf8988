"""The backward kernels for dq, dk and dv: FlashAttention-2's backward (Dao 2023, Alg. 2), deterministic.

Two kernels, neither with atomics: one program per (key tile, head, sequence) walks the query tiles that see its keys
and accumulates dk and dv; one per (query tile, head, sequence) walks the key tiles its queries see and accumulates
dq (both visit only the tiles the band of the causal rule and a window reaches, as the forward). Both recompute
``P = exp(s - lse)`` from the forward's log-sum-exp (``+inf`` for a query that saw no key, so its P is 0) and form
``dS = P * (dP - D)`` with ``D = dO . out - grad_lse``; dropout regenerates the forward's mask. The bias-table
gradient is :mod:`relbias.backends.triton._bias_grad`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._plan import Plan, launch_args
from ._tiles import keep_mask, key_row, key_tiles, query_tiles, sequence, tile_scores

__all__ = ["backward_dkdv", "backward_dq", "load_keys", "load_rows", "score_grad_tile"]


@triton.jit
def score_grad_tile(q, k, v, do, lse, di, w_row, kp, offs_m, offs_n, lq, lk, delta, val_off, lo, hi, scale,
                    bias_scale, seed, b, h, query_pos, key_pos, drop_threshold, drop_scale,
                    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                    PRECISION: tl.constexpr):
    """(P after dropout, dS) of one tile, both (M, N) float32: the probabilities that multiplied the values, and
    the gradient of the scores ``dS = P * (dP - D)`` (before the score scale)."""
    s, visible = tile_scores(q, k, w_row, kp, offs_m, offs_n, lq, lk, delta, val_off, lo, hi, scale, bias_scale,
                             HAS_LO, HAS_HI, HAS_PAD, PRECISION)
    p = tl.exp(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if HAS_DROPOUT:
        keep = keep_mask(seed, b, h, query_pos + offs_m, key_pos + offs_n, drop_threshold)
        dp = tl.where(keep, dp * drop_scale, 0.0)
        p_dropped = tl.where(keep, p * drop_scale, 0.0)
    else:
        p_dropped = p
    return p_dropped, p * (dp - di[:, None])


@triton.jit
def load_rows(Q, DO, LSE, DI, b, h, q0, offs_m, lq, offs_d, offs_dv, D, DV, sqb, sqh, sql, sdb, sdh, sdl, slb, slh):
    """A query tile's q (M, BLOCK_D), dO (M, BLOCK_DV), lse (M,) (+inf beyond the length) and D (M,)."""
    rows = offs_m < lq
    q = tl.load(Q + b * sqb + h * sqh + (q0 + offs_m)[:, None] * sql + offs_d[None, :],
                mask=rows[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + (q0 + offs_m)[:, None] * sdl + offs_dv[None, :],
                 mask=rows[:, None] & (offs_dv[None, :] < DV), other=0.0)
    lse = tl.load(LSE + b * slb + h * slh + q0 + offs_m, mask=rows, other=float("inf"))
    di = tl.load(DI + b * slb + h * slh + q0 + offs_m, mask=rows, other=0.0)
    return q, do, lse, di


@triton.jit
def load_keys(K, V, b, h, k0, offs_n, lk, offs_d, offs_dv, D, DV, skb, skh, skl, svb, svh, svl):
    """A key tile's k (N, BLOCK_D) and v (N, BLOCK_DV), zero beyond the length."""
    cols = offs_n < lk
    k = tl.load(K + b * skb + h * skh + (k0 + offs_n)[:, None] * skl + offs_d[None, :],
                mask=cols[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + b * svb + h * svh + (k0 + offs_n)[:, None] * svl + offs_dv[None, :],
                mask=cols[:, None] & (offs_dv[None, :] < DV), other=0.0)
    return k, v


@triton.jit
def _dkdv_kernel(
    Q, K, V, DO, LSE, DI, W, PAD, CU, SEEDS, DK, DV_OUT,
    sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl, slb, slh, swh, spb, sph,
    Lq, Lk, D, DV, scale, bias_scale, delta, val_off, lo, hi, query_pos, key_pos, drop_threshold, drop_scale,
    batch_seed, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_VARLEN: tl.constexpr, SEED_IN_MEMORY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    h = tl.program_id(1)
    b, q0, k0, lq, lk, seed = sequence(CU, SEEDS, batch_seed, tl.program_id(2), Lq, Lk, IS_VARLEN, SEED_IN_MEMORY)
    start_n = tl.program_id(0) * BLOCK
    if start_n < lk:
        offs_n = start_n + tl.arange(0, BLOCK)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k, v = load_keys(K, V, b, h, k0, offs_n, lk, offs_d, offs_dv, D, DV, skb, skh, skl, svb, svh, svl)
        dk = tl.zeros((BLOCK, BLOCK_D), tl.float32)
        dv = tl.zeros((BLOCK, BLOCK_DV), tl.float32)
        kp, any_kept = key_row(PAD, b, h, spb, sph, offs_n, lk, HAS_PAD)
        begin, end = query_tiles(start_n, lq, delta, lo, hi, BLOCK, HAS_LO, HAS_HI)
        if any_kept:
            for start_m in range(begin, end, BLOCK):
                offs_m = start_m + tl.arange(0, BLOCK)
                q, do, lse, di = load_rows(Q, DO, LSE, DI, b, h, q0, offs_m, lq, offs_d, offs_dv, D, DV,
                                           sqb, sqh, sql, sdb, sdh, sdl, slb, slh)
                p, ds = score_grad_tile(q, k, v, do, lse, di, W + h * swh, kp, offs_m, offs_n, lq, lk, delta, val_off,
                                        lo, hi, scale, bias_scale, seed, b, h, query_pos, key_pos, drop_threshold,
                                        drop_scale, HAS_LO, HAS_HI, HAS_PAD, HAS_DROPOUT, PRECISION)
                dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
                dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
        cols = offs_n < lk
        tl.store(DK + b * skb + h * skh + (k0 + offs_n)[:, None] * skl + offs_d[None, :],
                 (dk * scale).to(DK.dtype.element_ty), mask=cols[:, None] & (offs_d[None, :] < D))
        tl.store(DV_OUT + b * svb + h * svh + (k0 + offs_n)[:, None] * svl + offs_dv[None, :],
                 dv.to(DV_OUT.dtype.element_ty), mask=cols[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _dq_kernel(
    Q, K, V, DO, LSE, DI, W, PAD, CU, SEEDS, DQ,
    sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl, slb, slh, swh, spb, sph,
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
        q, do, lse, di = load_rows(Q, DO, LSE, DI, b, h, q0, offs_m, lq, offs_d, offs_dv, D, DV,
                                   sqb, sqh, sql, sdb, sdh, sdl, slb, slh)
        dq = tl.zeros((BLOCK, BLOCK_D), tl.float32)
        begin, end = key_tiles(start_m, lk, delta, lo, hi, BLOCK, HAS_LO, HAS_HI)
        for start_n in range(begin, end, BLOCK):
            offs_n = start_n + tl.arange(0, BLOCK)
            kp, any_kept = key_row(PAD, b, h, spb, sph, offs_n, lk, HAS_PAD)
            if any_kept:
                k, v = load_keys(K, V, b, h, k0, offs_n, lk, offs_d, offs_dv, D, DV, skb, skh, skl, svb, svh, svl)
                p, ds = score_grad_tile(q, k, v, do, lse, di, W + h * swh, kp, offs_m, offs_n, lq, lk, delta, val_off,
                                        lo, hi, scale, bias_scale, seed, b, h, query_pos, key_pos, drop_threshold,
                                        drop_scale, HAS_LO, HAS_HI, HAS_PAD, HAS_DROPOUT, PRECISION)
                dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        tl.store(DQ + b * sqb + h * sqh + (q0 + offs_m)[:, None] * sql + offs_d[None, :],
                 (dq * scale).to(DQ.dtype.element_ty), mask=(offs_m[:, None] < lq) & (offs_d[None, :] < D))


def backward_dkdv(query, key, value, grad_out, lse, di, w, padding, plan: Plan):
    """(dk, dv), contiguous, in the dtypes of ``key`` and ``value``; arguments as :func:`backward_dq`."""
    pointers, args, meta = launch_args(plan, query, key, value, grad_out, lse, w, padding)
    dk, dv = torch.empty_like(key), torch.empty_like(value)
    assert dk.stride() == key.stride() and dv.stride() == value.stride(), "key and value must be contiguous"
    grid = (plan.tiles(key.shape[2]), query.shape[1], plan.sequences(query))
    _dkdv_kernel[grid](query, key, value, grad_out, lse, di, *pointers, dk, dv, *args, **meta)
    return dk, dv


def backward_dq(query, key, value, grad_out, lse, di, w, padding, plan: Plan):
    """dq, contiguous, in the dtype of ``query``. ``grad_out`` (B, H, Lq, Dv) contiguous; ``lse`` (B, H, Lq)
    float32 with +inf for queries that saw no key; ``di`` like ``lse``: ``dO . out - grad_lse``; the rest as
    :func:`relbias.backends.triton._forward.forward`'s (query, key and value contiguous)."""
    pointers, args, meta = launch_args(plan, query, key, value, grad_out, lse, w, padding)
    dq = torch.empty_like(query)
    assert dq.stride() == query.stride(), "query must be contiguous"
    grid = (plan.tiles(query.shape[2]), query.shape[1], plan.sequences(query))
    _dq_kernel[grid](query, key, value, grad_out, lse, di, *pointers, dq, *args, **meta)
    return dq
