"""Grouped-query attention: ``enable_gqa=True`` as torch SDPA's, on every backend that runs the call, against SDPA
(no bias) and against explicitly repeated key/value heads (with a bias), gradients included; clear errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import relbias
from relbias.backends import BACKENDS

from ._tolerance import assert_rounding_close
from .hardening._cases import build_bias


def _inputs(hq=6, hkv=2, lq=24, lk=24, grad=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, lq, 8, generator=g)
    k, v = torch.randn(2, hkv, lk, 8, generator=g), torch.randn(2, hkv, lk, 8, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v)]


def _runs(name, *args, **kwargs) -> bool:
    try:
        relbias.explain_backend(*args, backend=name, **kwargs)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "flex"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_without_a_bias_every_backend_equals_sdpas_gqa(name, is_causal):
    q, k, v = _inputs(lq=24 if name != "decode" else 3)
    kwargs = dict(is_causal=is_causal, enable_gqa=True, scale=0.5)
    with torch.no_grad():
        if not _runs(name, q, k, v, **kwargs):
            pytest.skip(f"{name} does not run this call")
        got = relbias.attention(q, k, v, backend=name, **kwargs)
    causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(k.shape[2] - q.shape[2])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=causal if is_causal else None, scale=0.5, enable_gqa=True)
    assert_rounding_close(got, want, n=k.shape[2])


@pytest.mark.parametrize("family", ["t5", "alibi", "kerple_log", "fire"])
def test_with_a_bias_gqa_is_attention_on_repeated_key_and_value_heads(family):
    """Output and every gradient (query, key, value, bias parameters) equal those of the call with key and value
    repeated to the query's heads by hand, on auto's backend for training calls."""
    bias = build_bias(family, num_heads=6, bidirectional=False)
    q, k, v = _inputs(grad=True)
    out = relbias.attention(q, k, v, bias=bias, is_causal=True, enable_gqa=True)
    grads = torch.autograd.grad(out.square().sum(), [q, k, v, *bias.parameters()])
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = relbias.attention(q2, k2.repeat_interleave(3, 1), v2.repeat_interleave(3, 1), bias=bias, is_causal=True)
    want_grads = torch.autograd.grad(want.square().sum(), [q2, k2, v2, *bias.parameters()])
    assert torch.equal(out, want)  # the same call once the heads are repeated: the same code path
    for g, w in zip(grads, want_grads):
        assert torch.equal(g, w)
    assert grads[1].shape == k.shape and grads[2].shape == v.shape  # summed back over each group


def test_a_decoding_step_with_gqa_equals_the_reference():
    bias = relbias.T5Bias(6, bidirectional=False)
    q, k, v = _inputs(lq=1, lk=300)
    with torch.no_grad():
        assert relbias.explain_backend(q, k, v, bias=bias, is_causal=True, enable_gqa=True)[0] == "decode"
        got = relbias.attention(q, k, v, bias=bias, is_causal=True, enable_gqa=True)
        want = relbias.attention(q, k, v, bias=bias, is_causal=True, enable_gqa=True, backend="reference")
    assert_rounding_close(got, want, n=300)


def test_unequal_heads_without_enable_gqa_say_how():
    q, k, v = _inputs()
    with pytest.raises(ValueError, match="num_heads differ: query 6, key 2, value 2; .*pass enable_gqa=True"):
        relbias.attention(q, k, v)
    with pytest.raises(ValueError, match=r"num_heads differ: query 6, key 4, value 4$"):
        relbias.attention(q, *_inputs(hkv=4)[1:])  # 6 is not a multiple of 4: no hint


def test_enable_gqa_refuses_what_it_cannot_group():
    q, k, v = _inputs(hkv=4)
    with pytest.raises(ValueError, match=r"query's num_heads \(6\) to be a multiple of the key's and value's \(4\)"):
        relbias.attention(q, k, v, enable_gqa=True)
    q, k, _ = _inputs()
    with pytest.raises(ValueError, match="key and value must have the same num_heads, got key 2, value 3"):
        relbias.attention(q, k, torch.randn(2, 3, 24, 8), enable_gqa=True)
    with pytest.raises(TypeError, match="enable_gqa must be a bool, got 1"):
        relbias.attention(q, k, k, enable_gqa=1)
    with pytest.raises(ValueError, match="num_heads"):  # a bias with the key's head count, not the query's
        relbias.attention(q, k, k, bias=relbias.T5Bias(2), enable_gqa=True)


def test_equal_heads_with_enable_gqa_change_nothing():
    q, k, v = _inputs(hkv=6)
    with torch.no_grad():
        assert torch.equal(relbias.attention(q, k, v, enable_gqa=True), relbias.attention(q, k, v))


@pytest.mark.parametrize("name", [n for n in BACKENDS if n != "flex"])
def test_with_a_t5_bias_every_backend_that_runs_agrees_with_the_reference(name):
    bias = build_bias("t5", num_heads=6, bidirectional=True)
    q, k, v = _inputs(lq=24 if name != "decode" else 2)
    kwargs = dict(bias=bias, enable_gqa=True, return_lse=True)
    with torch.no_grad():
        if not _runs(name, q, k, v, **kwargs):
            pytest.skip(f"{name} does not run this call")
        got = relbias.attention(q, k, v, backend=name, **kwargs)
        want = relbias.attention(q, k, v, backend="reference", **kwargs)
    for a, b in zip(got, want):
        assert_rounding_close(a, b, n=k.shape[2])
