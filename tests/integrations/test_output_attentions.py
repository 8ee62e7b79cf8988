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


@pytest.mark.parametrize("when", ["built", "after patching"])
@pytest.mark.parametrize("family", ["t5", "mt5", "umt5"])
def test_weights_set_on_the_config_are_returned_with_gradients(hf, family, when):
    """``output_attentions`` on the config (transformers' recorder reads it; the attention function is not told),
    in the config the model is built from, or set on ``model.config`` after patching: the patched encoder returns
    weights exactly when the unpatched eager one does (always for a built config), equal to them, and the output is
    computed from them, so a gradient of the output reaches them (retain_grad) and equals eager's."""
    results = []
    for patch in (False, True):
        settings = {"output_attentions": True} if when == "built" else {}
        model = hf.tiny_model(family, "EncoderModel", attn_implementation="eager", **settings)
        model = patch_t5(model) if patch else model
        model.config.output_attentions = True
        input_ids, attention_mask = hf.batch(length=24, pad_last=5)
        out = model(input_ids=input_ids, attention_mask=attention_mask)
        for weights in out.attentions or ():
            weights.retain_grad()
        out.last_hidden_state.square().sum().backward()
        results.append(None if out.attentions is None else [(w.detach(), w.grad) for w in out.attentions])
    got, want = results[1], results[0]
    assert (got is None) == (want is None) and (want is not None or when != "built")
    for (weights, grad), (want_weights, want_grad) in zip(got or (), want or ()):
        torch.testing.assert_close(weights, want_weights, rtol=1e-5, atol=1e-6)
        assert grad is not None and grad.abs().sum() > 0
        torch.testing.assert_close(grad, want_grad, rtol=1e-4, atol=1e-5)
