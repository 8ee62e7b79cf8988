"""The public log-sum-exp (``return_lse=True``): attention over keys split in two halves, merged by their
log-sum-exp, equals attention over all keys, outputs and gradients (q, k, v and bias parameters), on every
registered backend; the lse itself equals an independent logsumexp of the materialised scores."""

from __future__ import annotations

import math

import pytest
import torch

import relbias
from relbias.backends import BACKENDS

B, H, D = 2, 2, 8


def _bias(name, bidirectional):
    if name == "none":
        return None
    if name == "t5_small":
        bias = relbias.T5Bias(H, num_buckets=8, max_distance=16, bidirectional=bidirectional)
    elif name == "offset_clip":
        bias = relbias.PerOffsetBias(max_len=5, num_heads=H, bidirectional=bidirectional, out_of_range="clip")
    else:
        bias = relbias.ALiBiBias(H, bidirectional=bidirectional)
    with torch.no_grad():
        for p in bias.parameters():
            p.add_(0.5 * torch.randn_like(p))
    return bias


def _merge(o1, l1, o2, l2):
    """The design's merge rule, with rows that see no key in either part left at 0."""
    m = torch.logaddexp(l1, l2)
    safe = m.masked_fill(m == float("-inf"), 0.0)
    w1, w2 = torch.exp(l1 - safe)[..., None], torch.exp(l2 - safe)[..., None]
    return o1 * w1 + o2 * w2, m


def _refusal(backend, *args, **kwargs):
    try:
        relbias.explain_backend(*args, backend=backend, **kwargs)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "bidi"])
@pytest.mark.parametrize("family", ["none", "t5_small", "offset_clip", "alibi"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_two_halves_merged_by_lse_equal_attention_over_all_keys(backend, family, is_causal, small_tiles):
    lq, lk, split, query_start = 37, 45, 19, 8
    bias = _bias(family, bidirectional=not is_causal)
    q, k, v = (torch.randn(B, H, n, D) for n in (lq, lk, lk))
    q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
    mask = torch.ones(B, 1, 1, lk, dtype=torch.bool)
    mask[1, ..., 40:] = False  # padding in the second half of batch row 1
    mask[1, ..., :3] = False
    common = dict(bias=bias, is_causal=is_causal, query_start=query_start)
    parts = [(0, split), (split, lk)]
    grad_ok = True
    for s0, s1 in parts:
        with torch.no_grad():  # a backend without a backward is still checked forward
                why = _refusal(backend, q, k[:, :, s0:s1], v[:, :, s0:s1], mask=mask[..., s0:s1], key_start=s0, **common)
        if why is not None:
            pytest.skip(why)
    with torch.enable_grad():
        try:
            outs = [
                relbias.attention(q_, k_[:, :, s0:s1], v_[:, :, s0:s1], mask=mask[..., s0:s1], key_start=s0,
                                  backend=backend, return_lse=True, **common)
                for s0, s1 in parts
            ]
        except ValueError as exc:  # a backend that runs no backward (flex on CPU) is checked forward only
            assert "backward" in str(exc) or "log-sum-exp" in str(exc), exc
            grad_ok = False
            with torch.no_grad():
                outs = [
                    relbias.attention(q, k[:, :, s0:s1], v[:, :, s0:s1], mask=mask[..., s0:s1], key_start=s0,
                                      backend=backend, return_lse=True, **common)
                    for s0, s1 in parts
                ]
    (o1, l1), (o2, l2) = outs
    assert l1.dtype == torch.float32 and l1.shape == (B, H, lq)
    merged, lse = _merge(o1.float(), l1, o2.float(), l2)

    q_ref, k_ref, v_ref = (t.clone().requires_grad_() for t in (q, k, v))
    want, want_lse = relbias.attention(q_ref, k_ref, v_ref, mask=mask, backend="reference", return_lse=True, **common)
    torch.testing.assert_close(merged, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)
    if not grad_ok:
        return
    g_out, g_lse = torch.randn_like(want), torch.randn_like(want_lse)
    params = list(bias.parameters()) if bias is not None else []
    got_grads = torch.autograd.grad((merged * g_out).sum() + (lse * g_lse).sum(), [q_, k_, v_, *params])
    want_grads = torch.autograd.grad((want * g_out).sum() + (want_lse * g_lse).sum(), [q_ref, k_ref, v_ref, *params])
    for got, ref in zip(got_grads, want_grads):
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_lse_is_the_logsumexp_of_the_materialised_scores_and_minus_inf_for_empty_rows():
    bias = _bias("t5_small", bidirectional=True)
    q, k, v = (torch.randn(1, H, 6, D) for _ in range(3))
    mask = torch.ones(1, 1, 6, 6, dtype=torch.bool)
    mask[..., 2, :] = False  # query 2 sees no key
    with torch.no_grad():
        _, lse = relbias.attention(q, k, v, bias=bias, mask=mask, backend="reference", return_lse=True)
        scores = q @ k.transpose(-2, -1) + bias(6, 6)  # T5 convention: unscaled
    want = torch.logsumexp(scores, dim=-1)
    assert lse[..., 2].eq(float("-inf")).all()
    keep = [0, 1, 3, 4, 5]
    torch.testing.assert_close(lse[..., keep], want[..., keep])
    assert math.isclose(float(lse[0, 0, 0]), math.log(float(scores[0, 0, 0].exp().sum())), rel_tol=1e-5)


def test_return_lse_must_be_a_bool():
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(TypeError, match="return_lse must be a bool, got 1"):
        relbias.attention(q, q, q, return_lse=1)


def test_the_readme_recipe_true_positions_and_merge_partials():
    """The README's split-KV recipe: explicit query_start and key_start per block, merged by merge_partials (a
    query that sees no key in either block stays 0, where the bare formula gives NaN)."""
    from relbias.distributed import merge_partials

    q, k, v = torch.randn(1, H, 6, D), torch.randn(1, H, 10, D), torch.randn(1, H, 10, D)
    bias = relbias.ALiBiBias(H, bidirectional=False)
    mask = torch.ones(1, 1, 6, 10, dtype=torch.bool)
    mask[..., 0, :] = False  # query 0 sees nothing
    h = 4
    kw = dict(bias=bias, is_causal=True, query_start=4, return_lse=True)
    o1, l1 = relbias.attention(q, k[:, :, :h], v[:, :, :h], mask=mask[..., :h], key_start=0, **kw)
    o2, l2 = relbias.attention(q, k[:, :, h:], v[:, :, h:], mask=mask[..., h:], key_start=h, **kw)
    out, lse = merge_partials(o1, l1, o2, l2)
    want, want_lse = relbias.attention(q, k, v, mask=mask, **kw)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, want_lse)
    assert torch.equal(out[..., 0, :], torch.zeros_like(out[..., 0, :]))
