"""The decode backend (issue 11, item 2): a few queries against many keys, every bias family, exact against the
reference (output and lse), chosen by auto for inference steps, refused with its reasons otherwise."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.backends.toeplitz import _native as _toeplitz_native
from relbias.backends.decode import MAX_QUERIES
from relbias.biases import FAMILIES

from ..hardening._cases import build_bias


@pytest.mark.parametrize("mask_kind", [None, "padding", "float"])
@pytest.mark.parametrize("lq, lk, query_start, is_causal", [(1, 300, None, True), (4, 300, None, True),
                                                           (16, 257, 100, True), (3, 200, 20, False)])
@pytest.mark.parametrize("family", sorted(FAMILIES) + ["t5_small", "offset_clip"])
def test_decode_equals_the_reference(family, lq, lk, query_start, is_causal, mask_kind):
    bias = build_bias(family, num_heads=2, bidirectional=not is_causal, max_len=512)
    q, k, v = torch.randn(2, 2, lq, 16), torch.randn(2, 2, lk, 16), torch.randn(2, 2, lk, 16)
    mask = None
    if mask_kind == "padding":
        mask = torch.ones(2, 1, 1, lk, dtype=torch.bool)
        mask[1, ..., :lk] = False  # batch row 1 sees nothing: zeros and lse -inf
        mask[0, ..., 5:40] = False
    elif mask_kind == "float":
        mask = torch.randn(1, 1, lq, lk).masked_fill(torch.rand(1, 1, lq, lk) < 0.3, float("-inf"))
    kwargs = dict(bias=bias, mask=mask, is_causal=is_causal, query_start=query_start, return_lse=True)
    with torch.no_grad():
        got, got_lse = relbias.attention(q, k, v, backend="decode", **kwargs)
        want, want_lse = relbias.attention(q, k, v, backend="reference", **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-5, atol=1e-5)
    if mask_kind == "padding":
        assert torch.equal(got[1], torch.zeros_like(got[1])) and bool((got_lse[1] == float("-inf")).all())


def test_auto_takes_decode_for_inference_steps_only():
    bias = relbias.T5Bias(8, bidirectional=False)
    q, k = torch.randn(1, 8, 1, 64), torch.randn(1, 8, 2048, 64)
    with torch.no_grad():
        assert relbias.explain_backend(q, k, k, bias=bias, is_causal=True)[0] == "decode"
        long = torch.randn(1, 8, MAX_QUERIES + 1, 64)
        name, reason = relbias.explain_backend(long, k, k, bias=bias, is_causal=True)
        assert name != "decode" and f"{MAX_QUERIES + 1} queries" in reason
    name, reason = relbias.explain_backend(q, k, k, bias=bias, is_causal=True)  # the table requires grad
    assert name != "decode" and "not decode: gradients are needed" in reason
    with torch.no_grad():
        half = relbias.explain_backend(q.bfloat16(), k.bfloat16(), k.bfloat16(), bias=bias, is_causal=True)
    if _toeplitz_native.runs_half(torch.bfloat16):  # the native kernel reads a bfloat16 cache in place
        assert half[0] == "decode" and "AMX-BF16" in half[1]
    else:  # a half-precision mask would round the bias: toeplitz runs it on float32 copies
        assert half[0] != "decode" and "does not run this dtype here" in half[1]


def test_decode_reads_no_key_to_validate_when_nothing_is_hidden(monkeypatch):
    """Queries on the last keys see every key under is_causal: nothing hidden, so no key or value is scanned."""
    calls = []
    original = torch.isfinite
    monkeypatch.setattr(torch, "isfinite", lambda t: calls.append(tuple(t.shape)) or original(t))
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 4096, 8)
    with torch.no_grad():
        relbias.attention(q, k, k, bias=relbias.ALiBiBias(2), is_causal=True, backend="decode")
    assert all(4096 not in shape for shape in calls), calls


@pytest.mark.parametrize("path", ["native", "sdpa", "strided"])
@pytest.mark.parametrize("return_lse", [False, True])
@pytest.mark.parametrize("lq, lk, query_start, is_causal", [(1, 300, None, True), (5, 260, 100, True),
                                                           (3, 200, 20, False)])
@pytest.mark.parametrize("family", ["t5", "alibi", "kerple_log"])
def test_decode_kernel_paths_equal_the_reference(monkeypatch, family, lq, lk, query_start, is_causal, return_lse, path):
    """Each kernel decode runs: relbias' native toeplitz forward (no mask), on contiguous inputs and on a key and value
    that are views of a longer buffer (a static cache: read in place), and SDPA with the bias rows as its mask where
    the native kernels are off (RELBIAS_NATIVE=0); with and without the lse."""
    from relbias.backends import decode
    from relbias.call import make_call

    if path == "sdpa":
        monkeypatch.setenv("RELBIAS_NATIVE", "0")
    bias = build_bias(family, num_heads=2, bidirectional=not is_causal, max_len=512)
    q = torch.randn(2, 2, lq, 16)
    if path == "strided":
        buffer = torch.randn(2, 2, 2, lk + 7, 16)
        k, v = buffer[0, :, :, :lk], buffer[1, :, :, :lk]
    else:
        k, v = torch.randn(2, 2, lk, 16), torch.randn(2, 2, lk, 16)
    kwargs = dict(bias=bias, is_causal=is_causal, query_start=query_start)
    with torch.no_grad():
        native = decode._native_forward(make_call(q, k, v, **kwargs))
        assert (native is not None) == (path != "sdpa" and decode._toeplitz_native.load_native() is not None)
        got = relbias.attention(q, k, v, backend="decode", return_lse=return_lse, **kwargs)
        want = relbias.attention(q, k, v, backend="reference", return_lse=return_lse, **kwargs)
    for g, w in zip(got, want) if return_lse else [(got, want)]:
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
