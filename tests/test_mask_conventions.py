"""Float masks are additive: one of 0s and 1s only (a keep or padding mask passed in the wrong dtype, which would
mask nothing and shift some logits by 1) is refused with the way to pass it, by relbias.attention and by
MultiheadAttention's key_padding_mask and attn_mask; additive masks still run and equal their bool forms."""

from __future__ import annotations

import pytest
import torch

import relbias
from relbias.nn import MultiheadAttention

B, H, L, D = 2, 2, 12, 8


def _qkv():
    return [torch.randn(B, H, L, D) for _ in range(3)]


def _keep():
    keep = torch.ones(B, L)
    keep[0, 9:] = 0  # Hugging Face's attention_mask: 1 = attend
    return keep


@pytest.mark.parametrize("mask", [
    _keep()[:, None, None, :],
    torch.ones(1, 1, 1, L),  # no padding at all, still a 0/1 mask
    torch.eye(L)[None, None],
], ids=["keep-mask", "all-ones", "eye"])
def test_attention_refuses_a_float_mask_of_zeros_and_ones(mask):
    with pytest.raises(ValueError, match=r"float mask is additive .* only 0s and 1s.*mask\.bool\(\)"):
        relbias.attention(*_qkv(), bias=relbias.T5Bias(H), mask=mask)


def test_additive_float_masks_run_and_equal_their_bool_form():
    q, k, v = _qkv()
    keep = _keep()[:, None, None, :].bool()
    bias = relbias.T5Bias(H)
    want = relbias.attention(q, k, v, bias=bias, mask=keep, backend="reference")
    additive = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    torch.testing.assert_close(relbias.attention(q, k, v, bias=bias, mask=additive, backend="reference"), want,
                               rtol=0, atol=0)  # the same reference path: -inf and False mask the same keys
    shifted = additive + 0.5  # 0.5 / -inf: a constant shift of every visible score, which softmax ignores
    torch.testing.assert_close(relbias.attention(q, k, v, bias=bias, mask=shifted, backend="reference"), want,
                               rtol=1e-5, atol=1e-6)
    zeros = torch.zeros(1, 1, 1, L)  # no masking, additive
    torch.testing.assert_close(relbias.attention(q, k, v, bias=bias, mask=zeros, backend="reference"),
                               relbias.attention(q, k, v, bias=bias, backend="reference"), rtol=0, atol=0)


def test_multihead_attention_refuses_a_float_zero_one_key_padding_mask_and_attn_mask():
    layer = MultiheadAttention(16, 2, batch_first=True, position_bias=relbias.T5Bias(2))
    x = torch.randn(B, L, 16)
    with pytest.raises(ValueError, match=r"float key_padding_mask is additive .*\(mask == 0\).*mask\.bool\(\)"):
        layer(x, x, x, key_padding_mask=_keep(), need_weights=False)
    with pytest.raises(ValueError, match=r"float attn_mask is additive .*mask\.bool\(\)"):
        layer(x, x, x, attn_mask=torch.triu(torch.ones(L, L), 1), need_weights=False)
    padding = _keep() == 0
    want, _ = layer(x, x, x, key_padding_mask=padding, need_weights=False)
    additive = torch.zeros(B, L).masked_fill(padding, float("-inf"))
    got, _ = layer(x, x, x, key_padding_mask=additive, need_weights=False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # bool and additive masks take different paths
