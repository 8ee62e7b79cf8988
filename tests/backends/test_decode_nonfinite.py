"""NaN/inf in keys and values some query cannot see, on the decode backend: the native kernel keeps them to the queries
that see them without reading the keys beforehand; without it (CPU flash, RELBIAS_NATIVE=0) the call goes to a
backend that confines them. First calls and repeats of a kept signature alike."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias import _repeat
from relbias.backends.toeplitz import _native as _toeplitz_native
from relbias.backends.toeplitz._view import reversed_bias

from .._tolerance import assert_rounding_close

native = pytest.mark.skipif(_toeplitz_native.native_unavailable_reason() is not None,
                            reason=f"native kernels unavailable: {_toeplitz_native.native_unavailable_reason()}")

H, D = 2, 8


@pytest.fixture(autouse=True)
def _fresh_signatures():
    _repeat.forget()
    yield
    _repeat.forget()


def _qkv(lq, lk, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(2, H, n, D, generator=g, dtype=dtype) for n in (lq, lk, lk))


def _poisoned(k, v, key_index, what):
    """Copies of k and v with ``what`` ("nan_value", "inf_value", "nan_key", "inf_key") at key ``key_index``."""
    k, v = k.clone(), v.clone()
    target = v if what.endswith("value") else k
    target[:, :, key_index] = float("nan") if what.startswith("nan") else float("inf")
    return k, v


def _sees(lq, lk, query_start, key_index, window):
    """(Lq,) bool: the queries that see key ``key_index`` (queries at query_start.., keys at 0..)."""
    t = torch.arange(lq) + query_start
    seen = key_index <= t
    if window is not None:
        seen &= t - window[0] <= key_index
    return seen


@native
@pytest.mark.parametrize("what", ["nan_value", "inf_value", "nan_key", "inf_key"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("lq, lk, query_start, key_index, window", [
    (16, 16, 0, 15, None), (16, 16, 0, 3, None), (6, 40, 34, 39, None), (1, 9, 7, 8, None),  # the last: nobody sees it
    (8, 40, 32, 30, (4, 0)), (8, 40, 32, 39, (4, 0)),
])
def test_the_native_kernel_keeps_a_hidden_nan_to_the_queries_that_see_it(
        monkeypatch, what, dtype, lq, lk, query_start, key_index, window):
    bias = relbias.T5Bias(num_heads=H, bidirectional=False)
    q, k, v = _qkv(lq, lk, dtype)
    k_bad, v_bad = _poisoned(k, v, key_index, what)
    kwargs = dict(bias=bias, is_causal=True, query_start=query_start, window=window)
    scanned = []  # (B, H, L, D) tensors reduced: the scan of hidden keys (_all_finite: a sum, then isfinite)

    def spy(original):
        return lambda t, *a, **kw: (t.dim() == 4 and scanned.append(tuple(t.shape))) or original(t, *a, **kw)

    monkeypatch.setattr(torch, "isfinite", spy(torch.isfinite))
    monkeypatch.setattr(torch.Tensor, "sum", spy(torch.Tensor.sum))
    with torch.no_grad():
        assert relbias.explain_backend(q, k_bad, v_bad, **kwargs)[0] == "decode"
        got = relbias.attention(q, k_bad, v_bad, **kwargs)
    assert not scanned, scanned  # no key or value was read to choose the backend
    monkeypatch.undo()
    with torch.no_grad():
        want = relbias.attention(q, k, v, backend="reference", **kwargs)
    sees = _sees(lq, lk, query_start, key_index, window)
    assert_rounding_close(got[:, :, ~sees], want[:, :, ~sees], n=lk)
    if what == "nan_value" or what == "nan_key":
        assert bool(torch.isnan(got[:, :, sees]).all())
    else:  # inf: at least not a finite made-up value
        assert not bool(torch.isfinite(got[:, :, sees]).all()) or not sees.any()


@native
@pytest.mark.parametrize("tiles", [(4, 8), (5, 3), (16, 16)])
@pytest.mark.parametrize("window_left", [-1, 6])
def test_the_native_forward_confines_a_hidden_nan_value_across_tiles(tiles, window_left):
    """The kernel itself, tiled: a NaN value at key 20 of a causal 32 x 32 call (with a window of 7 keys, or none)
    reaches exactly the queries that see it; every other output and lse equals the clean call's."""
    lq = lk = 32
    q, k, v = _qkv(lq, lk)
    values = torch.randn(1, lq + lk - 1, generator=torch.Generator().manual_seed(1))
    w = reversed_bias(values, torch.float32, 1.0, True, 0, lk)
    plan = {"scale": D ** -0.5, "delta": 0, "is_causal": True, "tile_q": tiles[0], "tile_k": tiles[1],
            "window_left": window_left, "window_right": -1}
    clean_out, clean_lse = _toeplitz_native.native_forward(q, k, v, w, plan)
    bad_v = v.clone()
    bad_v[0, 1, 20] = float("nan")
    out, lse = _toeplitz_native.native_forward(q, k, bad_v, w, plan)
    t = torch.arange(lq)
    sees = (t >= 20) & ((t - window_left <= 20) if window_left >= 0 else True)
    reached = torch.zeros(2, H, lq, dtype=torch.bool)
    reached[0, 1] = sees
    assert bool(torch.isnan(out[reached]).all())
    # every other row: the clean call's output (the rows of a tile with the NaN ran one GEMM each, a different BLAS
    # path: up to rounding) and its lse (no value enters it: bit-equal)
    assert_rounding_close(out[~reached], clean_out[~reached], n=lk)
    assert torch.equal(lse, clean_lse)


def test_without_the_native_kernel_decode_refuses_a_hidden_nan(monkeypatch):
    monkeypatch.setenv("RELBIAS_NATIVE", "0")
    bias = relbias.T5Bias(num_heads=H, bidirectional=False)
    q, k, v = _qkv(16, 16)
    _, v_bad = _poisoned(k, v, 15, "nan_value")
    with torch.no_grad():
        name, reason = relbias.explain_backend(q, k, v_bad, bias=bias, is_causal=True)
        out = relbias.attention(q, k, v_bad, bias=bias, is_causal=True)
    assert name != "decode" and "not decode: a key or value that some query cannot see holds NaN/inf" in reason
    assert bool(torch.isfinite(out[:, :, :15]).all()) and bool(torch.isnan(out[:, :, 15]).all())


@native
def test_a_repeat_confines_a_hidden_nan_with_or_without_the_native_kernel(monkeypatch):
    """A signature kept while the native kernel ran reads no key on a repeat; switched off (RELBIAS_NATIVE=0), the
    repeat reads the hidden keys again and a NaN there sends it to a backend that confines it."""
    bias = relbias.T5Bias(num_heads=H, bidirectional=False)
    q, k, v = _qkv(16, 16)
    _, v_bad = _poisoned(k, v, 15, "nan_value")
    with torch.no_grad():
        want = relbias.attention(q, k, v, bias=bias, is_causal=True, backend="reference")
        _repeat.forget()
        relbias.attention(q, k, v_bad, bias=bias, is_causal=True)  # kept: the native kernel needs no finite keys
        assert len(_repeat._PLANS) == 1
        for native_off in (False, True):
            if native_off:
                monkeypatch.setenv("RELBIAS_NATIVE", "0")
            out = relbias.attention(q, k, v_bad, bias=bias, is_causal=True)
            assert bool(torch.isnan(out[:, :, 15]).all())
            assert_rounding_close(out[:, :, :15], want[:, :, :15], n=16)
