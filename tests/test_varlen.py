"""Packed variable-length sequences (relbias.attention_varlen, MultiheadAttention(cu_seqlens=), ByteLM): the same as
running each sequence alone, outputs and gradients, on every backend that runs the per-sequence calls; the
boundaries are checked by name."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.biases import make_bias
from relbias.experiments import ByteLM, ByteLMConfig
from relbias.nn import MultiheadAttention

from ._tolerance import assert_rounding_close

LENGTHS = [37, 0, 64, 5, 90]  # an empty sequence too
BOUNDS = [0, 37, 37, 101, 106, 196]
H, D = 2, 8


def _packed(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1, H, BOUNDS[-1], D, generator=gen, dtype=dtype).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("backend", ["auto", "reference", "blockwise", "toeplitz"])
@pytest.mark.parametrize("family, causal", [("t5", True), ("alibi", False), ("offset", True), ("kerple_log", False)])
def test_packed_equals_each_sequence_alone(backend, family, causal):
    bias = make_bias(family, num_heads=H, bidirectional=not causal, max_len=128).double()
    q, k, v = _packed()
    out, lse = relbias.attention_varlen(q, k, v, torch.tensor(BOUNDS), bias=bias, is_causal=causal,
                                        backend=backend, return_lse=True)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=out.dtype)
    grads = torch.autograd.grad((out * weights).sum(), [q, k, v, *bias.parameters()])
    alone_grads = [torch.zeros_like(g) for g in grads]
    for start, end in zip(BOUNDS[:-1], BOUNDS[1:]):
        if start == end:
            continue
        piece = slice(start, end)
        leaves = [t.detach()[:, :, piece].requires_grad_() for t in (q, k, v)]
        o, l = relbias.attention(*leaves, bias=bias, is_causal=causal, backend=backend, return_lse=True)
        assert torch.equal(out[:, :, piece], o) and torch.equal(lse[:, :, piece], l)  # the same call, alone
        g = torch.autograd.grad((o * weights[:, :, piece]).sum(), [*leaves, *bias.parameters()])
        for n in range(3):
            alone_grads[n][:, :, piece] = g[n]
        for n in range(3, len(g)):
            alone_grads[n] += g[n]
    for got, want in zip(grads[:3], alone_grads[:3]):
        assert torch.equal(got, want)
    for got, want in zip(grads[3:], alone_grads[3:]):  # the bias gradient: a sum over sequences either way
        assert_rounding_close(got, want, n=len(LENGTHS))


def test_no_token_attends_across_a_boundary():
    """Changing one sequence's keys and values leaves every other sequence's output as it was."""
    q, k, v = (t.detach() for t in _packed())
    bias = relbias.T5Bias(H)
    before = relbias.attention_varlen(q, k, v, BOUNDS, bias=bias)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 37:101] += 5.0
    v2[:, :, 37:101] -= 3.0
    after = relbias.attention_varlen(q, k2, v2, BOUNDS, bias=bias)
    outside = torch.ones(BOUNDS[-1], dtype=torch.bool)
    outside[37:101] = False
    assert torch.equal(before[:, :, outside], after[:, :, outside])
    assert not torch.equal(before[:, :, 37:101], after[:, :, 37:101])


@pytest.mark.parametrize("bounds, error, match", [
    ([1, 196], ValueError, "must start at 0"),
    ([0, 50, 40, 196], ValueError, "entry 2 is 40 after 50"),
    ([0, 100], ValueError, "end at the packed length T = 196, got 100"),
    ([0, 98.0, 196], TypeError, "must hold integers"),
    (torch.tensor([[0, 196]]), ValueError, "must be 1-D"),
    (torch.tensor([0.0, 196.0]), TypeError, "must hold integers, got torch.float32"),
])
def test_bad_boundaries_are_refused_by_name(bounds, error, match):
    q, k, v = (t.detach() for t in _packed())
    with pytest.raises(error, match=match):
        relbias.attention_varlen(q, k, v, bounds)


def test_packed_tensors_must_have_batch_one():
    q = torch.randn(2, H, 10, D)
    with pytest.raises(ValueError, match=r"packed \(1, H, T, D\) tensors; query is \(2, 2, 10, 8\)"):
        relbias.attention_varlen(q, q, q, [0, 10])


def test_multihead_attention_packs_like_separate_calls():
    torch.manual_seed(0)
    layer = MultiheadAttention(16, 2, batch_first=True, is_causal=True,
                               position_bias=relbias.T5Bias(2, bidirectional=False))
    x = torch.randn(1, 60, 16)
    bounds = [0, 25, 60]
    packed, weights = layer(x, x, x, need_weights=False, cu_seqlens=bounds)
    assert weights is None
    for start, end in zip(bounds[:-1], bounds[1:]):
        alone, _ = layer(x[:, start:end], x[:, start:end], x[:, start:end], need_weights=False)
        assert_rounding_close(packed[:, start:end], alone, n=16)  # the projections see other rows: BLAS blocking
    with pytest.raises(ValueError, match="does not combine with key_padding_mask, need_weights=True"):
        layer(x, x, x, key_padding_mask=torch.zeros(1, 60, dtype=torch.bool), cu_seqlens=bounds)
    with pytest.raises(ValueError, match="batch must be 1, got 2"):
        layer(x.expand(2, -1, -1), need_weights=False, cu_seqlens=bounds)


def test_bytelm_trains_on_packed_documents():
    """Two documents in one row give each document's logits as if alone (no padding, no cross-document attention)."""
    torch.manual_seed(0)
    model = ByteLM(ByteLMConfig(position="alibi", max_len=64, embed_dim=16, num_heads=2, num_layers=2))
    docs = [torch.tensor([list(b"hello world")]), torch.tensor([list(b"packed documents, one row")])]
    tokens = torch.cat(docs, dim=1)
    bounds = [0, docs[0].shape[1], tokens.shape[1]]
    packed = model(tokens, cu_seqlens=bounds)
    for doc, start in zip(docs, bounds):
        assert_rounding_close(packed[:, start:start + doc.shape[1]], model(doc), n=64)
