"""Local attention (``window=(left, right)``) on the triton backend under the Triton interpreter (CPU tensors, 16-row
tiles): output, log-sum-exp and every gradient (query, key, value, bias table) equal the reference given the band as
a bool mask, causal and bidirectional, Lq != Lk with query and key positions, with a key padding mask, in float32
and float16; tiles wholly outside the band are never read by the forward, the dq, dk/dv and bias-gradient kernels
(NaN there changes nothing); the bands of tiles the bias-gradient kernel launches are exactly those holding a
visible offset; a per-offset table is never evaluated outside the window; packed sequences with a window equal
running them one by one."""

from __future__ import annotations

import itertools

import pytest
import torch

import relbias

from ._triton_cases import assert_agree as _assert_agree, require_interpreter, run
from .._tolerance import rounding_tolerance
from .._window_band import band

require_interpreter()

B, H, D, DV = 2, 2, 8, 12
WINDOWS = [(5, 2), (None, 3), (7, None), (0, 0), (19, 40)]
# (Lq, Lk, query_start, key_start): square, fewer queries aligned to the last keys, more queries, positions apart
BLOCKS = [(37, 37, None, 0), (20, 70, None, 0), (45, 20, None, 0), (30, 45, 40, 3)]


def _inputs(lq, lk, *, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, lq, D, generator=gen).to(dtype)
    k = torch.randn(B, H, lk, D, generator=gen).to(dtype)
    v = torch.randn(B, H, lk, DV, generator=gen).to(dtype)
    padding = torch.rand(B, 1, 1, lk, generator=gen) > 0.25
    padding[1, ..., : lk // 3] = False  # left padding in batch 1: some windows hold only padded keys
    return q, k, v, padding


def _t5(causal, dtype=torch.float32):
    bias = relbias.T5Bias(H, num_buckets=8, max_distance=16, bidirectional=not causal)
    with torch.no_grad():
        bias.weight.normal_(generator=torch.Generator().manual_seed(7))
    return bias.to(dtype)



@pytest.mark.parametrize("causal", [False, True])
def test_a_window_equals_the_reference_with_the_band_as_a_mask(causal):
    bias = _t5(causal)
    for (lq, lk, qs, ks), window in itertools.product(BLOCKS, WINDOWS):
        q, k, v, padding = _inputs(lq, lk)
        keep = band(lq, lk, qs, ks, window, causal)[None, None] & padding
        got = run("triton", q, k, v, bias, mask=padding, window=window, is_causal=causal, query_start=qs,
                  key_start=ks)
        want = run("reference", q, k, v, bias, mask=keep, query_start=qs, key_start=ks)
        _assert_agree(got, want, n=max(lq, lk))


def test_float16_with_a_window_agrees_within_its_rounding():
    q, k, v, padding = _inputs(40, 40, dtype=torch.float16)
    bias = _t5(True)
    got = run("triton", q, k, v, bias, mask=padding, window=(9, 0), is_causal=True)
    want = run("reference", q, k, v, bias, mask=band(40, 40, None, 0, (9, 0), True)[None, None] & padding)
    assert got[0].dtype == torch.float16 and got[2].dtype == torch.float16
    _assert_agree(got, want, n=40, dtype=torch.float16)


def test_alibi_and_a_bias_shared_by_every_head_with_a_window():
    q, k, v, padding = _inputs(33, 33)
    for bias in (relbias.ALiBiBias(H), relbias.KerpleLogBias(1)):
        got = run("triton", q, k, v, bias, mask=padding, window=(4, 6))
        want = run("reference", q, k, v, bias, mask=band(33, 33, None, 0, (4, 6), False)[None, None] & padding)
        _assert_agree(got, want, n=33)


def test_a_per_offset_table_is_never_evaluated_outside_the_window():
    # 8 entries with clipping off: no value for offsets >= 8, which a causal window of 8 keys never reads
    q, k, v, _ = _inputs(50, 50)
    strict = relbias.PerOffsetBias(max_len=8, num_heads=H, bidirectional=False, init_std=1.0)
    clipped = relbias.PerOffsetBias(max_len=8, num_heads=H, bidirectional=False, out_of_range="clip")
    clipped.load_state_dict(strict.state_dict())
    got = run("triton", q, k, v, strict, is_causal=True, window=(7, 0))
    want = run("reference", q, k, v, clipped, mask=band(50, 50, None, 0, (7, 0), True)[None, None])
    _assert_agree(got, want, n=50)


@pytest.mark.parametrize("case", ["keys", "queries"])
def test_tiles_wholly_outside_the_band_are_never_read(case):
    """NaN in rows only tiles outside the band hold: a kernel that read one would spread it (0 * NaN) to what it
    computes. Keys: 16 queries at positions 48..63 with a causal window of 4 keys reach key tiles 2 and 3 only, so
    key tiles 0 and 1 are read by no forward, dq or bias-gradient program, and their dk/dv programs visit nothing.
    Queries: 64 queries at positions 0..63 seeing keys i .. i + 2 of 16 keys: query tiles 1..3 see none."""
    from relbias.backends.triton import triton_attention
    from relbias.call import make_call

    if case == "keys":
        lq, lk, window, causal, query_start = 16, 64, (3, 0), True, None
    else:
        lq, lk, window, causal, query_start = 64, 16, (0, 2), False, 0
    q, k, v, _ = _inputs(lq, lk)
    poisoned = [t.clone() for t in (q, k, v)]
    if case == "keys":
        for t in poisoned[1:]:
            t[:, :, :32] = float("nan")
    else:
        poisoned[0][:, :, 16:] = float("nan")
    bias = _t5(causal)
    leaves = [t.clone().requires_grad_() for t in poisoned]
    call = make_call(*leaves, bias=bias, is_causal=causal, window=window, query_start=query_start)
    out, lse = triton_attention(call)  # directly: the backend refuses NaN in a hidden key
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad((out * g).sum(), [*leaves, bias.weight])
    got = [out, lse, *grads]
    assert all(bool(torch.isfinite(t.masked_fill(torch.isneginf(t), 0)).all()) for t in got)
    # the reference on finite inputs (0 where the NaN was): rows it never reads, with gradient 0
    clean = [t.nan_to_num(0.0).requires_grad_() for t in poisoned]
    keep = band(lq, lk, query_start, 0, window, causal)[None, None]
    ref_out, ref_lse = relbias.attention(*clean, bias=bias, mask=keep, query_start=query_start, backend="reference",
                                         return_lse=True)
    want = [ref_out, ref_lse, *torch.autograd.grad((ref_out * g).sum(), [*clean, bias.weight])]
    _assert_agree(got, want, n=max(lq, lk))


def test_the_bias_gradient_launches_exactly_the_bands_that_hold_a_visible_offset():
    from relbias.backends.triton import make_plan
    from relbias.call import make_call

    for (lq, lk, qs, ks), window, causal in itertools.product(BLOCKS + [(64, 64, None, 0)], WINDOWS + [None],
                                                              [False, True]):
        q = torch.zeros(1, 1, lq, 8)
        k = torch.zeros(1, 1, lk, 8)
        call = make_call(q, k, k, bias=relbias.ALiBiBias(1), is_causal=causal, window=window, query_start=qs,
                         key_start=ks)
        plan = make_plan(call, 16)
        visible = band(lq, lk, qs, ks, window or (None, None), causal)
        padded = torch.zeros(plan.tiles(lq) * 16, plan.tiles(lk) * 16, dtype=torch.bool)
        padded[:lq, :lk] = visible
        tiles = padded.view(plan.tiles(lq), 16, plan.tiles(lk), 16).any(dim=(1, 3))  # (query tile, key tile)
        wanted = {qt - kt for qt, kt in tiles.nonzero().tolist()}
        first, stop = plan.bands(lq, lk)
        launched = set(range(first, stop))
        assert wanted <= launched, (lq, lk, qs, ks, window, causal)
        # a launched band holds a visible offset (it may meet the block only in rows or columns beyond the lengths)
        for r in launched - wanted:
            offsets = {r * 16 + a - c + call.delta for a in range(16) for c in range(16)}
            lo, hi = call.offset_band
            assert any((lo is None or o >= lo) and (hi is None or o <= hi) for o in offsets)


def test_tiles_of_another_size_give_the_same_windowed_result():
    from relbias.backends.triton import triton_attention
    from relbias.call import make_call

    q, k, v, padding = _inputs(45, 60)
    call = make_call(q, k, v, bias=_t5(False), mask=padding, window=(11, 3), query_start=30)
    want = relbias.attention(q, k, v, bias=_t5(False), mask=padding & band(45, 60, 30, 0, (11, 3), False)[None, None],
                             query_start=30, backend="reference")
    for block in (16, 32):
        got = triton_attention(call, block=block)[0]
        atol, rtol = rounding_tolerance(want, n=60)
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dropout_p", [0.0, 0.25])
def test_packed_sequences_with_a_window_equal_running_them_one_by_one(causal, dropout_p):
    bounds = [0, 5, 5, 38, 57]  # an empty sequence; the longest spans three 16-row tiles
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, 57, D, generator=gen) for _ in range(3))
    bias = _t5(causal)
    window = (6, 0) if causal else (4, 9)
    got = run("triton", q, k, v, bias, function=relbias.attention_varlen, args=(bounds,), is_causal=causal,
              dropout_p=dropout_p, window=window)
    want = run("reference", q, k, v, bias, function=relbias.attention_varlen, args=(bounds,), is_causal=causal,
               dropout_p=dropout_p, window=window)
    _assert_agree(got, want, n=57)
