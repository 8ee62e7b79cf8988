"""The gradient of the per-offset bias values, deterministic and in O(N) memory.

``dPE_h(t) = bias_scale * sum_{i - j = t} dS_ij``: the score gradient summed along each diagonal. With square tiles
of ``block`` rows, tile (query tile ``qt``, key tile ``kt``) holds the offsets ``(qt - kt) * block + a - c`` (a, c
its local row and column): every tile of one *band* ``r = qt - kt`` lays the same offsets on the same cells. So one
program per (band, head) walks its band's tiles through every sequence, recomputes ``dS`` and adds it, cell by cell,
into one (block, block) float32 accumulator: no atomics, a fixed order. The host then sums each accumulator along its
2·block - 1 diagonals, overlaps neighbouring bands (a band's upper block - 1 diagonals are the next band's lower
offsets) and sums over heads where the bias is shared, every step a plain reduction in a fixed order: two runs give
the same bits. Only the bands holding some offset the causal rule and the window leave visible get a program and an
accumulator (:meth:`._plan.Plan.bands`): about half of them causal, about W / block + 2 under a window of W keys.
Cost: one more pass over the tiles that recomputes ``q . k`` and ``dO . v`` (two of the backward's seven tile
products), and (bands x heads x block²) float32 of partial sums, O(N·block·H) memory: 48 MiB at 8192 tokens,
12 heads, block 64, against 3 GiB for a dense (H, L, L) bias gradient (O(W·block·H) under a window of W keys).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._backward import load_keys, load_rows, score_grad_tile
from ._plan import Plan, launch_args
from ._tiles import key_row, sequence

__all__ = ["bias_grad"]


@triton.jit
def _band_kernel(
    Q, K, V, DO, LSE, DI, W, PAD, CU, SEEDS, PARTIAL,
    sqb, sqh, sql, skb, skh, skl, svb, svh, svl, sdb, sdh, sdl, slb, slh, swh, spb, sph,
    Lq, Lk, D, DV, scale, bias_scale, delta, val_off, lo, hi, query_pos, key_pos, drop_threshold, drop_scale,
    batch_seed, S, FIRST_BAND,
    HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, HAS_PAD: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    IS_VARLEN: tl.constexpr, SEED_IN_MEMORY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    band = tl.program_id(0)
    h = tl.program_id(1)
    r = band + FIRST_BAND  # query tile minus key tile
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros((BLOCK, BLOCK), tl.float32)
    for s in range(0, S):
        b, q0, k0, lq, lk, seed = sequence(CU, SEEDS, batch_seed, s, Lq, Lk, IS_VARLEN, SEED_IN_MEMORY)
        first = tl.maximum(r, 0)
        last = tl.minimum((lq + BLOCK - 1) // BLOCK, (lk + BLOCK - 1) // BLOCK + r)
        for qt in range(first, last):
            offs_m = qt * BLOCK + tl.arange(0, BLOCK)
            offs_n = (qt - r) * BLOCK + tl.arange(0, BLOCK)
            kp, any_kept = key_row(PAD, b, h, spb, sph, offs_n, lk, HAS_PAD)
            if any_kept:
                q, do, lse, di = load_rows(Q, DO, LSE, DI, b, h, q0, offs_m, lq, offs_d, offs_dv, D, DV,
                                           sqb, sqh, sql, sdb, sdh, sdl, slb, slh)
                k, v = load_keys(K, V, b, h, k0, offs_n, lk, offs_d, offs_dv, D, DV, skb, skh, skl, svb, svh, svl)
                p, ds = score_grad_tile(q, k, v, do, lse, di, W + h * swh, kp, offs_m, offs_n, lq, lk, delta, val_off,
                                        lo, hi, scale, bias_scale, seed, b, h, query_pos, key_pos, drop_threshold,
                                        drop_scale, HAS_LO, HAS_HI, HAS_PAD, HAS_DROPOUT, PRECISION)
                acc += ds
    cells = tl.arange(0, BLOCK)
    base = PARTIAL + (h * tl.num_programs(0) + band) * BLOCK * BLOCK
    tl.store(base + cells[:, None] * BLOCK + cells[None, :], acc)


def bias_grad(query, key, value, grad_out, lse, di, w, padding, plan: Plan) -> torch.Tensor:
    """The gradient (Hb, M) float32 of the per-offset values ``w`` (Hb, M), ``bias_scale`` applied; arguments as
    :func:`relbias.backends.triton._backward.backward_dq`."""
    pointers, args, meta = launch_args(plan, query, key, value, grad_out, lse, w, padding)
    heads, block = query.shape[1], plan.block
    first, stop = plan.bands(query.shape[2], key.shape[2])  # the bands holding some offset of the causal rule/window
    if first >= stop:  # no query sees any key
        grad = w.new_zeros(heads, w.shape[1])
    else:
        partial = torch.empty(heads, stop - first, block, block, dtype=torch.float32, device=query.device)
        _band_kernel[(stop - first, heads)](query, key, value, grad_out, lse, di, *pointers, partial, *args,
                                            plan.sequences(query), first, **meta)
        grad = fold_bands(partial, w.shape[1], plan.value_offset(key.shape[2]) + first * block - block + 1)
    if w.shape[0] == 1:  # one bias for every head
        grad = grad.sum(0, keepdim=True)
    return grad * plan.bias_scale


def fold_bands(partial: torch.Tensor, columns: int, first: int) -> torch.Tensor:
    """(H, columns): per-offset sums of the band accumulators ``partial`` (H, bands, n, n), band u's cell (a, c)
    holding column ``first + u * n + (n - 1) + a - c``: diagonal sums of each accumulator (a skew: row a shifted
    right by a), each band's lower n and upper n - 1 diagonals added where neighbouring bands overlap."""
    heads, bands, n, _ = partial.shape
    flipped = partial.flip(-1)  # cell (a, n - 1 - c): diagonal a - c + n - 1 becomes the anti-diagonal a + c'
    skewed = torch.nn.functional.pad(flipped, (0, n)).flatten(-2)[..., : n * (2 * n - 1)]
    diagonals = skewed.view(heads, bands, n, 2 * n - 1).sum(-2)  # (H, bands, 2n - 1): offsets a - c = d - (n - 1)
    lower, upper = diagonals[..., :n], diagonals[..., n:]  # band u: columns first + u*n + [0, n) and [n, 2n - 1)
    lower[:, 1:, : n - 1] += upper[:, :-1]
    sums = torch.cat([lower.flatten(1), upper[:, -1]], dim=1)  # columns first .. first + bands * n + n - 2
    out = sums.new_zeros(heads, columns)
    lo, hi = max(0, first), min(columns, first + sums.shape[1])
    if lo < hi:
        out[:, lo:hi] = sums[:, lo - first: hi - first]
    return out
