"""The structured backend with a bool key padding mask: equal to the reference forward and backward, rows
that see no key give zeros and zero gradients, padded keys holding NaN/inf do not leak, and the batched
band path (interior blocks) really runs with the mask."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.backends._shared import band_interior as _band_interior
from relbias.backends._shared import tiled_kernel as _tiled_kernel


def _padding(batch, key_len):
    """(B, 1, 1, Lk): row 0 hides keys 0..19 (so early queries see no far past key, only band keys) and a gap
    wider than the band (keys 50..79); row 1 sees no key at all."""
    keep = torch.ones(batch, 1, 1, key_len, dtype=torch.bool)
    keep[0, ..., :20] = False
    keep[0, ..., 50:80] = False
    keep[1] = False
    return keep


def _run(backend, q, k, v, bias, mask, is_causal, grad_out):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    bias.zero_grad()
    out = relbias.attention(q, k, v, bias=bias, mask=mask, is_causal=is_causal, backend=backend)
    (out * grad_out).sum().backward()
    return [out, q.grad, k.grad, v.grad, bias.weight.grad]


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padded_structured_equals_the_reference_with_empty_rows_zero(is_causal, dtype, small_tiles, monkeypatch):
    calls = []
    original = _band_interior.interior_forward
    monkeypatch.setattr(_tiled_kernel, "interior_forward", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    torch.manual_seed(0)
    bias = relbias.T5Bias(2, num_buckets=8, max_distance=16, bidirectional=not is_causal).to(dtype)
    with torch.no_grad():
        bias.weight.normal_()
    q, k, v = (torch.randn(2, 2, 100, 8, dtype=dtype) for _ in range(3))
    mask = _padding(2, 100)
    grad_out = torch.randn(2, 2, 100, 8, dtype=dtype)
    assert relbias.explain_backend(q, k, v, bias=bias, mask=mask, is_causal=is_causal, backend="structured")
    got = _run("structured", q, k, v, bias, mask, is_causal, grad_out)
    want = _run("reference", q, k, v, bias, mask, is_causal, grad_out)
    assert calls  # the batched band took the mask rather than falling back to per-tile loops
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    out, dq, dk, dv, _ = got
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(dq[1], torch.zeros_like(dq[1]))
    assert torch.equal(dk[1], torch.zeros_like(dk[1])) and torch.equal(dv[1], torch.zeros_like(dv[1]))
    for hidden in (slice(0, 20), slice(50, 80)):  # padded keys get no gradient
        assert torch.equal(dk[0, :, hidden], torch.zeros_like(dk[0, :, hidden]))
        assert torch.equal(dv[0, :, hidden], torch.zeros_like(dv[0, :, hidden]))
    assert bool((out[0, :, 50:80].abs().sum(-1) > 0).all())  # rows in the gap still see far keys 20..49


def test_nan_and_inf_in_padded_keys_are_refused_by_structured_and_confined_by_what_auto_runs(small_tiles, monkeypatch):
    torch.manual_seed(1)
    monkeypatch.setattr("relbias.backends._shared.reasons.AUTO_REFERENCE_MAX_SCORES", 0)  # no small-block shortcut
    bias = relbias.T5Bias(2, num_buckets=8, max_distance=16)
    q, k, v = (torch.randn(2, 2, 100, 8) for _ in range(3))
    mask = torch.arange(100) < 80
    k[:, :, 80:], v[:, :, 80:] = float("nan"), float("inf")
    with pytest.raises(ValueError, match="backend .structured. cannot run this call: a key or value that some query cannot see holds NaN/inf"):
        relbias.attention(q, k, v, bias=bias, mask=mask, backend="structured")
    assert relbias.explain_backend(q, k, v, bias=bias, mask=mask)[0] == "blockwise"  # the backend that runs
    with torch.no_grad():
        got = relbias.attention(q, k, v, bias=bias, mask=mask)
        want = relbias.attention(q, k[:, :, :80], v[:, :, :80], bias=bias, query_start=0, backend="reference")
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_auto_takes_toeplitz_for_the_hugging_face_padding_mask():
    q = torch.zeros(2, 8, 4096, 64)  # finite values: dispatch checks keys and values for NaN/inf
    mask = torch.ones(2, 1, 1, 4096, dtype=torch.bool)
    mask[0, ..., 3900:] = False
    assert relbias.explain_backend(q, q, q, bias=relbias.T5Bias(8), mask=mask)[0] == "toeplitz"
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # the same padding as a float mask
    assert relbias.explain_backend(q, q, q, bias=relbias.T5Bias(8), mask=additive)[0] == "blockwise"
