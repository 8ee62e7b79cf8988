"""The toeplitz backend with a bool key padding mask (B or 1, H or 1, 1, Lk), the form patched Hugging Face models
pass: output, lse and every gradient (q, k, v, the bias parameters) equal the reference's for each offset-only
family, causal and bidirectional, with broadcast batch and head dimensions, queries whose visible keys are all
padded (out 0, lse -inf), a batch row padded throughout and key tiles wholly padding (skipped by the kernels). The
native kernels and the PyTorch path (``RELBIAS_NATIVE=0``) both."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.biases import make_bias

from .._tolerance import assert_rounding_close

FAMILIES = ["t5", "offset", "alibi", "kerple_log", "kerple_power"]
L, D, B, H = 300, 16, 2, 3


def _case(family, causal, mask_shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    bias = make_bias(family, num_heads=H, bidirectional=not causal, max_len=L).double()
    with torch.no_grad():  # away from the initial values, so that every parameter's gradient is exercised
        for parameter in bias.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=gen, dtype=parameter.dtype))
    q, k, v = (torch.randn(B, H, L, D, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    keep = torch.rand(*mask_shape, 1, L, generator=gen) > 0.3
    keep[..., :5] = False  # the first keys padded: causal queries 0..4 see none
    keep[..., 100:260] = False  # whole key tiles padded
    if mask_shape[0] == B:
        keep[1] = False  # a batch row padded throughout
    return bias, (q, k, v), keep


def _run(backend, bias, qkv, keep, causal):
    out, lse = relbias.attention(*qkv, bias=bias, mask=keep, is_causal=causal, backend=backend, return_lse=True)
    weights = torch.linspace(-1, 1, D, dtype=out.dtype)
    loss = (out * weights).sum() + lse.masked_fill(torch.isinf(lse), 0.0).square().sum()
    grads = torch.autograd.grad(loss, [*qkv, *bias.parameters()])
    return out, lse, grads


@pytest.mark.parametrize("native", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("mask_shape", [(B, H), (1, 1), (B, 1), (1, H)], ids=["BH", "11", "B1", "1H"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidi"])
@pytest.mark.parametrize("family", FAMILIES)
def test_key_padding_matches_the_reference(family, causal, mask_shape, native, monkeypatch):
    if not native:
        monkeypatch.setenv("RELBIAS_NATIVE", "0")
    bias, qkv, keep = _case(family, causal, mask_shape)
    assert relbias.explain_backend(*qkv, bias=bias, mask=keep, is_causal=causal)[0] == "toeplitz"
    out, lse, grads = _run("toeplitz", bias, qkv, keep, causal)
    want_out, want_lse, want_grads = _run("reference", bias, qkv, keep, causal)
    empty = torch.isneginf(want_lse)
    if causal or mask_shape[0] == B:  # causal queries 0..4, or the batch row padded throughout, see no key
        assert bool(empty.any())
    assert torch.equal(torch.isneginf(lse), empty)
    assert torch.equal(out[empty.expand_as(lse)], torch.zeros_like(out[empty.expand_as(lse)]))
    assert_rounding_close(out, want_out, n=L)
    assert_rounding_close(lse.masked_fill(empty, 0.0), want_lse.masked_fill(empty, 0.0), n=L)
    for got, want in zip(grads, want_grads):  # a bias parameter's gradient sums over every (query, key) pair
        assert_rounding_close(got, want, n=B * H * L * L)


def test_padded_keys_get_exactly_zero_gradient():
    bias, qkv, keep = _case("alibi", True, (B, 1))
    _, _, (dq, dk, dv) = (lambda r: (r[0], r[1], r[2][:3]))(_run("toeplitz", bias, qkv, keep, True))
    padded = ~keep[:, :, 0].expand(B, H, L)
    assert torch.equal(dk[padded], torch.zeros_like(dk[padded]))
    assert torch.equal(dv[padded], torch.zeros_like(dv[padded]))
    assert bool(dk[~padded].abs().sum() > 0)


def test_a_mask_that_pads_nothing_changes_nothing():
    """All-True padding runs the padded code path; it must give the unmasked call's results bit for bit (the
    padding row adds 0.0, which leaves every score as it was)."""
    bias, qkv, _ = _case("t5", False, (1, 1))
    keep = torch.ones(1, 1, 1, L, dtype=torch.bool)
    masked = _run("toeplitz", bias, qkv, keep, False)
    plain = _run("toeplitz", bias, qkv, None, False)
    assert torch.equal(masked[0], plain[0]) and torch.equal(masked[1], plain[1])
    for a, b in zip(masked[2], plain[2]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mask", [torch.ones(1, 1, L, L, dtype=torch.bool), torch.zeros(1, 1, 1, L)],
                         ids=["query-dimension", "float"])
def test_other_masks_are_refused_with_the_reason(mask):
    bias, qkv, _ = _case("t5", False, (1, 1))
    with pytest.raises(ValueError, match="not a bool key padding mask"):
        relbias.attention(*qkv, bias=bias, mask=mask, backend="toeplitz")


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidi"])
def test_right_and_left_padding_match_the_reference(side, causal):
    """Padding at one end only (Hugging Face's right padding; left padding for generation): the kernels then
    run the unpadded code on the kept keys' range alone."""
    bias, qkv, _ = _case("t5", causal, (1, 1))
    keep = torch.ones(B, 1, 1, L, dtype=torch.bool)
    for b, n in enumerate((L - 40, L - 170)):  # rows padded differently, one of them past a whole tile
        if side == "right":
            keep[b, ..., n:] = False
        else:
            keep[b, ..., : L - n] = False
    out, lse, grads = _run("toeplitz", bias, qkv, keep, causal)
    want_out, want_lse, want_grads = _run("reference", bias, qkv, keep, causal)
    empty = torch.isneginf(want_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    assert_rounding_close(out, want_out, n=L)
    assert_rounding_close(lse.masked_fill(empty, 0.0), want_lse.masked_fill(empty, 0.0), n=L)
    for got, want in zip(grads, want_grads):
        assert_rounding_close(got, want, n=B * H * L * L)


@pytest.mark.parametrize("native", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidi"])
def test_a_row_padded_throughout_sees_nothing_when_the_queries_follow_the_keys(causal, native, monkeypatch):
    """Queries placed after every key (query_start >= key_len: a ring block of earlier keys, a cached prefix) and a
    batch row whose keys are all padded: that row's queries get out 0 and lse -inf however far past the keys they
    sit, so that merging by log-sum-exp gives the block no weight."""
    if not native:
        monkeypatch.setenv("RELBIAS_NATIVE", "0")
    gen = torch.Generator().manual_seed(3)
    bias = make_bias("t5", num_heads=H, bidirectional=not causal, max_len=64).double()
    q = torch.randn(B, H, 8, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, H, 4, D, generator=gen, dtype=torch.float64) for _ in range(2))
    keep = torch.ones(B, 1, 1, 4, dtype=torch.bool)
    keep[1] = False
    call = dict(bias=bias, mask=keep, is_causal=causal, query_start=40, key_start=0, return_lse=True)
    out, lse = relbias.attention(q, k, v, backend="toeplitz", **call)
    want_out, want_lse = relbias.attention(q, k, v, backend="reference", **call)
    assert torch.equal(lse[1], torch.full_like(lse[1], float("-inf")))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert_rounding_close(out, want_out, n=4)
    assert_rounding_close(lse[0], want_lse[0], n=4)
