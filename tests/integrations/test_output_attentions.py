"""Attention weights on request (issue 15, item 2): a patched model asked for ``output_attentions`` returns the
self-attention weights transformers' eager path returns, equal to the unpatched model's."""

from __future__ import annotations

import pytest
import torch

import relbias

pytest.importorskip("transformers")

from relbias.integrations.transformers import patch_t5  # noqa: E402


@pytest.mark.parametrize("family", ["t5", "mt5", "umt5"])
def test_patched_weights_equal_unpatched_eager(hf, family):
    plain = hf.tiny_model(family, attn_implementation="eager")
    patched = patch_t5(hf.tiny_model(family, attn_implementation="eager"))
    input_ids, attention_mask = hf.batch(length=40, pad_last=6)
    decoder_ids, _ = hf.batch(length=9, seed=2)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_ids, output_attentions=True)
    with torch.no_grad():
        got, want = patched(**inputs), plain(**inputs)
    for name in ("encoder_attentions", "decoder_attentions", "cross_attentions"):
        assert len(getattr(got, name)) == len(getattr(want, name)) == 2, name
        for g, w in zip(getattr(got, name), getattr(want, name)):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-5, atol=1e-5)


def test_attention_with_weights_matches_softmax_by_hand():
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    bias = relbias.T5Bias(2, bidirectional=False)
    out, weights = relbias.attention_with_weights(q, k, v, bias=bias, is_causal=True)
    scores = q @ k.transpose(-2, -1) + bias(5, 5)
    scores = scores.masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))
    torch.testing.assert_close(weights, torch.softmax(scores, dim=-1))
    torch.testing.assert_close(out, relbias.attention(q, k, v, bias=bias, is_causal=True))
    with pytest.raises(TypeError, match="backend="):
        relbias.attention_with_weights(q, k, v, backend="blockwise")
