"""Device functions shared by the Triton kernels: which rows a program's sequence holds, the biased and masked
scores of one (query tile, key tile), and the dropout bits of a tile (the counter-based mask of
:mod:`relbias._dropout`, bit for bit).

A kernel's third program axis is its sequence: a batch entry (all of its Lq queries and Lk keys), or one packed
sequence of ``cu_seqlens`` (:func:`relbias.attention_varlen`), whose rows start at ``cu_seqlens[s]`` of batch 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["keep_mask", "key_row", "sequence", "tile_scores"]


@triton.jit
def sequence(CU, SEEDS, batch_seed, s, Lq, Lk, IS_VARLEN: tl.constexpr):
    """(batch entry, first query row, first key row, query_len, key_len, dropout seed) of sequence ``s``: a packed
    sequence's seed from ``SEEDS``, a batch's ``batch_seed``."""
    if IS_VARLEN:
        start = tl.load(CU + s)
        length = tl.load(CU + s + 1) - start
        return 0, start, start, length, length, tl.load(SEEDS + s)
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
def tile_scores(q, k, w_row, kp, offs_m, offs_n, lq, lk, delta, val_off, scale, bias_scale,
                IS_CAUSAL: tl.constexpr, HAS_PAD: tl.constexpr, PRECISION: tl.constexpr):
    """(scores, visible), both (M, N): ``scale * q . k + bias_scale * w[i - j + val_off]`` where key j is visible
    to query i (inside both lengths, not in the future under ``IS_CAUSAL``: j <= i + delta, not padded), -inf
    elsewhere. ``w_row``: this head's per-offset values; ``kp`` (N,): the key tile's padding row (nonzero = kept)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    visible = (offs_m[:, None] < lq) & (offs_n[None, :] < lk)
    if IS_CAUSAL:
        visible = visible & (offs_n[None, :] <= offs_m[:, None] + delta)
    if HAS_PAD:
        visible = visible & (kp[None, :] != 0)
    w = tl.load(w_row + (offs_m[:, None] - offs_n[None, :] + val_off), mask=visible, other=0.0)
    return tl.where(visible, s + w * bias_scale, float("-inf")), visible
