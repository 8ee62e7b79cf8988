"""The triton backend under the Triton interpreter (CPU tensors): output, log-sum-exp and every gradient (query,
key, value, bias table) agree with the reference for every offset-only family, causal and bidirectional, Lq != Lk
with query and key positions, a key padding mask that leaves some queries nothing, several tiles per axis; float16
within float16's rounding; the bias-table gradient repeats bit for bit; the band fold is the diagonal sums."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.biases import FAMILIES, make_bias

from ._triton_cases import assert_agree as _assert_agree, require_interpreter, run
from .._tolerance import assert_rounding_close

require_interpreter()

from relbias.backends.triton._bias_grad import fold_bands  # noqa: E402  (needs triton)

B, H, D, DV = 2, 2, 8, 12
OFFSET_ONLY = [name for name in FAMILIES
               if name != "none" and make_bias(name, num_heads=1, max_len=8, bidirectional=True).offset_only]


def _inputs(lq, lk, *, dtype=torch.float32, padded=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, lq, D, generator=gen).to(dtype)
    k = torch.randn(B, H, lk, D, generator=gen).to(dtype)
    v = torch.randn(B, H, lk, DV, generator=gen).to(dtype)
    keep = None
    if padded:
        keep = torch.rand(B, 1, 1, lk, generator=gen) > 0.3
        keep[1, ..., : lk // 2] = False  # batch 1: the early queries of a causal call see only padding
    return q, k, v, keep


def _bias(family, causal, max_len=64, dtype=torch.float32):
    bias = make_bias(family, num_heads=H, max_len=max_len, bidirectional=not causal)
    with torch.no_grad():
        for p in bias.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * 0.5)
    return bias.to(dtype)



@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("family", OFFSET_ONLY)
def test_every_offset_only_family_agrees_with_the_reference(family, causal):
    q, k, v, keep = _inputs(37, 37)
    bias = _bias(family, causal)
    got = run("triton", q, k, v, bias, is_causal=causal, mask=keep)
    want = run("reference", q, k, v, bias, is_causal=causal, mask=keep)
    assert torch.isinf(want[1]).any() == causal  # the case holds queries that see nothing (causal, batch 1)
    _assert_agree(got, want, n=37)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lq, lk, query_start, key_start", [(20, 45, None, 0), (45, 20, None, 0), (19, 30, 40, 3),
                                                            (16, 33, 0, 0)])
def test_unequal_lengths_and_positions_agree_with_the_reference(lq, lk, query_start, key_start, causal):
    q, k, v, keep = _inputs(lq, lk, padded=lq != 16)
    bias = _bias("t5", causal, max_len=128)
    kwargs = dict(is_causal=causal, mask=keep, query_start=query_start, key_start=key_start)
    _assert_agree(run("triton", q, k, v, bias, **kwargs), run("reference", q, k, v, bias, **kwargs), n=max(lq, lk))


def test_a_function_bias_and_a_bias_shared_by_every_head():
    q, k, v, keep = _inputs(30, 30)
    bias = relbias.FunctionBias(lambda offset: -0.1 * offset.abs().float())  # one head: shared by both
    _assert_agree(run("triton", q, k, v, bias, mask=keep)[:5], run("reference", q, k, v, bias, mask=keep)[:5], n=30)
    shared = relbias.ALiBiBias(1)
    _assert_agree(run("triton", q, k, v, shared, is_causal=True), run("reference", q, k, v, shared, is_causal=True),
                  n=30)


def test_float16_agrees_within_its_rounding():
    q, k, v, keep = _inputs(40, 40, dtype=torch.float16)
    bias = _bias("t5", True)
    got = run("triton", q, k, v, bias, is_causal=True, mask=keep)
    want = run("reference", q, k, v, bias, is_causal=True, mask=keep)
    assert got[0].dtype == torch.float16 and got[2].dtype == torch.float16
    _assert_agree(got, want, n=40, dtype=torch.float16)


def test_the_bias_gradient_repeats_bit_for_bit():
    q, k, v, keep = _inputs(40, 40)
    bias = _bias("t5", False)
    first = run("triton", q, k, v, bias, mask=keep, dropout_p=0.2)
    second = run("triton", q, k, v, bias, mask=keep, dropout_p=0.2)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_tiles_of_another_size_give_the_same_result():
    from relbias.backends.triton import triton_attention
    from relbias.call import make_call

    q, k, v, keep = _inputs(40, 40)
    call = make_call(q, k, v, bias=_bias("kerple_log", True), mask=keep, is_causal=True)
    small, large = triton_attention(call, block=16), triton_attention(call, block=32)
    assert_rounding_close(small[0], large[0], n=40)
    with pytest.raises(ValueError, match="power of two >= 16, got 24"):
        triton_attention(call, block=24)


def test_the_band_fold_is_the_sum_along_each_diagonal():
    gen = torch.Generator().manual_seed(0)
    n, key_tiles, query_tiles, columns = 4, 3, 2, 2 * 4 + 3 * 4 - 1
    partial = torch.randn(2, query_tiles + key_tiles - 1, n, n, generator=gen, dtype=torch.float64)
    first = (key_tiles * n - 1) - key_tiles * n + 1  # value offset Lk - 1 with Lk = 12
    want = torch.zeros(2, columns, dtype=torch.float64)
    for band in range(partial.shape[1]):
        for a in range(n):
            for c in range(n):
                want[:, first + band * n + n - 1 + a - c] += partial[:, band, a, c]
    assert_rounding_close(fold_bands(partial, columns, first), want, n=2)
