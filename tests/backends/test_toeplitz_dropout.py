"""Attention dropout inside the toeplitz backend's native kernels: the counter-based mask of relbias._dropout,
generated per tile in the forward and regenerated in the backward. For a given seed the output, lse and every
gradient equal the reference's and blockwise's (float64: to rounding, so the same entries were dropped: one entry
dropped differently moves the output by O(1 / L)), with and without a key padding mask, causal and bidirectional,
for every offset-only family; the same seed repeats bit for bit, another seed differs."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.backends.toeplitz import _native as _toeplitz_native
from relbias.biases import make_bias

from .._tolerance import assert_rounding_close

pytestmark = pytest.mark.skipif(
    _toeplitz_native.native_unavailable_reason() is not None,
    reason=f"native toeplitz kernels unavailable: {_toeplitz_native.native_unavailable_reason()}",
)

L, D, B, H, P = 200, 16, 2, 3, 0.2


def _inputs(family, causal, padded, dtype=torch.float64):
    gen = torch.Generator().manual_seed(3)
    bias = make_bias(family, num_heads=H, bidirectional=not causal, max_len=L).to(dtype)
    qkv = [torch.randn(B, H, L, D, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]
    keep = None
    if padded:
        keep = torch.rand(B, 1, 1, L, generator=gen) > 0.25
        keep[1, ..., 150:] = False
    return bias, qkv, keep


def _run(backend, bias, qkv, keep, causal, seed=11):
    out, lse = relbias.attention(*qkv, bias=bias, mask=keep, is_causal=causal, backend=backend, return_lse=True,
                                 dropout_p=P, generator=torch.Generator().manual_seed(seed))
    loss = (out * torch.linspace(-1, 1, D, dtype=out.dtype)).sum() + lse.masked_fill(torch.isinf(lse), 0.0).sum()
    return out, lse, torch.autograd.grad(loss, [*qkv, *bias.parameters()])


@pytest.mark.parametrize("padded", [False, True], ids=["no-mask", "padded"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidi"])
@pytest.mark.parametrize("family", ["t5", "offset", "alibi", "kerple_log", "kerple_power"])
def test_dropout_matches_the_reference_and_blockwise(family, causal, padded):
    bias, qkv, keep = _inputs(family, causal, padded)
    assert relbias.explain_backend(*qkv, bias=bias, mask=keep, is_causal=causal, dropout_p=P)[0] == "toeplitz"
    out, lse, grads = _run("toeplitz", bias, qkv, keep, causal)
    for other in ("reference", "blockwise"):
        want_out, want_lse, want_grads = _run(other, bias, qkv, keep, causal)
        assert_rounding_close(out, want_out, n=L)
        empty = torch.isinf(want_lse)
        assert torch.equal(torch.isinf(lse), empty)
        assert_rounding_close(lse.masked_fill(empty, 0.0), want_lse.masked_fill(empty, 0.0), n=L)
        for got, want in zip(grads, want_grads):
            assert_rounding_close(got, want, n=B * H * L * L)


def test_float32_dropout_matches_the_reference_to_rounding():
    bias, qkv, keep = _inputs("t5", True, True, dtype=torch.float32)
    out, lse, grads = _run("toeplitz", bias, qkv, keep, True)
    want_out, _, want_grads = _run("reference", bias, qkv, keep, True)
    assert_rounding_close(out, want_out, n=L)
    for got, want in zip(grads, want_grads):
        assert_rounding_close(got, want, n=B * H * L * L)


def test_the_same_seed_repeats_bit_for_bit_and_another_seed_differs():
    bias, qkv, keep = _inputs("alibi", False, True)
    first, again, other = (_run("toeplitz", bias, qkv, keep, False, seed=s) for s in (5, 5, 6))
    assert torch.equal(first[0], again[0]) and all(torch.equal(a, b) for a, b in zip(first[2], again[2]))
    assert (first[0] - other[0]).abs().max() > 1e-3


def test_without_the_native_kernels_dropout_goes_to_blockwise(monkeypatch):
    monkeypatch.setenv("RELBIAS_NATIVE", "0")
    bias, qkv, _ = _inputs("t5", False, False)
    monkeypatch.setattr("relbias.backends._shared.reasons.AUTO_REFERENCE_MAX_SCORES", 0)  # no small-block shortcut
    name, reason = relbias.explain_backend(*qkv, bias=bias, dropout_p=P)
    assert name == "blockwise" and "runs in the native kernels only" in reason
