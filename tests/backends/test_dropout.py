"""Attention dropout with a counter-based mask: dropout_p=0 is bit-identical to no dropout; the mask (an integer
hash of the seed and the absolute coordinates) is bit-identical whatever the tiling, so the reference and blockwise
backends drop the same entries, and their outputs and gradients (other arithmetic: whole rows against tiles)
agree to rounding; the same seed repeats bit-identically; the expected output over many masks is the undropped
output; fused backends refuse it."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.backends.toeplitz import _native as _toeplitz_native
from relbias._dropout import Dropout


def _inputs(lq=23, lk=31, heads=2):
    q, k, v = torch.randn(2, heads, lq, 8), torch.randn(2, heads, lk, 8), torch.randn(2, heads, lk, 8)
    bias = relbias.T5Bias(heads, num_buckets=8, max_distance=16, bidirectional=False, init_std=1.0)
    return q, k, v, bias


def test_dropout_p_zero_is_bit_identical_to_no_dropout():
    q, k, v, bias = _inputs()
    for backend in ("reference", "blockwise"):
        plain = relbias.attention(q, k, v, bias=bias, is_causal=True, backend=backend)
        zero = relbias.attention(q, k, v, bias=bias, is_causal=True, backend=backend, dropout_p=0.0)
        assert torch.equal(plain, zero)


def test_the_mask_is_bit_identical_whatever_the_tiling_and_keyed_by_absolute_positions():
    """Tiles of any size (here 8 x 5, not dividing 23 x 31) regenerate the whole block's factors exactly (integer
    hashing, then the same cast and multiplication), and a call whose queries start later reads the same factors at
    the same absolute positions."""
    drop = Dropout(0.3, 12345, query_start=5, key_start=2)
    whole = drop.scale_tile(2, 3, 0, 23, 0, 31, "cpu", torch.float32)
    tiled = torch.cat([
        torch.cat([drop.scale_tile(2, 3, t0, min(t0 + 8, 23), s0, min(s0 + 5, 31), "cpu", torch.float32)
                   for s0 in range(0, 31, 5)], dim=-1)
        for t0 in range(0, 23, 8)
    ], dim=-2)
    assert torch.equal(tiled, whole)
    later = Dropout(0.3, 12345, query_start=13, key_start=2).scale_tile(2, 3, 0, 15, 0, 31, "cpu", torch.float32)
    assert torch.equal(later, whole[:, :, 8:])
    assert set(whole.unique().tolist()) == {0.0, torch.tensor(1 / 0.7, dtype=torch.float32).item()}
    assert 0.2 < (whole == 0).double().mean().item() < 0.4  # about p of the entries dropped
    other_seed = Dropout(0.3, 12346, query_start=5, key_start=2).scale_tile(2, 3, 0, 23, 0, 31, "cpu", torch.float32)
    assert not torch.equal(other_seed, whole)


def _lowbias32(x: int) -> int:
    """lowbias32 on a Python int (exact, no fixed-width arithmetic): the independent check of the tensor code."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) % 2**32
    x ^= x >> 15
    x = (x * 0x846CA68B) % 2**32
    return x ^ (x >> 16)


@pytest.mark.parametrize("p, seed, query_start, key_start", [
    (0.1, 0, 0, 0), (0.3, 12345, 5, 2), (0.5, 2**31 - 1, 2**31 - 3, 2**31 + 1), (0.9, 7, 2**32 + 9, 11),
])
def test_the_mask_is_lowbias32_of_the_coordinates(p, seed, query_start, key_start):
    """Each factor is decided by the hash of (seed, b, h, absolute query, absolute key) computed with Python's exact
    integers: kept (1 / (1 - p)) where it is at least floor(p 2^32), else 0; positions past 2^31 wrap as uint32."""
    drop = Dropout(p, seed, query_start=query_start, key_start=key_start)
    got = drop.scale_tile(2, 3, 4, 9, 1, 8, "cpu", torch.float64)
    threshold = int(p * 2**32)
    want = torch.zeros(2, 3, 5, 7, dtype=torch.float64)
    for b in range(2):
        for h in range(3):
            for i in range(5):
                for j in range(7):
                    x = _lowbias32(seed % 2**32)
                    for coordinate in (b, h, query_start + 4 + i, key_start + 1 + j):
                        x = _lowbias32(x ^ (coordinate % 2**32))
                    want[b, h, i, j] = 1 / (1 - p) if x >= threshold else 0.0
    assert torch.equal(got, want)


@pytest.mark.parametrize("is_causal", [True, False])
def test_reference_and_blockwise_drop_the_same_entries_outputs_and_gradients(is_causal, small_tiles):
    q, k, v, bias = _inputs()
    bias = relbias.T5Bias(2, num_buckets=8, max_distance=16, bidirectional=not is_causal, init_std=1.0)
    mask = torch.ones(2, 1, 1, 31, dtype=torch.bool)
    mask[1, ..., 25:] = False
    results = []
    for backend in ("reference", "blockwise"):  # blockwise runs 8x8 tiles here (small_tiles)
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        bias.zero_grad()
        out, lse = relbias.attention(q_, k_, v_, bias=bias, mask=mask, is_causal=is_causal, backend=backend,
                                     dropout_p=0.3, generator=torch.Generator().manual_seed(7), return_lse=True)
        ((out * torch.linspace(-1, 1, 8)).sum() + lse.sum()).backward()
        results.append([out, lse, q_.grad, k_.grad, v_.grad, bias.weight.grad.clone()])
    for got, want in zip(*results):  # the same mask (above), other arithmetic (whole rows, 8 x 8 tiles)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    undropped = relbias.attention(q, k, v, bias=bias, mask=mask, is_causal=is_causal)
    assert not torch.allclose(results[0][0], undropped, atol=1e-3)  # the mask did drop something


def test_same_generator_seed_same_mask_other_seed_other_mask():
    q, k, v, bias = _inputs()
    run = lambda seed: relbias.attention(q, k, v, bias=bias, is_causal=True, dropout_p=0.5,  # noqa: E731
                                         generator=torch.Generator().manual_seed(seed))
    assert torch.equal(run(1), run(1)) and not torch.equal(run(1), run(2))
    torch.manual_seed(3)
    a = relbias.attention(q, k, v, bias=bias, is_causal=True, dropout_p=0.5)
    torch.manual_seed(3)
    assert torch.equal(a, relbias.attention(q, k, v, bias=bias, is_causal=True, dropout_p=0.5))  # global RNG


def test_expected_output_is_the_undropped_output():
    """Inverted dropout is unbiased: the mean of 2000 dropped outputs (p = 0.2) is within 5 standard errors of
    the undropped output, entry by entry (the standard error is estimated from the same samples)."""
    q, k, v, bias = _inputs(lq=6, lk=9, heads=1)
    generator = torch.Generator().manual_seed(0)
    samples = torch.stack([
        relbias.attention(q, k, v, bias=bias, is_causal=True, dropout_p=0.2, generator=generator, backend="reference")
        for _ in range(2000)
    ])
    want = relbias.attention(q, k, v, bias=bias, is_causal=True)
    stderr = samples.std(dim=0) / 2000**0.5
    assert bool(((samples.mean(dim=0) - want).abs() <= 5 * stderr + 1e-6).all())


def test_toeplitz_takes_dropout_in_its_native_kernels_and_the_other_fused_backends_refuse_it(monkeypatch):
    monkeypatch.setattr("relbias.backends._shared.reasons.AUTO_REFERENCE_MAX_SCORES", 0)
    q, k, v, _ = _inputs(lq=40, lk=40)
    bias = relbias.T5Bias(2, num_buckets=8, max_distance=16)
    for name in ("structured", "flex"):
        with pytest.raises(ValueError, match=rf"backend '{name}' cannot run this call: .*attention dropout \(dropout_p=0.1\)"):
            relbias.attention(q, k, v, bias=bias, backend=name, dropout_p=0.1)
    native = _toeplitz_native.native_unavailable_reason() is None
    assert relbias.explain_backend(q, k, v, bias=bias, dropout_p=0.1)[0] == ("toeplitz" if native else "blockwise")
    monkeypatch.setenv("RELBIAS_NATIVE", "0")  # without the native kernels, dropout goes to blockwise
    with pytest.raises(ValueError, match=r"attention dropout \(dropout_p=0.1\) runs in the native kernels only"):
        relbias.attention(q, k, v, bias=bias, backend="toeplitz", dropout_p=0.1)
    assert relbias.explain_backend(q, k, v, bias=bias, dropout_p=0.1)[0] == "blockwise"
    with torch.no_grad():
        got = relbias.attention(q, k, v, bias=bias, dropout_p=0.1, generator=torch.Generator().manual_seed(0))
        want = relbias.attention(q, k, v, bias=bias, dropout_p=0.1, generator=torch.Generator().manual_seed(0),
                                 backend="blockwise")
    assert torch.equal(got, want)  # auto runs blockwise (above): the same backend, seed and inputs


@pytest.mark.parametrize("value", [-0.1, 1.0, float("nan"), True, "0.1"])
def test_bad_dropout_p_is_refused(value):
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        relbias.attention(q, q, q, dropout_p=value)
    with pytest.raises(TypeError, match="generator must be a torch.Generator"):
        relbias.attention(q, q, q, dropout_p=0.1, generator=0)
