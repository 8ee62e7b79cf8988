"""Device functions shared by the Triton kernels: which rows a program's sequence holds, which tiles of the other
axis a tile's rows may see (the band of the causal rule and a window), the biased and masked scores of one (query
tile, key tile), and the dropout bits of a tile (the counter-based mask of :mod:`relbias._dropout`, bit for bit).

A kernel's third program axis is its sequence: a batch entry (all of its Lq queries and Lk keys), or one packed
sequence of ``cu_seqlens`` (:func:`relbias.attention_varlen`), whose rows start at ``cu_seqlens[s]`` of batch 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["keep_mask", "key_row", "key_tiles", "query_tiles", "sequence", "tile_scores"]


@triton.jit
def sequence(CU, SEEDS, batch_seed, s, Lq, Lk, IS_VARLEN: tl.constexpr, SEED_IN_MEMORY: tl.constexpr):
    """(batch entry, first query row, first key row, query_len, key_len, dropout seed) of sequence ``s``: a packed
    sequence's seed from ``SEEDS``, a batch's ``batch_seed``, or with ``SEED_IN_MEMORY`` (a seed drawn on the device
    in a compiled graph) ``SEEDS[0]``."""
    if IS_VARLEN:
        start = tl.load(CU + s)
        length = tl.load(CU + s + 1) - start
        return 0, start, start, length, length, tl.load(SEEDS + s)
    else:
        if SEED_IN_MEMORY:
            return s, 0, 0, Lq, Lk, tl.load(SEEDS)
        else:
            return s, 0, 0, Lq, Lk, batch_seed


@triton.jit
def key_row(PAD, b, h, spb, sph, offs_n, lk, HAS_PAD: tl.constexpr):
    """(padding row (N,), nonzero where a key is kept; whether any key of the tile is kept), or (placeholder, True)
    without padding."""
    if HAS_PAD:
        kp = tl.load(PAD + b * spb + h * sph + offs_n, mask=offs_n < lk, other=0)
        return kp, tl.max(kp, 0) != 0
    else:
        return offs_n, True


@triton.jit
def _mix(x):
    """lowbias32 (Chris Wellons' hash prospector) on uint32: the mixer of relbias._dropout."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x846CA68B, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def keep_mask(seed, batch, head, query_pos, key_pos, threshold):
    """(M, N) bool: the entries of queries ``query_pos`` (M,) and keys ``key_pos`` (N,) (absolute positions) that
    dropout keeps: the hash of (seed, batch, head, query, key) at least ``threshold`` (``p * 2**32``)."""
    x = _mix((tl.zeros((), tl.int32) + seed).to(tl.uint32))  # seed: a loaded int32 or a scalar argument
    x = _mix(x ^ (tl.zeros((), tl.int32) + batch).to(tl.uint32))  # batch may be a plain int (a loop index)
    x = _mix(x ^ head.to(tl.uint32))
    rows = _mix(x ^ query_pos.to(tl.uint32))
    x = _mix(rows[:, None] ^ key_pos.to(tl.uint32)[None, :])
    return x >= threshold.to(tl.uint32)


@triton.jit
def key_tiles(start_m, lk, delta, lo, hi, BLOCK: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """``(begin, end)``: the key rows, ``begin`` a multiple of ``BLOCK``, whose tiles the queries ``start_m`` to
    ``start_m + BLOCK - 1`` may see: keys ``j`` with ``lo <= i + delta - j <= hi`` (``begin >= end``: none)."""
    begin = 0
    end = lk
    if HAS_LO:  # keys j <= i + delta - lo
        end = tl.maximum(tl.minimum(lk, start_m + BLOCK + delta - lo), 0)
    if HAS_HI:  # keys j >= i + delta - hi, from the tile holding the first query's first one
        begin = (tl.maximum(start_m + delta - hi, 0) // BLOCK) * BLOCK
    return begin, end


@triton.jit
def query_tiles(start_n, lq, delta, lo, hi, BLOCK: tl.constexpr, HAS_LO: tl.constexpr, HAS_HI: tl.constexpr):
    """``(begin, end)``: the query rows, ``begin`` a multiple of ``BLOCK``, whose tiles may see the keys
    ``start_n`` to ``start_n + BLOCK - 1``: queries ``i`` with ``lo <= i + delta - j <= hi`` (``begin >= end``:
    none)."""
    begin = 0
    end = lq
    if HAS_LO:  # queries i >= j - delta + lo, from the tile holding the first key's first one
        begin = (tl.maximum(start_n - delta + lo, 0) // BLOCK) * BLOCK
    if HAS_HI:  # queries i <= j - delta + hi
        end = tl.maximum(tl.minimum(lq, start_n + BLOCK - delta + hi), 0)
    return begin, end


@triton.jit
def tile_scores(q, k, w_row, kp, offs_m, offs_n, lq, lk, delta, val_off, lo, hi, scale, bias_scale,
                HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """(scores, visible), both (M, N): ``scale * q . k + bias_scale * w[i - j + val_off]`` where key j is visible
    to query i (inside both lengths, inside the band ``lo <= i + delta - j <= hi`` (the causal rule and the window;
    a side checked only under ``HAS_LO`` / ``HAS_HI``), not padded), -inf elsewhere. ``w_row``: this head's
    per-offset values; ``kp`` (N,): the key tile's padding row (nonzero = kept)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    visible = (offs_m[:, None] < lq) & (offs_n[None, :] < lk)
    if HAS_LO:
        visible = visible & (offs_m[:, None] + delta - offs_n[None, :] >= lo)
    if HAS_HI:
        visible = visible & (offs_m[:, None] + delta - offs_n[None, :] <= hi)
    if HAS_PAD:
        visible = visible & (kp[None, :] != 0)
    w = tl.load(w_row + (offs_m[:, None] - offs_n[None, :] + val_off), mask=visible, other=0.0)
    return tl.where(visible, s + w * bias_scale, float("-inf")), visible
